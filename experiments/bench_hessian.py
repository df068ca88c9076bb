"""What does curvature cost? HVP vs gradient, and Lanczos vs the HVPs it is made of.

On the `tiny` preset (4 blocks, d=128, seq 128, batch 16, byte vocabulary), all jitted:
  grad     jax.value_and_grad of the mean token loss
  hvp      hessian.hvp (forward-over-reverse) with a random direction
  lanczos  hessian.lanczos with NUM_STEPS steps (full reorthogonalisation) on params_matvec
  hvp_loop NUM_STEPS chained HVPs in one lax.fori_loop (flat vector, no reorthogonalisation)
Each is compiled and run once before timing; then REPEATS rounds time one call of each, in
alternating order within the process (so slow drifts of a shared machine hit all of them
alike), and the medians are reported:

  hvp_over_grad       median(hvp) / median(grad)                  target <= 3.5 on CPU
  lanczos_overhead    median(lanczos) / (NUM_STEPS * median(hvp)) - 1   target <= 0.15
  overhead_vs_hvp_loop    median(lanczos) / median(hvp_loop) - 1

The issue defines the overhead against standalone HVP calls. On this CPU an HVP inside a
compiled fori_loop is much cheaper than the same HVP as its own jitted call (0.58x,
measured), which makes that overhead negative; the second ratio compares Lanczos with the
same number of HVPs in a plain loop. When each Lanczos step sat in a lax.cond (the breakdown
guard) that ratio was +43%: an HVP inside a cond in a fori_loop took 0.356 s against 0.265 s
without it. hessian.lanczos now carries the guard in a while_loop's condition instead.

  cd /work/main && .venv/bin/python experiments/bench_hessian.py

Writes results/bench/hessian.json (numbers of every round included). About 2-3 minutes.
"""
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np
from flax import nnx

from geonorm_jax import config as config_lib
from geonorm_jax import data as data_lib
from geonorm_jax import hessian, losses, model as model_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

OUTPUT = REPO_ROOT / "results" / "bench" / "hessian.json"
NUM_STEPS = 20
REPEATS = 5
TARGET_HVP_OVER_GRAD = 3.5
TARGET_LANCZOS_OVERHEAD = 0.15


def timed(fn, *args):
  started = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - started


def main():
  config = config_lib.get_config("tiny")
  graphdef, params = nnx.split(model_lib.build(config.model))
  tokens_BxL1 = np.asarray(next(iter(data_lib.make_train_iterator(config)))["tokens"], np.int32)
  loss_fn = lambda p, t: losses.lm_loss(nnx.merge(graphdef, p), t)
  flat_N, unravel = ravel_pytree(params)
  vector = unravel(jax.random.normal(jax.random.key(1), flat_N.shape, flat_N.dtype))

  grad = jax.jit(jax.value_and_grad(loss_fn))
  hvp = jax.jit(lambda p, v, t: hessian.hvp(loss_fn, p, v, t))
  lanczos = jax.jit(lambda p, t, k: hessian.lanczos(hessian.params_matvec(loss_fn, p, t), p,
                                                    NUM_STEPS, k))

  def chained_hvps(p, v_N, t):
    # Normalised each step so the values stay finite; that costs what Lanczos's own
    # normalisation costs, a negligible N-vector operation.
    step = lambda _, w_N: ravel_pytree(hessian.hvp(loss_fn, p, unravel(w_N), t))[0] / (
        1e-30 + jnp.linalg.norm(w_N))
    return jax.lax.fori_loop(0, NUM_STEPS, step, v_N)
  hvp_loop = jax.jit(chained_hvps)
  direction_N = ravel_pytree(vector)[0]
  calls = {
      "grad": lambda: grad(params, tokens_BxL1),
      "hvp": lambda: hvp(params, vector, tokens_BxL1),
      "lanczos": lambda: lanczos(params, tokens_BxL1, jax.random.key(0)),
      "hvp_loop": lambda: hvp_loop(params, direction_N, tokens_BxL1),
  }
  compile_s = {name: timed(call) for name, call in calls.items()}  # compile + first run
  load_before = os.getloadavg()
  rounds = {name: [] for name in calls}
  for _ in range(REPEATS):
    for name, call in calls.items():
      rounds[name].append(timed(call))
  load_after = os.getloadavg()

  median = {name: statistics.median(times) for name, times in rounds.items()}
  hvp_over_grad = median["hvp"] / median["grad"]
  lanczos_ratio = median["lanczos"] / (NUM_STEPS * median["hvp"])
  result = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                  "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                  "loadavg_1min_before_after": [load_before[0], load_after[0]]},
      "model": "tiny preset (gpt2 backbone, placement pre)",
      "num_params": int(flat_N.size),
      "tokens_per_batch": int(tokens_BxL1.shape[0] * (tokens_BxL1.shape[1] - 1)),
      "num_steps": NUM_STEPS, "repeats": REPEATS,
      "median_s": median, "rounds_s": rounds, "first_call_s_incl_compile": compile_s,
      "hvp_over_grad": hvp_over_grad,
      "lanczos_over_hvps": lanczos_ratio,
      "lanczos_overhead": lanczos_ratio - 1.0,
      "hvp_in_loop_over_hvp": median["hvp_loop"] / (NUM_STEPS * median["hvp"]),
      "overhead_vs_hvp_loop": median["lanczos"] / median["hvp_loop"] - 1.0,
      "targets": {"hvp_over_grad": TARGET_HVP_OVER_GRAD,
                  "lanczos_overhead": TARGET_LANCZOS_OVERHEAD},
      "meets_targets": {"hvp_over_grad": hvp_over_grad <= TARGET_HVP_OVER_GRAD,
                        "lanczos_overhead": lanczos_ratio - 1.0 <= TARGET_LANCZOS_OVERHEAD},
  }
  os.makedirs(OUTPUT.parent, exist_ok=True)
  with open(OUTPUT, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({k: result[k] for k in ("num_params", "median_s", "hvp_over_grad",
                                           "lanczos_overhead", "hvp_in_loop_over_hvp",
                                           "overhead_vs_hvp_loop", "meets_targets")}, indent=2))


if __name__ == "__main__":
  main()
