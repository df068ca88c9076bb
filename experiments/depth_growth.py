"""Depth growth: do Pre-LN's hidden states grow exponentially with depth and Peri-LN's linearly?

  python experiments/depth_growth.py [--scale=cpu|paper] [--seeds=0] [--quick]
      [--phases=init,trained] [--depths=4,8,16,32,48] [--variants=pre,peri] [--print]

For each placement and depth D, the residual stream's RMS after every block l = 1..D
(residual_rms/layer_XX of train.make_stream_stats, one batch) at init (the statistics
logged before the first update) and after training (those logged before the last update).
Growth law of a placement in a phase, fitted to the RMS over l in its deepest model (mean
over seeds): `flat` when max/min over the blocks is below 1.5; otherwise `linear`
(r = a + b l) or `exponential` (log r = a + b l), whichever has the smaller mean squared
error in log r (both least squares, two parameters).
CPU scale: phase `init` at width 256 (depth 16 to 48: 12.6M to 37.8M parameters; one step
each, a few minutes), phase `trained` at width 64, 150 steps x 8 x 128 tokens (about 15
minutes on a quiet 2-core CPU); --quick: init only, depths 4, 16, 48. Paper scale: GPT-2
124M's width (configs/gpt2.py:124m), trained 20k steps. Writes results/depth_growth/
{results.csv, curves.csv, table.md, config.json, verdict.json, rms_per_block.png}.
Verdict: reproduced when, in every phase run, Pre-LN's law is exponential and Peri-LN's is
linear or flat; not reproduced when Pre-LN's is not exponential in any phase.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "depth_growth"
CLAIM = "Pre-LN's hidden states grow exponentially in depth, Peri-LN's linearly"
PAPER_NUMBER = "theory: Pre-LN up to e^D, Peri-LN O(D) (Stability paper)"
PHASES = {  # phase -> scale -> overrides
    "init": {"cpu": "d_model=256,num_heads=4," + claims.steps_overrides(1, evals=1)
                    + ",layer_stats_every=1,eval_batches=1",
             "paper": claims.steps_overrides(1, evals=1) + ",layer_stats_every=1,eval_batches=1"},
    "trained": {"cpu": "d_model=64,num_heads=4,batch_size=8," + claims.steps_overrides(150)
                       + ",layer_stats_every=149",
                "paper": claims.steps_overrides(20000) + ",layer_stats_every=19999"},
}
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", "", "0",
                        "GPT-2-style models on character-level tinyshakespeare, untied head, "
                        "lr 3e-3; init: width 256; trained: width 64, 150 steps x 8 x 128 "
                        "tokens."),
    "paper": claims.Scale("configs/gpt2.py", "124m", "0",
                          "GPT-2 124M's width (768, 12 heads), OpenWebText, trained 20k steps "
                          "x 480 x 1024 tokens (configs/gpt2.py)."),
}
CURVES = (("layers", "residual_rms/layer_"),)
FLAT_RATIO = 1.5


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "peri"))
  parser.add_argument("--phases", default="init,trained")
  parser.add_argument("--depths", default="4,8,16,32,48")


def grid(args, scale):
  del scale
  phases = ["init"] if args.quick else args.phases.split(",")
  depths = ["4", "16", "48"] if args.quick else args.depths.split(",")
  for phase in phases:
    if phase not in PHASES:
      raise SystemExit(f"--phases: {phase!r} is unknown; valid: {', '.join(PHASES)}")
  return [claims.variant(f"{phase}/{name}/depth{depth}",
                         claims.join(overrides, f"num_layers={depth}",
                                     PHASES[phase][args.scale]),
                         phase=phase, variant=name, depth=int(depth))
          for phase in phases for name, overrides in claims.variant_list(args)
          for depth in depths]


def rms_per_block(curves, row):
  """RMS after blocks 1..D at the run's phase: its first layer record (init) or last."""
  out = []
  for block in range(1, row["depth"] + 1):
    steps, ys = claims.curve(curves, row["name"], f"residual_rms/layer_{block:02d}", "layers")
    out.append(ys[0] if row["phase"] == "init" else ys[-1])
  return np.asarray(out)


def fit_law(r):
  """('flat' | 'linear' | 'exponential', growth per block) for RMS r over blocks 1..D."""
  r = np.asarray(r, float)
  blocks = np.arange(1, len(r) + 1, dtype=float)
  if not np.all(np.isfinite(r)) or np.any(r <= 0):
    return "non-finite", float("nan")
  if r.max() / r.min() < FLAT_RATIO:
    return "flat", 0.0
  slope, intercept = np.polyfit(blocks, r, 1)
  linear = np.log(np.maximum(intercept + slope * blocks, 1e-30))
  rate, log_intercept = np.polyfit(blocks, np.log(r), 1)
  exponential = log_intercept + rate * blocks
  mse = lambda pred: float(np.mean((pred - np.log(r)) ** 2))
  if mse(linear) <= mse(exponential):
    return "linear", float(slope)
  return "exponential", float(np.exp(rate))


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
  table += ["", "| phase | variant | fitted law (deepest model) | growth per block |",
            "|---|---|---|---|"]
  for (phase, name), ((law, growth), depth) in laws.items():
    unit = {"linear": "RMS/block", "exponential": "x per block"}.get(law, "")
    table.append(f"| {phase} | {name} | {law} (depth {depth}) | {growth:.4g} {unit} |")
  table += ["", f"RMS over all tokens and features of the stream after block l. Flat: max/min "
            f"< {FLAT_RATIO}; else the better of r = a + b l and log r = a + b l in log-space "
            "error."]
  phases = sorted({phase for phase, _ in laws})
  holds = None
  pre = [laws[(p, "pre")][0][0] for p in phases if (p, "pre") in laws]
  peri = [laws[(p, "peri")][0][0] for p in phases if (p, "peri") in laws]
  if pre and peri:
    if all(law == "exponential" for law in pre) and all(law in ("linear", "flat")
                                                         for law in peri):
      holds = True
    elif not any(law == "exponential" for law in pre):
      holds = False
  result = "; ".join(f"{phase}: " + ", ".join(f"{name} {laws[(phase, name)][0][0]}"
                                              for (p, name) in laws if p == phase)
                     for phase in phases) + " (deepest model)."

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
