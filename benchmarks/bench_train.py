"""Training speed on this CPU: our train step against a same-shape PyTorch eager GPT.

What a user would pick instead of us is a nanoGPT-style PyTorch model, so that is the yardstick:
`TorchGPT` below is GPT-2 pre-LN with the same shapes as our `pre` placement on the gpt2
backbone (learned positions of max_seq_len, biases, GELU-tanh MLP of 4d, untied head, AdamW
with gradient clipping, PyTorch's fused scaled_dot_product_attention). Both train on the same
tinyshakespeare batches in float32. Timed in one process, alternating torch and JAX rounds of a
few steps each (a shared machine drifts; alternation hits both alike), medians reported:

  models      tiny (4 layers, d=128, 4 heads, batch 16 x 128) and 10m (6 layers, d=384,
              6 heads, batch 16 x 256): tokens/s of each, ratio ours / torch (target >= 1.25)
  gemm        GFLOP/s of one 2048x128x512 (tiny) and 4096x384x1536 (10m) float32 matmul in
              each framework: the ceiling both step times are bound by
  ablation    our tiny step with each speed change undone, against the current code
  placements  every placement's step time / pre's, alternating in pairs (targets: geonorm
              <= 1.03, peri <= 1.05, simplenorm <= 1.10)
  losses      20 steps of the tiny model with every change undone vs the current code: the
              largest loss difference (float32 reordering only)
  attention   one layer's causal attention forward + backward at the tiny and 10m shapes:
              ours (blocked, dense) against torch's fused scaled_dot_product_attention
  barriers    pre and geonorm with and without compile_options.for_mesh (XLA keeps the
              optimization barriers of GeoNorm's update until fusion on a CPU), over pre;
              20 GeoNorm losses with and without

  python benchmarks/bench_train.py [--parts=models,gemm,ablation,placements,losses,barriers,
                                      attention]

Writes results/bench/train.json (every round's numbers, the machine, the load average before
and after); parts not rerun keep their earlier figures, `part_dates` says when each part
was measured, and `history` keeps each rerun part's earlier figures with their dates.
About 10 minutes on 2 cores; run it on a quiet machine.
"""
import argparse
import contextlib
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
import numpy as np
import torch
import torch.nn.functional as F

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import layers as layers_lib
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import placements
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "results" / "bench" / "train.json"
RECIPE = "tiny,data.source=text,data.path=data/tinyshakespeare.txt,train.layer_stats_every=25"
MODELS = {
    "tiny": "",
    "10m": "model.num_layers=6,model.d_model=384,model.num_heads=6,data.seq_len=256",
}
TARGET_RATIO = 1.25
PLACEMENT_TARGETS = {"geonorm": 1.03, "peri": 1.05, "simplenorm": 1.10}


