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

  python benchmarks/bench_hessian.py

Writes results/bench/hessian.json (numbers of every round included). About 2-3 minutes.

Three more modes:

  python benchmarks/bench_hessian.py --barriers
    One HVP of the tiny pre and geonorm models jitted with XLA's default CPU options and with
    compile_options.for_mesh (optimization barriers kept until fusion), 15 alternating rounds:
    results/bench/hessian_barriers.json. About 3 minutes.

  python benchmarks/bench_hessian.py --analysis=RUN [--num_steps=50 --num_probes=8 --rounds=3]
    The checkpoint analysis before issue 12 (OLD_COMMIT's hessian.py and hessian_cli._analyse,
    read from git: one jit, probes one after another, the HVP recomputed per micro-batch)
    against hessian_analysis.Analyser with the same settings, alternating, medians; plus how
    far apart their top eigenvalues, densities and traces are. Writes
    results/bench/hessian_analysis.json. RUN is a trained workdir, e.g. tinyshakespeare:
      python -m geonorm_jax train --workdir=/tmp/shk --config=configs/tiny.py:"data.source=text,\
        data.path=data/tinyshakespeare.txt,steps=60,lr=3e-3,warmup_steps=10,checkpoint.every=20"

  python benchmarks/bench_hessian.py --memory [--size=llama2_7b] [--num_layers=L]
    Per-device memory of a 20-step Lanczos with the basis in the parameters' shardings,
    lowered on abstract arrays and compiled for 8 fake CPU devices (FSDP); writes
    results/bench/hessian_memory.json (or hessian_memory_<size>_<L>l.json with --num_layers,
    which also compiles the same Lanczos without the shardings for comparison).
    With --memory_steps=4,20: the same at both step counts; the growth of the temporaries
    in between, over one basis row's shard, is the number of basis copies each device holds
    (hessian_memory_<size>_<L>l_steps.json).
