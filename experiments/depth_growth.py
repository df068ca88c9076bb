"""Depth growth: do Pre-LN's hidden states grow exponentially with depth and Peri-LN's linearly?

  python experiments/depth_growth.py [--scale=judge|paper] [--seeds=0,1,2] [--quick]
      [--phases=init,trained] [--depths=4,8,16,32,48] [--trained_depths=24]
      [--variants=pre,peri] [--print]

For each placement and depth D, the residual stream's RMS after every block l = 1..D, on one
validation batch: at init (measured in this process: build the model, one forward pass, no
compilation, so depth 48 costs seconds) and after training (train runs; the statistics that
train.make_stream_stats logs before the last update, residual_rms/layer_XX).
The law of one run, at the deepest D of its phase: both two-parameter least-squares fits of
log r over l, a power law r = c l^p (p = 1: linear) and an exponential r = c g^l, and the
difference of their mean squared errors in log r (power minus exponential: above 0 where the
exponential fits better). The table also names the law of the mean over seeds (`flat` when
max/min over the blocks is below 1.5).
Judge scale: the recipe of configs/judge.py (character-level tinyshakespeare, untied head).
Init: width 256 (depth 16 to 48: 12.6M to 37.8M parameters), 2 placements x 5 depths x 3
seeds, a few minutes in all. Trained: the judge recipe (2000 steps x 16 x 128 tokens, lr
2e-3) at width 64, where a 24-block model has 1.25M parameters (the question is the law over
depth, which needs depth more than width). The verdict reads the deepest model only, so the
default trains depth 24 alone: 2 placements x 3 seeds = 6 runs, measured 0.65-0.91 s a step
two at once, 22-30 minutes a run, about 75 minutes in all on this 2-core machine.
--trained_depths=4,8,16,24 adds the shallower models for the figure (18 runs, measured about
4, 8 and 18 minutes a run, about 90 minutes more); deeper trained runs are
--trained_depths=...,32,48 away (a 48-block train step takes many minutes to compile here).
--quick: init only, depths 4, 16, 48, one seed. Paper scale: GPT-2 124M's width
(configs/gpt2.py:124m), depths 4 to 48, trained 20k steps.
`--print` lists the trained runs only (init needs no cluster). Writes
results/depth_growth/{results.csv, curves.csv, table.md, config.json, verdict.json,
rms_per_block.png}.
Verdict (stats.py; 95% t intervals over the seeds, each seed's fits at the deepest model).
Reproduced when in every phase (an intersection, no correction) Pre-LN's exponential fits
better than its power law (the interval of the error difference above 0) and Peri-LN's power
exponent is at most linear (its interval below LINEAR_MAX = 1.25, the margin of "linear").
Not at this scale (contradicted at paper scale) when, Holm over those tests, in some phase
Pre-LN's power law fits better (the interval below 0) or Peri-LN's exponent is above 1.25;
unresolved otherwise.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats, sweep  # pylint: disable=g-import-not-at-top

NAME = "depth_growth"
CLAIM = "Pre-LN's hidden states grow exponentially in depth, Peri-LN's linearly"
PAPER_NUMBER = "theory: Pre-LN up to e^D, Peri-LN O(D) (Stability paper)"
INIT = {"judge": "d_model=256,num_heads=4,eval_batches=1", "paper": "eval_batches=1"}
# Trained: the scale's recipe at width 64 (judge), stream statistics before the last update.
TRAINED = {"judge": "d_model=64,num_heads=4,layer_stats_every=1999",
           "paper": claims.steps_overrides(20000) + ",layer_stats_every=19999"}
TRAINED_DEPTHS = {"judge": "24", "paper": "4,8,16,32,48"}
LINEAR_MAX = 1.25  # a power-law exponent up to this counts as (at most) linear growth
SCALES = {
    "judge": claims.Scale("configs/judge.py", "", "0,1,2",
                          "GPT-2-style models on character-level tinyshakespeare, untied head "
                          "(configs/judge.py); init: width 256, one batch of 16 x 128; "
                          "trained: width 64, 2000 steps x 16 x 128 tokens, lr 2e-3."),
    "paper": claims.Scale("configs/gpt2.py", "124m", "0,1,2",
                          "GPT-2 124M's width (768, 12 heads), OpenWebText, trained 20k steps "
                          "x 480 x 1024 tokens (configs/gpt2.py)."),
}
CURVES = (("layers", "residual_rms/layer_*"),)
FLAT_RATIO = 1.5


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "peri"))
  parser.add_argument("--phases", default="init,trained")
  parser.add_argument("--depths", default="4,8,16,32,48", help="depths measured at init")
  parser.add_argument("--trained_depths", default=None,
                      help="depths trained; default 24 (judge), 4,...,48 (paper)")


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
  from geonorm_jax.data import windows as data
  from geonorm_jax.nn import losses, model as model_lib, spec as spec_lib
  from geonorm_jax.training import metrics
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


def fits(r):
  """(p, g, mse_power - mse_exponential): both least-squares fits of log r over l = 1..D,
  without the flat cut; NaN for a non-finite or non-positive profile."""
  r = np.asarray(r, float)
  if len(r) < 3 or not np.all(np.isfinite(r)) or np.any(r <= 0):
    return float("nan"), float("nan"), float("nan")
  blocks = np.arange(1, len(r) + 1, dtype=float)
  power = np.polyfit(np.log(blocks), np.log(r), 1)
  exponential = np.polyfit(blocks, np.log(r), 1)
  mse = lambda fit, x: float(np.mean((np.polyval(fit, x) - np.log(r)) ** 2))
  return (float(power[0]), float(np.exp(exponential[0])),
          mse(power, np.log(blocks)) - mse(exponential, blocks))


def phase_tests(rows, curves):
  """{(phase, test): Difference} at each phase's deepest model, over the seeds: Pre-LN's error
  difference (power - exponential) minus 0, and Peri-LN's power exponent minus LINEAR_MAX."""
  tests = {}
  for phase in dict.fromkeys(row["phase"] for row in rows):
    deepest = max(row["depth"] for row in rows if row["phase"] == phase)
    runs = {name: [r for r in rows if (r["phase"], r["variant"], r["depth"]) ==
                   (phase, name, deepest)] for name in ("pre", "peri")}
    if runs["pre"]:
      gap = {r["seed"]: fits(rms_per_block(curves, r))[2] for r in runs["pre"]}
      tests[(phase, "Pre-LN: power-law minus exponential fit error")] = stats.difference(
          gap, {seed: 0.0 for seed in gap})
    if runs["peri"]:
      exponent = {r["seed"]: fits(rms_per_block(curves, r))[0] for r in runs["peri"]}
      tests[(phase, f"Peri-LN: exponent - {LINEAR_MAX:g}")] = stats.difference(
          exponent, {seed: LINEAR_MAX for seed in exponent})
  return tests


