"""Depth growth: do Pre-LN's hidden states grow exponentially with depth and Peri-LN's linearly?

  python experiments/depth_growth.py [--scale=cpu|paper] [--seeds=0] [--quick]
      [--phases=init,trained] [--depths=4,8,16,32,48] [--trained_depths=4,8,16,24]
      [--variants=pre,peri] [--print]

For each placement and depth D, the residual stream's RMS after every block l = 1..D, on one
validation batch: at init (measured in this process: build the model, one forward pass, no
compilation, so depth 48 costs seconds) and after training (train runs; the statistics that
train.make_stream_stats logs before the last update, residual_rms/layer_XX).
Growth law of a placement in a phase, fitted to the RMS over l in its deepest model (mean
over seeds): `flat` when max/min over the blocks is below 1.5; otherwise a power law
r = c l^p (p = 1: linear) or an exponential r = c g^l, whichever has the smaller mean squared
error in log r (both least squares, two parameters).
CPU scale: init at width 256 (depth 16 to 48: 12.6M to 37.8M parameters; a few minutes in
all); trained at width 64, 150 steps x 8 x 128 tokens, depths 4 to 24 (about 20 minutes on a
quiet 2-core CPU, mostly compiling: a 48-block train step takes many minutes to compile
here, so deeper trained runs are --trained_depths=...,32,48 away). --quick: init only, depths
4, 16, 48. Paper scale: GPT-2 124M's width (configs/gpt2.py:124m), depths 4 to 48, trained 20k
steps. `--print` lists the trained runs only (init needs no cluster). Writes
results/depth_growth/{results.csv, curves.csv, table.md, config.json, verdict.json,
rms_per_block.png}.
Verdict: reproduced when, in every phase, Pre-LN's law is exponential and Peri-LN's at most
linear (flat, or a power law with p <= 1.25); not reproduced when Pre-LN's is exponential in
no phase.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims, sweep  # pylint: disable=g-import-not-at-top

NAME = "depth_growth"
CLAIM = "Pre-LN's hidden states grow exponentially in depth, Peri-LN's linearly"
PAPER_NUMBER = "theory: Pre-LN up to e^D, Peri-LN O(D) (Stability paper)"
INIT = {"cpu": "d_model=256,num_heads=4,eval_batches=1", "paper": "eval_batches=1"}
TRAINED = {"cpu": "d_model=64,num_heads=4,batch_size=8," + claims.steps_overrides(150)
                  + ",layer_stats_every=149",
           "paper": claims.steps_overrides(20000) + ",layer_stats_every=19999"}
TRAINED_DEPTHS = {"cpu": "4,8,16,24", "paper": "4,8,16,32,48"}
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", "", "0",
                        "GPT-2-style models on character-level tinyshakespeare, untied head; "
                        "init: width 256, one batch of 16 x 128; trained: width 64, 150 steps "
                        "x 8 x 128 tokens, lr 3e-3."),
    "paper": claims.Scale("configs/gpt2.py", "124m", "0",
                          "GPT-2 124M's width (768, 12 heads), OpenWebText, trained 20k steps "
                          "x 480 x 1024 tokens (configs/gpt2.py)."),
}
CURVES = (("layers", "residual_rms/layer_"),)
FLAT_RATIO = 1.5


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "peri"))
  parser.add_argument("--phases", default="init,trained")
  parser.add_argument("--depths", default="4,8,16,32,48", help="depths measured at init")
  parser.add_argument("--trained_depths", default=None,
                      help="depths trained; default 4,8,16,24 (cpu), 4,...,48 (paper)")


def _phases(args):
  phases = ["init"] if args.quick else args.phases.split(",")
  for phase in phases:
    if phase not in ("init", "trained"):
      raise SystemExit(f"--phases: {phase!r} is unknown; valid: init, trained")
  return phases


def grid(args, scale):
  del scale
  if "trained" not in _phases(args):
    return []
  return [claims.variant(f"trained/{name}/depth{depth}",
                         claims.join(overrides, f"num_layers={depth}", TRAINED[args.scale]),
                         phase="trained", variant=name, depth=int(depth))
          for name, overrides in claims.variant_list(args)
          for depth in (args.trained_depths or TRAINED_DEPTHS[args.scale]).split(",")]


def measure(args):
  """The init phase: RMS after every block of a freshly built model, one forward pass."""
  if "init" not in _phases(args):
    return [], []
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from geonorm_jax import data, losses, metrics, model as model_lib, spec as spec_lib
  scale = SCALES[args.scale]
  depths = ["4", "16", "48"] if args.quick else args.depths.split(",")
  rows, curves = [], []
  for name, overrides in claims.variant_list(args):
    for depth in depths:
      for seed in args.seed_list:
        config = sweep.load_config(scale.config_file, claims.join(
            scale.overrides, overrides, f"num_layers={depth}", INIT[args.scale], args.extra),
                                    seed)
        model = model_lib.build(spec_lib.resolve(config.model), seed=seed)
        tokens = jnp.asarray(data.make_eval_batches(config, data_parallel_size=1)[0]["tokens"])
        logits, streams = model(tokens[:, :-1], return_streams=True)
        loss, _ = losses.cross_entropy(logits, tokens[:, 1:])
        run = f"init/{name}/depth{depth}/seed{seed}"
        rows.append({"phase": "init", "variant": name, "depth": int(depth), "name": run,
                     "seed": seed, "params": model_lib.count_params(nnx.state(model, nnx.Param)),
                     "steps": 0, "tokens": 0, "final_eval_loss": float(loss),
                     "final_train_loss": float("nan"), "step_time_s": float("nan"),
                     "loss_spikes": 0, "skipped_steps": 0, "collapse_step": None})
        curves += [{"name": run, "split": "layers", "key": key, "step": 0, "value": float(v)}
                   for key, v in metrics.residual_stats(streams).items()
                   if key.startswith("residual_rms/")]
        print(f"depth_growth: {run}: RMS after the last block "
              f"{curves[-1]['value']:.3f}", flush=True)
  return rows, curves


def rms_per_block(curves, row):
  """RMS after blocks 1..D at the run's phase: its first layer record (init) or last."""
  out = []
  for block in range(1, row["depth"] + 1):
    steps, ys = claims.curve(curves, row["name"], f"residual_rms/layer_{block:02d}", "layers")
    out.append(ys[0] if row["phase"] == "init" else ys[-1])
  return np.asarray(out)