"""
import datetime
import json
import math
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

from geonorm_jax import hessian
from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import losses, model as model_lib
from geonorm_jax.training import compile_options
from geonorm_jax.training import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

OUTPUT = REPO_ROOT / "results" / "bench" / "hessian.json"
OLD_COMMIT = "1bf060e"  # the Hessian analysis before issue 12 (sequential probes, no reuse)
NUM_STEPS = 20
REPEATS = 5
TARGET_HVP_OVER_GRAD = 3.5
TARGET_LANCZOS_OVERHEAD = 0.15


def timed(fn, *args):
  started = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - started


def tiny_problem(config_string="tiny"):
  """(loss_fn, params, a random direction shaped like them, one training batch) of a model."""
  config = config_lib.get_config(config_string)
  graphdef, params = nnx.split(model_lib.build(config.model))
  tokens_BxL1 = np.asarray(next(iter(data_lib.make_train_iterator(config)))["tokens"], np.int32)
  loss_fn = lambda p, t: losses.lm_loss(nnx.merge(graphdef, p), t)
  flat_N, unravel = ravel_pytree(params)
  vector = unravel(jax.random.normal(jax.random.key(1), flat_N.shape, flat_N.dtype))
  return loss_fn, params, vector, tokens_BxL1


def main():
  loss_fn, params, vector, tokens_BxL1 = tiny_problem()
  flat_N, unravel = ravel_pytree(params)

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


def barriers_main(rounds):
  """One HVP of the tiny pre and geonorm models, jitted with XLA's default CPU options and
  with compile_options.KEEP_BARRIERS (what compile_options.for_mesh gives a CPU: optimization
  barriers kept until fusion), alternating; medians and the largest difference between the
  two products."""
  options = compile_options.KEEP_BARRIERS
  out = {}
  for placement in ("pre", "geonorm"):
    loss_fn, params, vector, tokens_BxL1 = tiny_problem(f"tiny,placement={placement}")
    hvp = lambda p, v, t, loss_fn=loss_fn: hessian.hvp(loss_fn, p, v, t)
    calls = {"default": jax.jit(hvp), "barriers_kept": jax.jit(hvp, compiler_options=options)}
    values = {name: ravel_pytree(jax.block_until_ready(call(params, vector, tokens_BxL1)))[0]
              for name, call in calls.items()}
    times = {name: [] for name in calls}
    for r in range(rounds):
      for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
        times[name].append(timed(calls[name], params, vector, tokens_BxL1))
    out[placement] = {
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "rounds_s": times,
        "default_over_kept": statistics.median(times["default"]) /
                             statistics.median(times["barriers_kept"]),
        "max_abs_difference": float(jnp.max(jnp.abs(values["default"] -
                                                    values["barriers_kept"]))),
        "max_abs_value": float(jnp.max(jnp.abs(values["default"])))}
    print(placement, json.dumps({k: v for k, v in out[placement].items() if k != "rounds_s"}),
          flush=True)
  result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "jax": jax.__version__},
            "what": "one forward-over-reverse HVP of the tiny preset, random direction",
            "compiler_options": options, **out}
  (OUTPUT.parent / "hessian_barriers.json").write_text(json.dumps(result, indent=2) + "\n")


def analysis_main(workdir, num_steps, num_probes, num_batches, rounds, warmup, output):
  """Old (commit OLD_COMMIT) vs new default analysis of one checkpoint, alternating.

  With warmup=0 there is no untimed first call: every round's time includes compilation
  (for a long analysis whose single round is all that fits)."""
  import sys  # pylint: disable=g-import-not-at-top
  from geonorm_jax.hessian import analysis as hessian_analysis  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train
  old_hessian, old_analyse = _old_implementation()
  del old_hessian
  config, setup, state = train.restore_params(workdir)
  params = state["params"]
  _, tokens = hessian_analysis.validation_micro_batches(setup, num_batches)
  settings = hessian_analysis.Settings(num_steps=num_steps, num_probes=num_probes,
                                       num_batches=num_batches, top_k=min(10, num_steps))
  analyser = hessian_analysis.Analyser(setup, settings)
  old = jax.jit(lambda p, t, k: old_analyse(setup.graphdef, p, t, num_steps=num_steps,
                                            num_probes=num_probes, top_k=settings.top_k, key=k))
  calls = {
      "old": lambda: jax.device_get(old(params, tokens, jax.random.key(0))),
      "new": lambda: analyser.run(state, stream=sys.stderr),  # the CLI's plan, bar and ETA
  }
  # Includes compilation.
  first = {name: timed_value(call) for name, call in calls.items()} if warmup else {}
  rounds_s = {name: [] for name in calls}
  rounds_cpu_s = {name: [] for name in calls}
  outputs = {}
  for _ in range(rounds):
    for name, call in calls.items():
      cpu_started = time.process_time()
      seconds, outputs[name] = timed_value(call)
      rounds_s[name].append(seconds)
      rounds_cpu_s[name].append(time.process_time() - cpu_started)
  median = {name: statistics.median(times) for name, times in rounds_s.items()}
  old_out, new_out = outputs["old"], outputs["new"]
  old_top = np.asarray(old_out["top"], np.float64)
  new_top = np.asarray(new_out["lanczos"]["top_eigenvalues"], np.float64)
  bounds = np.asarray(new_out["lanczos"]["residual_bounds"], np.float64)
  old_grid = np.asarray(old_out["density"].grid, np.float64)
  old_density = np.asarray(old_out["density"].density, np.float64)
  new_on_old_grid = np.interp(old_grid, new_out["density"]["grid"], new_out["density"]["values"],
                              left=0.0, right=0.0)
  old_trace = old_out["hutchinson"]
  result = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                  "jax": jax.__version__, "loadavg_1min": os.getloadavg()[0]},
      "checkpoint": {"workdir": workdir, "step": int(state["step"]),
                     "num_params": new_out["num_params"], "num_tokens": new_out["num_tokens"],
                     "placement": config.model.placement},
      "old": f"commit {OLD_COMMIT}: one jit, Lanczos + SLQ (lax.map) + Hutchinson, the HVP "
             "recomputed per micro-batch",
      "new": "hessian_analysis.Analyser: linearized HVP, top run reused as a probe, trace "
             "from the density's probes, lanes " + str(settings.lanes_for(num_probes - 1)),
      "settings": {"num_steps": num_steps, "num_probes": num_probes, "num_batches": num_batches},
      "products": {"old": num_steps + num_probes * num_steps + num_probes,
                   "new": sum(new_out["products"].values())},
      "rounds": rounds, "rounds_s": rounds_s, "median_s": median,
      # CPU seconds of all threads: on a shared machine whose other jobs may be paused or
      # may pause this one, the ratio of these is the steadier measure.
      "rounds_cpu_s": rounds_cpu_s,
      "speedup_cpu": (statistics.median(rounds_cpu_s["old"]) /
                      statistics.median(rounds_cpu_s["new"])),
      "rounds_include_compilation": not warmup,
      "first_call_s_incl_compile": {name: value[0] for name, value in first.items()},
      "speedup": median["old"] / median["new"],
      "speedup_incl_compile": first["old"][0] / first["new"][0] if warmup else None,
      "new_seconds_per_stage_last_round": new_out["seconds"],
      "top_eigenvalues": {"old": old_top.tolist(), "new": new_top.tolist(),
                          "new_residual_bounds": bounds.tolist(),
                          "max_rel_diff_top3": float(np.max(np.abs(old_top[:3] - new_top[:3])
                                                            / np.abs(old_top[:3])))},
      "density_l1_old_vs_new": float(np.trapezoid(np.abs(old_density - new_on_old_grid), old_grid)),
      "trace": {"old_hutchinson": [float(old_trace.estimate), float(old_trace.stderr)],
                "old_slq": [float(old_out["density"].trace), float(old_out["density"].trace_stderr)],
                "new": [new_out["trace"]["estimate"], new_out["trace"]["stderr"]]},
  }
  result["trace"]["new_minus_old_hutchinson_in_combined_stderr"] = abs(
      result["trace"]["new"][0] - result["trace"]["old_hutchinson"][0]) / math.hypot(
          result["trace"]["new"][1], result["trace"]["old_hutchinson"][1])
  with open(REPO_ROOT / "results" / "bench" / output, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({k: result[k] for k in ("products", "median_s", "speedup",
                                           "top_eigenvalues", "density_l1_old_vs_new",
                                           "trace")}, indent=2))


MEMORY_STEPS = 20


def lanczos_memory(size, num_layers=0, fsdp=8, hvp="recomputed", sharded_basis=True,
                   num_steps=MEMORY_STEPS):
  """Per-device memory of a num_steps-step Lanczos on the Hessian of `size`, from
  jax.jit(...).lower(abstract arrays).compile().memory_analysis() on an FSDP mesh."""
  from geonorm_jax.hessian import analysis as hessian_analysis  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train
  overrides = [size, f"mesh.data=1,mesh.fsdp={fsdp},data.batch_size={fsdp},data.seq_len=128"]
  if num_layers:
    overrides.append(f"num_layers={num_layers}")
  config = config_lib.get_config(",".join(overrides))
  setup = train.make_setup(config, devices=jax.devices()[:fsdp])
  params = train.sharded_abstract_state(setup)["params"]
  tokens = jax.ShapeDtypeStruct((1, config.data.batch_size, config.data.seq_len + 1), jnp.int32,
                                sharding=setup.batch_sharding)
  settings = hessian_analysis.Settings(num_steps=num_steps, hvp=hvp, top_k=1)
  analyser = hessian_analysis.Analyser(setup, settings)
  shardings = setup.state_shardings["params"] if sharded_basis else None
  run = jax.jit(lambda p, t, k: hessian.lanczos(analyser._matvec(p, t), p, num_steps, k,  # pylint: disable=protected-access
                                                shardings=shardings).ritz_values)
  started = time.perf_counter()
  compiled = run.lower(params, tokens, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - started
  memory = compiled.memory_analysis()
  num_params = model_lib.count_params(params)
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
  per_device = {f: int(getattr(memory, f)) for f in fields}
  basis_bytes = (num_steps + 1) * num_params * 4
  return {
      "size": size, "num_layers": config.model.num_layers, "num_params": num_params,
      "mesh": {"fsdp": fsdp}, "hvp": hvp, "num_steps": num_steps, "basis_sharded": sharded_basis,
      "per_device_bytes": per_device,
      "per_device_gib": {f: v / 2**30 for f, v in per_device.items()},
      "basis_gib_replicated": basis_bytes / 2**30,
      "basis_gib_per_device_if_sharded": basis_bytes / fsdp / 2**30,
      "compile_s": compile_s,
  }


def memory_main(size, num_layers, steps):
  """One Lanczos per step count; with two, how many copies of the basis each device holds:
  the growth of its temporaries per added step over one basis row's shard."""
  if len(steps) > 1:
    runs = [lanczos_memory(size, num_layers, num_steps=s) for s in steps]
    first, last = runs[0], runs[-1]
    row_per_device = first["num_params"] * 4 / first["mesh"]["fsdp"]
    grown = (last["per_device_bytes"]["temp_size_in_bytes"] -
             first["per_device_bytes"]["temp_size_in_bytes"])
    copies = grown / ((last["num_steps"] - first["num_steps"]) * row_per_device)
    fixed = (first["per_device_bytes"]["temp_size_in_bytes"] -
             copies * (first["num_steps"] + 1) * row_per_device)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "what": f"Lanczos at {steps} steps (hessian_estimators.lanczos with the parameters' "
                "shardings), HVP recomputed, batch 8 x 128, compiled for 8 fake CPU devices "
                "(FSDP): the basis copies per device and the part that does not grow with "
                "the steps (the HVP's working set and the loop's vectors)",
        "jax": jax.__version__, "runs": runs,
        "basis_copies_per_device": copies,
        "temp_gib_not_growing_with_steps": fixed / 2**30,
        "unsharded_param_vector_gib": first["num_params"] * 4 / 2**30,
    }
    name = f"hessian_memory_{size}_{num_layers or 'full'}l_steps.json"
    with open(REPO_ROOT / "results" / "bench" / name, "w") as f:
      json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return
  result = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "what": f"{MEMORY_STEPS}-step Lanczos (hessian_estimators.lanczos with the parameters' "
              "shardings), HVP recomputed per micro-batch, batch 8 x 128, lowered on abstract "
              "arrays and compiled for 8 fake CPU devices (FSDP)",
      "jax": jax.__version__,
      "runs": [lanczos_memory(size, num_layers)],
  }
  if num_layers:  # small enough to compile twice: the same Lanczos without the shardings
    result["runs"].append(lanczos_memory(size, num_layers, sharded_basis=False))
  name = "hessian_memory.json" if not num_layers else f"hessian_memory_{size}_{num_layers}l.json"
  with open(REPO_ROOT / "results" / "bench" / name, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


def timed_value(fn):
  started = time.perf_counter()
  value = jax.block_until_ready(fn())
  return time.perf_counter() - started, value


def _old_implementation():
  """hessian.py and the CLI's `_analyse` as they were at OLD_COMMIT, read from git."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  show = lambda path: subprocess.run(["git", "show", f"{OLD_COMMIT}:{path}"], cwd=REPO_ROOT,
                                     check=True, capture_output=True, text=True).stdout
  old_hessian = types.ModuleType("old_hessian")
  # The old files sit at the old flat paths and import the old flat module names.
  hessian_source = show("geonorm_jax/hessian.py").replace(
      "from geonorm_jax.paths import", "from geonorm_jax.nn.paths import")
  exec(compile(hessian_source, "old_hessian.py", "exec"), old_hessian.__dict__)  # pylint: disable=exec-used
  cli_source = show("geonorm_jax/hessian_cli.py").replace(
      "from geonorm_jax import hessian, losses, train",
      "from geonorm_jax.nn import losses\nfrom geonorm_jax.training import train").replace(
      "from geonorm_jax import model as model_lib", "from geonorm_jax.nn import model as model_lib")
  namespace = {"hessian": old_hessian}
  exec(compile(cli_source, "old_hessian_cli.py", "exec"), namespace)  # pylint: disable=exec-used
  return old_hessian, namespace["_analyse"]


if __name__ == "__main__":
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--analysis", metavar="WORKDIR",
                      help="old vs new analysis of WORKDIR's latest checkpoint")
  parser.add_argument("--memory", action="store_true",
                      help="per-device memory of a sharded Lanczos (results/bench/hessian_memory.json)")
  parser.add_argument("--num_steps", type=int, default=50)
  parser.add_argument("--num_probes", type=int, default=8)
  parser.add_argument("--num_batches", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="--analysis: 0 "
                      "skips the untimed first call, so the rounds include compilation")
  parser.add_argument("--output", default="hessian_analysis.json",
                      help="--analysis: file name under results/bench/")
  parser.add_argument("--size", default="llama2_7b")
  parser.add_argument("--num_layers", type=int, default=0, help="--memory: override the size's "
                      "depth (0: keep it)")
  parser.add_argument("--memory_steps", default=str(MEMORY_STEPS), help="--memory: Lanczos "
                      "steps; two (e.g. 4,20) measure the basis copies per device from the "
                      "growth in between")
  parser.add_argument("--barriers", action="store_true", help="HVP with and without "
                      "compile_options (results/bench/hessian_barriers.json)")
  args = parser.parse_args()
  if args.barriers:
    barriers_main(rounds=15)
  elif args.analysis:
    analysis_main(args.analysis, args.num_steps, args.num_probes, args.num_batches, args.rounds,
                  args.warmup, args.output)
  elif args.memory:
    jax.config.update("jax_num_cpu_devices", 8)
    memory_main(args.size, args.num_layers, [int(s) for s in args.memory_steps.split(",")])
  else:
    main()