def one_sample(d):
  """A Difference against a constant, in words: mean [low, high] (level t interval)."""
  return (f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] ({d.level:.0%} t interval over {d.n} "
          "seeds)")


def verdict_of(rows, curves):
  """(holds, tests): the rule of the docstring."""
  tests = phase_tests(rows, curves)
  phases = {phase for phase, _ in tests}
  if not tests:
    return None, tests
  pre_ok = lambda d: d.outcome == "higher"
  peri_ok = lambda d: d.outcome == "lower"
  complete = all(sum(p == phase for p, _ in tests) == 2 for phase in phases)
  if complete and all((pre_ok if t.startswith("Pre") else peri_ok)(d)
                      for (_, t), d in tests.items()):
    return True, tests
  against = stats.outcomes(tests)
  if any(against[(p, t)] == ("lower" if t.startswith("Pre") else "higher") for p, t in tests):
    return False, tests
  return None, tests


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
            f"r = c g^l (p <= {LINEAR_MAX:g}: at most linear)."]
  phases = sorted({phase for phase, _ in laws})
  holds, tests = verdict_of(rows, curves)
  table += ["", "| phase | test at the deepest model, over the seeds | difference | "
            "for the claim |", "|---|---|---|---|"]
  for (phase, test), d in tests.items():
    want = "above 0" if test.startswith("Pre") else "below 0"
    table.append(f"| {phase} | {test} | {one_sample(d)} | {want} |")
  result = "; ".join(f"{phase}: " + ", ".join(f"{name} {describe(*laws[(phase, name)][0])}"
                                              for (p, name) in laws if p == phase)
                     for phase in phases) + " (RMS after block l of the deepest model, mean "
  result += "over seeds); per seed: " + "; ".join(
      f"{phase} {test} {one_sample(d)}" for (phase, test), d in tests.items()) + "."

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