def fit_law(r):
  """('flat' | 'power' | 'exponential', growth) for the RMS r over blocks l = 1..D: flat when
  max/min < FLAT_RATIO; else the better, in mean squared error of log r, of a power law
  log r = a + p log l (growth = p; p = 1 is linear growth) and an exponential
  log r = a + l log g (growth = g per block)."""
  r = np.asarray(r, float)
  blocks = np.arange(1, len(r) + 1, dtype=float)
  if not np.all(np.isfinite(r)) or np.any(r <= 0):
    return "non-finite", float("nan")
  if r.max() / r.min() < FLAT_RATIO:
    return "flat", 0.0
  power = np.polyfit(np.log(blocks), np.log(r), 1)
  exponential = np.polyfit(blocks, np.log(r), 1)
  mse = lambda fit, x: float(np.mean((np.polyval(fit, x) - np.log(r)) ** 2))
  if mse(power, np.log(blocks)) <= mse(exponential, blocks):
    return "power", float(power[0])
  return "exponential", float(np.exp(exponential[0]))


def describe(law, growth):
  return {"power": f"power law, r ~ l^{growth:.2f}",
          "exponential": f"exponential, x{growth:.4f} per block"}.get(law, law)


def summarize(rows, curves, config):
  table = ["| phase | variant | depth | parameters | seeds | RMS after the last block | "
           "last / first block |", "|---|---|---|---|---|---|---|"]
  laws = {}
  for (phase, name, depth), runs in claims.group(rows, "phase", "variant", "depth").items():
    r = np.mean([rms_per_block(curves, run) for run in runs], 0)
    table.append(f"| {phase} | {name} | {depth} | {runs[0]['params']:,} | {len(runs)} | "
                 f"{claims.fmt([rms_per_block(curves, run)[-1] for run in runs])} | "
                 f"{r[-1] / r[0]:.2f} |")
    if depth == max(row["depth"] for row in rows if row["phase"] == phase):
      laws[(phase, name)] = (fit_law(r), depth)
  table += ["", "| phase | variant | fitted on | growth law |",
            "|---|---|---|---|"]
  for (phase, name), ((law, growth), depth) in laws.items():
    table.append(f"| {phase} | {name} | depth {depth} | {describe(law, growth)} |")
  table += ["", f"RMS over all tokens and features of the stream after block l. Flat: max/min "
            f"< {FLAT_RATIO}; else the better, in log-space error, of r = c l^p and "
            "r = c g^l (p <= 1: at most linear)."]
  phases = sorted({phase for phase, _ in laws})
  holds = None
  pre = [laws[(p, "pre")][0][0] for p in phases if (p, "pre") in laws]
  peri = [laws[(p, "peri")][0] for p in phases if (p, "peri") in laws]
  at_most_linear = lambda fit: fit[0] == "flat" or (fit[0] == "power" and fit[1] <= 1.25)
  if pre and peri:
    if all(law == "exponential" for law in pre) and all(map(at_most_linear, peri)):
      holds = True
    elif not any(law == "exponential" for law in pre):
      holds = False
  result = "; ".join(f"{phase}: " + ", ".join(f"{name} {describe(*laws[(phase, name)][0])}"
                                              for (p, name) in laws if p == phase)
                     for phase in phases) + " (RMS after block l of the deepest model)."

  def draw(figure):
    for index, phase in enumerate(phases):
      axes = figure.add_subplot(1, len(phases), index + 1)
      for i, ((p, name, depth), runs) in enumerate(
          claims.group(rows, "phase", "variant", "depth").items()):
        if p != phase:
          continue
        r = np.mean([rms_per_block(curves, run) for run in runs], 0)
        shade = 0.35 + 0.65 * depth / max(row["depth"] for row in rows)
        axes.plot(np.arange(1, depth + 1), r, color="C0" if name == "pre" else
                  ("C1" if name == "peri" else f"C{2 + i % 8}"), alpha=shade,
                  label=f"{name}, D={depth}")
      axes.set_yscale("log")
      axes.set_xlabel("block l")
      axes.set_ylabel("residual stream RMS after block l")
      axes.set_title(f"{phase}", fontsize=9)
      axes.legend(fontsize=6, ncol=2)
      axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result,
                        {"rms_per_block.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