class TorchBlock(torch.nn.Module):

  def __init__(self, d, heads):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
    self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
    self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

  def forward(self, x_BxLxD):
    batch, length, d = x_BxLxD.shape
    q, k, v = self.qkv(self.ln1(x_BxLxD)).split(d, dim=2)
    q, k, v = (t.view(batch, length, self.heads, d // self.heads).transpose(1, 2)
               for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x_BxLxD = x_BxLxD + self.proj(y.transpose(1, 2).reshape(batch, length, d))
    return x_BxLxD + self.down(F.gelu(self.up(self.ln2(x_BxLxD)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
  """nanoGPT's model at our shapes: the program a PyTorch user would write."""

  def __init__(self, spec):
    super().__init__()
    d = spec.d_model
    self.token = torch.nn.Embedding(spec.vocab_size, d)
    self.position = torch.nn.Embedding(spec.max_seq_len, d)
    self.blocks = torch.nn.ModuleList(TorchBlock(d, spec.num_heads)
                                      for _ in range(spec.num_layers))
    self.final_norm = torch.nn.LayerNorm(d)
    self.head = torch.nn.Linear(d, spec.vocab_size, bias=False)

  def forward(self, tokens_BxL1):
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    x = self.token(inputs) + self.position(torch.arange(inputs.shape[1]))
    for block in self.blocks:
      x = block(x)
    logits = self.head(self.final_norm(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_stepper(config, spec):
  torch.manual_seed(0)
  model = TorchGPT(spec)
  tc = config.train
  optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=(tc.b1, tc.b2),
                                eps=tc.eps, weight_decay=tc.weight_decay)

  def step(tokens):
    loss = model(torch.from_numpy(tokens.astype(np.int64)))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
    optimizer.step()
    return loss
  return step, sum(p.numel() for p in model.parameters())


class JaxStepper:
  """Our train step as the train loop runs it: donated state, metrics read one step late."""

  def __init__(self, config, compiler_options=None):
    self.setup = train.make_setup(config)
    self.state = train.init_state(self.setup)
    self.step_fn = train.make_train_step(self.setup, compiler_options)
    self.num_params = sum(x.size for x in jax.tree.leaves(self.state["params"]))

  def __call__(self, tokens):
    self.state, metrics = self.step_fn(self.state, train.global_batch(self.setup,
                                                                      {"tokens": tokens}))
    return metrics["loss"]


def timed_rounds(steppers, batches, rounds, steps):
  """{name: [seconds per step of each round]}, the order reversed every other round."""
  names = list(steppers)
  for name in names:  # compile / warm up
    _finish(steppers[name](batches[0]))
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      start = time.perf_counter()
      for i in range(steps):
        loss = steppers[name](batches[(r * steps + i) % len(batches)])
      _finish(loss)
      times[name].append((time.perf_counter() - start) / steps)
  return times


def _finish(loss):
  """Waits for the value (JAX dispatches asynchronously) and returns its first number."""
  return loss.flatten()[0].item() if isinstance(loss, torch.Tensor) else float(jnp.ravel(loss)[0])


def make_config(model, extra=""):
  return config_lib.get_config(",".join(filter(None, [RECIPE, MODELS[model], extra])))


def make_batches(config, count=8):
  it = data_lib.make_train_iterator(config)
  return [np.asarray(next(it)["tokens"], np.int32) for _ in range(count)]


def bench_models(args):
  out = {}
  for model in args.models.split(","):
    config = make_config(model)
    jax_step = JaxStepper(config)
    torch_step, torch_params = torch_stepper(config, jax_step.setup.spec)
    rounds, steps = (args.rounds, args.steps) if model == "tiny" else (3, 2)
    times = timed_rounds({"torch": torch_step, "jax": jax_step}, make_batches(config), rounds,
                         steps)
    tokens = config.data.batch_size * config.data.seq_len
    medians = {name: statistics.median(t) for name, t in times.items()}
    out[model] = {
        "config": MODELS[model] or "tiny preset", "tokens_per_step": tokens,
        "params": {"jax": jax_step.num_params, "torch": torch_params},
        "step_ms_rounds": {n: [1e3 * s for s in t] for n, t in times.items()},
        "step_ms": {n: 1e3 * m for n, m in medians.items()},
        "tokens_per_s": {n: tokens / m for n, m in medians.items()},
        "ratio_jax_over_torch": medians["torch"] / medians["jax"],
        "target": TARGET_RATIO,
    }
    print(model, json.dumps(out[model]["tokens_per_s"]), "ratio %.3f" %
          out[model]["ratio_jax_over_torch"], flush=True)
  return out


def bench_gemm(args):
  out = {}
  for name, (m, k, n) in {"tiny_mlp_up": (2048, 128, 512),
                          "10m_mlp_up": (4096, 384, 1536)}.items():
    a, b = (np.random.default_rng(0).standard_normal(s).astype(np.float32)
            for s in ((m, k), (k, n)))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    matmul = jax.jit(jnp.matmul)
    matmul(ja, jb).block_until_ready()
    times = timed_rounds({"torch": lambda _: (ta @ tb)[0, 0],
                          "jax": lambda _: matmul(ja, jb)[0, 0]}, [None], 7, 20)
    out[name] = {"shape_MxKxN": [m, k, n],
                 **{f"{fw}_gflops": 2 * m * k * n / statistics.median(t) / 1e9
                    for fw, t in times.items()}}
    print(name, out[name], flush=True)
  return out


ATTENTION_SHAPES = {"tiny": (16, 128, 4, 32), "10m": (16, 256, 6, 64)}  # B, L, heads, head_dim


def bench_attention(args):
  """One layer's causal attention, forward + backward, float32: ours (model.causal_attention,
  blocked and dense) against PyTorch's fused scaled_dot_product_attention, alternating."""
  out = {}
  for name, (batch, length, heads, hd) in ATTENTION_SHAPES.items():
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((batch, length, heads, hd)).astype(np.float32)
                     for _ in range(4))
    scale = 1.0 / math.sqrt(hd)

    def ours(impl):
      loss = lambda q, k, v, dout: jnp.vdot(model_lib.causal_attention(q, k, v, scale, impl),
                                            dout)
      grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      arrays = [jnp.asarray(a) for a in (q, k, v, dout)]
      return lambda _: grad(*arrays)[0]

    # PyTorch's layout is (B, heads, L, head_dim); the transposes are outside the timing.
    tq, tk, tv, tdout = (torch.from_numpy(a).transpose(1, 2).contiguous() for a in (q, k, v, dout))
    for t in (tq, tk, tv):
      t.requires_grad_(True)

    def torch_sdpa(_):
      y = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
      y.backward(tdout)
      return tq.grad

    times = timed_rounds({"torch_sdpa": torch_sdpa, "ours_blocked": ours("blocked"),
                          "ours_dense": ours("dense")}, [None], args.rounds, 10)
    out[name] = {"shape_BxLxHxK": [batch, length, heads, hd],
                 **{f"{fw}_ms": 1e3 * statistics.median(t) for fw, t in times.items()}}
    print("attention", name, out[name], flush=True)
  return out


def _linear_einsum_3d(self, x, perturb=None):
  """layers.Linear before the speed work: one einsum that keeps the batch axes."""
  x = layers_lib.tap(perturb, self.name + ".in", x.astype(self.dtype))
  y = jnp.einsum("...i,io->...o", x, self.kernel[...].astype(self.dtype))
  if self.bias is not None:
    y = y + self.bias[...].astype(self.dtype)
  return layers_lib.tap(perturb, self.name + ".out", y)


@contextlib.contextmanager
def undone(change):
  """The code with one speed change undone: 'linear_2d', 'softmax' (jax.nn.softmax, which
  JAX differentiates through its exp, sum and division) or 'all' (attention is a config)."""
  saved = layers_lib.Linear.__call__, model_lib.softmax
  if change in ("linear_2d", "all"):
    layers_lib.Linear.__call__ = _linear_einsum_3d
  if change in ("softmax", "all"):
    model_lib.softmax = jax.nn.softmax
  try:
    yield
  finally:
    layers_lib.Linear.__call__, model_lib.softmax = saved


ABLATIONS = {  # name -> (change undone in the code, config override)
    "current": (None, ""),
    "attention_dense": (None, "model.attention=dense"),
    "linear_einsum_3d": ("linear_2d", ""),
    "jax_nn_softmax": ("softmax", ""),
    "before (all undone)": ("all", "model.attention=dense"),
}


def bench_ablation(args):
  steppers = {}
  for name, (change, extra) in ABLATIONS.items():
    with undone(change):  # the step is traced on its first call, inside timed_rounds' warm-up
      stepper = JaxStepper(make_config("tiny", extra))
      _finish(stepper(make_batches(make_config("tiny"), 1)[0]))
    steppers[name] = stepper
  times = timed_rounds(steppers, make_batches(make_config("tiny")), args.rounds, args.steps)
  current = statistics.median(times["current"])
  out = {name: {"step_ms": 1e3 * statistics.median(t),
                "over_current": statistics.median(t) / current} for name, t in times.items()}
  print("ablation", json.dumps(out), flush=True)
  return out


def bench_placements(args):
  batches = make_batches(make_config("tiny"))
  pre = JaxStepper(make_config("tiny"))
  out = {}
  names = [n for n in placements.PLACEMENTS if n != "pre"] if args.placements == "all" \
      else args.placements.split(",")
  for name in names:
    other = JaxStepper(make_config("tiny", f"model.placement={name}"))
    times = timed_rounds({"pre": pre, name: other}, batches, args.rounds, args.steps)
    ratios = [t / p for t, p in zip(times[name], times["pre"])]
    out[name] = {"step_ms": 1e3 * statistics.median(times[name]),
                 "pre_step_ms": 1e3 * statistics.median(times["pre"]),
                 "over_pre": statistics.median(ratios), "over_pre_rounds": ratios,
                 "target": PLACEMENT_TARGETS.get(name)}
    print(name, "%.3f x pre (rounds %.3f-%.3f)" % (out[name]["over_pre"], min(ratios),
                                                   max(ratios)), flush=True)
    del other
  return out


def bench_barriers(args):
  """Pre-LN and GeoNorm with and without the barrier option (without: no compiler options,
  XLA's defaults, which drop optimization barriers before fusion), over current Pre-LN; and
  the largest difference of 20 GeoNorm losses between the two (float reordering only)."""
  batches = make_batches(make_config("tiny"))
  steppers = {}
  for name, placement in (("pre", "pre"), ("geonorm", "geonorm")):
    config = make_config("tiny", f"model.placement={placement}")
    steppers[name] = JaxStepper(config)
    steppers[name + ", barriers dropped"] = JaxStepper(config, compiler_options={})
  times = timed_rounds(steppers, batches, args.rounds, args.steps)
  out = {name: {"step_ms": 1e3 * statistics.median(t),
                "over_pre": statistics.median(a / b for a, b in zip(t, times["pre"]))}
         for name, t in times.items()}
  config = make_config("tiny", "model.placement=geonorm")
  kept, dropped = JaxStepper(config), JaxStepper(config, compiler_options={})
  pairs = [(_finish(kept(b)), _finish(dropped(b)))
           for b in make_batches(make_config("tiny"), 20)]
  out["geonorm_losses"] = {"steps": 20, "kept": [a for a, _ in pairs],
                           "dropped": [b for _, b in pairs],
                           "max_abs_difference": max(abs(a - b) for a, b in pairs)}
  print("barriers", json.dumps(out), flush=True)
  return out


def bench_losses(args):
  batches = make_batches(make_config("tiny"), 20)
  losses = {}
  for name in ("current", "before (all undone)"):
    change, extra = ABLATIONS[name]
    with undone(change):
      stepper = JaxStepper(make_config("tiny", extra))
      losses[name] = [_finish(stepper(b)) for b in batches]
  gap = max(abs(a - b) for a, b in zip(*losses.values()))
  print("largest loss difference over 20 steps: %.2e" % gap, flush=True)
  return {"steps": 20, "losses": losses, "max_abs_difference": gap}


PARTS = {"models": bench_models, "gemm": bench_gemm, "ablation": bench_ablation,
         "placements": bench_placements, "losses": bench_losses, "barriers": bench_barriers,
         "attention": bench_attention}


def _now():
  return datetime.datetime.now().isoformat(timespec="seconds")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default=",".join(PARTS))
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--placements", default="all", help="'all' or a comma list")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=4, help="steps per round (tiny)")
  parser.add_argument("--output", default=str(OUTPUT))
  args = parser.parse_args()
  os.chdir(REPO_ROOT)  # the recipe's data path is relative to the repository
  result = {
      "date": _now(),
      "machine": {"platform": platform.platform(), "processor": platform.processor(),
                  "cpu_count": os.cpu_count(), "jax": jax.__version__,
                  "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                  "loadavg_before": os.getloadavg()},
      "settings": {"rounds": args.rounds, "steps_per_round": args.steps, "dtype": "float32",
                   "recipe": RECIPE},
  }
  path = pathlib.Path(args.output)
  # Parts not rerun keep their previous figures, with the date they were measured.
  previous = json.loads(path.read_text()) if path.exists() else {}
  measured = dict(previous.get("part_dates", {}))
  for part in PARTS:
    if part in previous and part not in args.parts.split(","):
      result[part] = previous[part]
      measured.setdefault(part, previous.get("date"))
  # A rerun part's previous figures move to `history` with their date (before/after pairs
  # are read from there; docs/benchmarks.md gives the current figures).
  history = previous.get("history", {})
  for part in args.parts.split(","):
    if part in previous:
      history.setdefault(part, []).append({"date": measured.get(part, previous.get("date")),
                                           "figures": previous[part]})
    result[part] = PARTS[part](args)
    measured[part] = result["date"]
  result["part_dates"] = measured
  result["history"] = history
  result["machine"]["loadavg_after"] = os.getloadavg()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=2) + "\n")
  print("wrote", path)


if __name__ == "__main__":
  main()
