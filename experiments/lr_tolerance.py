"""LR tolerance: does SimpleNorm train at 3-10x the peak learning rate of Pre-LN?

  python experiments/lr_tolerance.py [--scale=judge|paper] [--seeds=0,1,2]
      [--variants=pre_llama,simplenorm_llama] [--lrs=1e-3,...,0.512] [--jobs=N] [--print]
      [--quick]

The learning-rate protocol of claims.py, on the norm zoo's footing: every variant trains at
each LR of the grid on the selection seed (100); an optimum on the grid's edge extends it by
2x; then the final seeds (0, 1, 2) train at the variant's best LR. The grid is the norm zoo's
(1e-3 to 8e-3) continued upward by factors of 2 to 0.512, where the tolerance ends.
Variants: SimpleGPT compares SimpleNorm with Pre-LN on LLaMA models, so the two that decide
are pre_llama and simplenorm_llama, the tiny model on the LLaMA backbone (size tiny_llama:
RMSNorm, SwiGLU, RoPE, untied head, as many parameters as tiny). Any of the norm zoo's variants
(GPT-2 backbone: pre, pre_qknorm, simplenorm, geonorm, peri, ...) can be added for reference:
their judge scale, names and LRs are the norm zoo's, so the runs the two experiments share
(runs/claims/lr_grid/judge) train once.
The tolerance of a variant: the largest grid LR up to which (from its best LR upward) every
grid LR's final validation loss on the selection seed stays within MARGIN = 0.05 nats of the
variant's optimum; a non-finite loss is outside. 0.05 nats is a difference the norm zoo would
call a clear placement effect, and several times the seed-to-seed spread of a run at a tuned
LR (0.004 to 0.016 in the norm zoo's tables). Seed noise: a grid LR is surely within (outside)
when its loss minus the optimum's, +- the 95% t half-width t(df) x sigma x sqrt(2), is below
(above) the margin; sigma is the pooled standard deviation of the final seeds at each variant's
tuned LR (df their pooled degrees of freedom). So each tolerance is a range [low, high] of grid
LRs (high infinite when no grid LR above the optimum is surely outside: extend --lrs), and
SimpleNorm's over Pre-LN's is the range [low_s / high_p, high_s / low_p].
Judge scale: configs/judge.py (2000 steps x 16 x 128 characters of tinyshakespeare),
on_divergence=skip like the norm zoo; 2 variants x (10 grid LRs + 3 seeds) = 26 runs, about
26 x 3.8 = 100 minutes on this 2-core machine (two runs at once), more if an optimum extends
the grid; each reference variant 13 runs, 50 minutes, less what the norm zoo already ran (4 of
pre's). --quick: the two deciding variants, 150 steps, one LR (2e-3, no tuning), one seed: a
smoke run, not a verdict. Paper scale: configs/llama.py:llama2_1b (SimpleGPT's 1B size), its
variants named llama2_1b/... so that its grid runs are not taken for the norm zoo's 125M ones.
Writes results/lr_tolerance/{results.csv, curves.csv, table.md, config.json, verdict.json,
loss_vs_lr.png}.
Verdict: reproduced when SimpleNorm's tolerance is at least FOLD = 3 times Pre-LN's over the
whole range (low_s / high_p >= 3); not at this scale (contradicted at paper scale) when it is
below 3 over the whole range (high_s / low_p < 3); unresolved otherwise, and whenever either
variant's optimum is on its grid's edge (no optimum to measure the margin from) or the final
seeds give no spread (one seed).
"""
import dataclasses
import math
import os
import sys

import numpy as np
from scipy import stats as scipy_stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats, sweep  # pylint: disable=g-import-not-at-top

NAME = "lr_tolerance"
CLAIM = "SimpleNorm trains at 3-10x the peak learning rate of Pre-LN"
PAPER_NUMBER = "3-10x; 7B loss 2.208 vs 2.290, 1B 2.446 vs 2.478 (SimpleGPT)"
# The norm zoo's grid (1e-3..8e-3, TUNED_LRS of experiments/norm_zoo.py) doubled on to 0.512.
TUNED_LRS = {"judge": "1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2,6.4e-2,0.128,0.256,0.512",
             "paper": "3e-4,6e-4,1.2e-3,2.4e-3,4.8e-3,9.6e-3,1.92e-2,3.84e-2"}
MARGIN = 0.05  # nats: an LR is tolerated while its final loss is within this of the optimum
FOLD = 3  # the claim's lower end: SimpleNorm's tolerance over Pre-LN's
SCALES = {
    # The norm zoo's judge scale, item for item: their shared LR-grid runs are the same runs.
    "judge": claims.Scale("configs/judge.py", "on_divergence=skip", "0,1,2",
                          "judge scale: tiny model (4 blocks x 128, untied head), "
                          "character-level tinyshakespeare, 2000 steps x 16 x 128 tokens, "
                          "cosine to 0.1x (configs/judge.py); an LR grid per variant."),
    "paper": claims.Scale("configs/llama.py",
                          "llama2_1b,steps=20000,warmup_steps=200,schedule=linear,"
                          "min_lr_ratio=0,weight_decay_scope=all,on_divergence=skip",
                          "0,1,2", "LLaMA-2 1B (18 x 2048), seq 4096, 20k steps x 1024 x 4096 "
                          "tokens (configs/llama.py; SimpleGPT's 1B ran 60k steps) with "
                          "SimpleGPT's optimizer recipe: a 1% warmup, linear decay to 0, "
                          "weight decay on every parameter; an LR grid per variant."),
}
PAPER_PREFIX = "llama2_1b/"
CURVES = (("train", "loss"), ("eval", "loss"))
# SimpleGPT compares SimpleNorm with Pre-LN on LLaMA-style models: at the judge scale both on
# the LLaMA backbone of the tiny size (geonorm_jax/training/config.py SIZES["tiny_llama"]), named apart
# from the norm zoo's GPT-2-backbone "pre" and "simplenorm" so that their grid runs in
# runs/claims/lr_grid/judge never collide; at paper scale the scale's model is already LLaMA.
LLAMA_VARIANTS = {
    "pre_llama": {"judge": "size=tiny_llama,placement=pre", "paper": "placement=pre"},
    "simplenorm_llama": {"judge": "size=tiny_llama,placement=simplenorm",
                         "paper": "placement=simplenorm"},
}
DECIDING = ("pre_llama", "simplenorm_llama")  # (baseline, SimpleNorm)


def add_arguments(parser):
  parser.add_argument("--variants", default=",".join(DECIDING), help="comma list of "
                      f"{', '.join(LLAMA_VARIANTS)} (LLaMA backbone) and "
                      f"{', '.join(sweep.PLACEMENT_VARIANTS)} (the norm zoo's, GPT-2 backbone)")


def variant_overrides(name, scale):
  if name in LLAMA_VARIANTS:
    return LLAMA_VARIANTS[name][scale]
  return sweep.variant_overrides(name)


def grid(args, scale):
  del scale
  names = args.variants.split(",")
  if args.quick:  # no tuning: one LR, 150 steps, the two deciding variants
    args.lrs = args.lrs or "2e-3"
    args.max_extensions = 0
    names = [n for n in names if n in DECIDING] or names
  steps = claims.steps_overrides(150) if args.quick else ""
  prefix = PAPER_PREFIX if args.scale == "paper" else ""
  return [claims.variant(prefix + name, claims.join(variant_overrides(name, args.scale), steps),
                         variant=name) for name in names]


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """The grid tolerance of a variant: surely at least `low`, at most `high` (inf: the grid
  may be too short); None when no loss is finite."""
  optimum: claims.Optimum
  low: float | None
  high: float
  half_width: float  # the seed-noise half-width used, nats

  def describe(self):
    if self.low is None:
      return "-"
    if self.low == self.high:
      return f"{self.low:g}"
    high = f"> {self.optimum.grid[-1]:g}" if math.isinf(self.high) else f"{self.high:g}"
    return f"[{self.low:g}, {high}]"


def selection(rows):
  """{variant: {lr: final validation loss on the selection seed}}."""
  out = {}
  for row in rows:
    if row.get("stage") == "select":
      out.setdefault(row["variant"], {})[row["lr"]] = row["final_eval_loss"]
  return out


def sensitivities(rows, curves):
  """{variant: Wortsman et al.'s LR sensitivity of its selection-seed grid}, over the LRs
  every variant's grid has (an extended grid would otherwise weigh in), with L0 the first
  train loss of the variant's lowest-LR grid run (lr_sensitivity's reading of the same runs)."""
  grids, names = selection(rows), {}
  for row in rows:
    if row.get("stage") == "select":
      names.setdefault(row["variant"], {})[row["lr"]] = row["name"]
  shared = sorted(set.intersection(*(set(g) for g in grids.values()))) if grids else []
  return {name: claims.lr_sensitivity([losses[lr] for lr in shared],
                                      claims.grid_initial_loss(curves, list(names[name].values()),
                                                               list(names[name])))
          for name, losses in grids.items()}, shared


def finals(rows):
  return {name: runs for (name,), runs in claims.group(
      [r for r in rows if r.get("stage") == "final"], "variant").items()}


def seed_noise(final_by_variant):
  """(pooled standard deviation, degrees of freedom) of the final seeds' validation losses,
  each variant about its own mean; (nan, 0) with no variant of two finite seeds."""
  squares, df = 0.0, 0
  for runs in final_by_variant.values():
    x = claims.values(runs, "final_eval_loss")
    x = x[np.isfinite(x)]
    if len(x) >= 2:
      squares += float(np.sum((x - x.mean()) ** 2))
      df += len(x) - 1
  return (math.sqrt(squares / df), df) if df else (float("nan"), 0)


def tolerance(losses, sigma, df, margin=MARGIN, level=stats.LEVEL):
  """The Tolerance of {lr: loss} (the selection seed's grid) given the seed noise."""
  lrs = sorted(losses)
  optimum = claims.grid_optimum(lrs, [losses[lr] for lr in lrs])
  half = (float(scipy_stats.t.ppf(0.5 + level / 2, df)) * sigma * math.sqrt(2)
          if df >= 1 and math.isfinite(sigma) else math.inf)
  if optimum.x is None:
    return Tolerance(optimum, None, math.inf, half)
  low, high, low_open = optimum.x, optimum.x, True
  for lr in [lr for lr in lrs if lr > optimum.x]:
    gap = losses[lr] - optimum.loss if np.isfinite(losses[lr]) else math.inf
    within = gap + half < margin
    outside = math.isinf(gap) or gap - half > margin
    if low_open and within:
      low = lr
    else:
      low_open = False
    if outside:
      break
    high = lr
  else:
    high = math.inf  # no grid LR above the optimum is surely outside: the grid may be short
  return Tolerance(optimum, low, high, half)


def tolerances(rows):
  sigma, df = seed_noise(finals(rows))
  return {name: tolerance(losses, sigma, df) for name, losses in selection(rows).items()}, (
      sigma, df)


def ratio_range(tol):
  """(lowest, highest) of SimpleNorm's tolerance over Pre-LN's, over their ranges."""
  s, p = tol[DECIDING[1]], tol[DECIDING[0]]
  return s.low / p.high, s.high / p.low


def verdict_of(rows):
  """(holds, tolerances, ratio range or None, edge text): the rule of the docstring."""
  tol, (sigma, df) = tolerances(rows)
  if not all(name in tol and tol[name].low is not None for name in DECIDING):
    return None, tol, None, None
  edge = claims.at_edge({name: tol[name].optimum for name in DECIDING})
  if edge or df < 1:
    return None, tol, None, edge
  low, high = ratio_range(tol)
  # Decimal grids: 0.3 / 0.1 is 2.9999999999999996 in binary floating point.
  if low >= FOLD * (1 - 1e-9):
    return True, tol, (low, high), None
  if high < FOLD * (1 - 1e-9):
    return False, tol, (low, high), None
  return None, tol, (low, high), None


def summarize(rows, curves, config):
  holds, tol, ratios, edge = verdict_of(rows)
  grids, final = selection(rows), finals(rows)
  sigma, df = seed_noise(final)
  sens, shared = sensitivities(rows, curves)
  table = ["| variant | LR grid (selection seed): final validation loss | tuned lr | "
           "final seeds at the tuned lr | tolerance (largest lr within "
           f"{MARGIN:g} nats) | LR sensitivity (nats) |", "|---|---|---|---|---|---|"]
  for name, losses in grids.items():
    t = tol[name]
    tuned = ("-" if t.optimum.x is None else f"{t.optimum.x:g}"
             + (" (edge)" if t.optimum.at_edge else ""))
    runs = final.get(name, [])
    table.append(f"| {name} | " + ", ".join(f"{lr:g}: {losses[lr]:.3f}" for lr in sorted(losses))
                 + f" | {tuned} | {claims.cell(runs, 'final_eval_loss') if runs else '-'} | "
                 f"{t.describe()} | {'-' if math.isnan(sens[name]) else f'{sens[name]:.3f}'} |")
  half = next(iter(tol.values())).half_width if tol else math.inf
  table += ["", f"Tolerance: the largest grid LR up to which every grid LR above the tuned one "
            f"has a final loss within {MARGIN:g} nats of the tuned one's, on the selection seed; "
            f"a range where seed noise leaves a grid LR undecided (+- {half:.3f} nats: 95% t "
            f"half-width of a difference of two runs, from the final seeds' pooled std "
            f"{sigma:.4f}, df {df}). LR sensitivity (Wortsman et al. 2023, as in "
            f"experiments/lr_sensitivity.py): the mean over the LRs every grid here has "
            f"({', '.join(f'{lr:g}' for lr in shared)}) of the final loss capped at the loss at "
            f"initialisation, minus their best; selection seed only."]
  result = ("tolerance: " + ", ".join(f"{n} {t.describe()}" for n, t in tol.items()) if tol
            else "no LR-grid (selection-seed) runs in these results")
  if ratios is not None:
    fmt = lambda x: "inf" if math.isinf(x) else f"{x:g}"
    result += f"; SimpleNorm / Pre-LN in [{fmt(ratios[0])}, {fmt(ratios[1])}]x (claim >= {FOLD}x)"
  result += "."
  if edge:
    result += " " + edge + "."
  elif ratios is None and all(n in tol for n in DECIDING):
    result += " No spread of the final seeds (one seed?): no verdict."

  def draw(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, (name, losses) in enumerate(grids.items()):
      lrs = sorted(losses)
      colour = f"C{i % 10}"
      axes.plot(lrs, [losses[lr] for lr in lrs], marker="o", color=colour, label=name)
      t = tol[name]
      if t.optimum.x is not None:
        axes.hlines(t.optimum.loss + MARGIN, lrs[0], lrs[-1], colors=colour, linestyles=":",
                    lw=0.8)
        axes.plot([t.low], [losses[t.low]], "o", ms=12, mfc="none", color=colour)
    axes.set_xscale("log")
    axes.set_ylim(top=3.6)
    axes.set_xlabel("peak learning rate")
    axes.set_ylabel("final validation loss (nats/token)")
    axes.set_title(f"selection seed: loss vs peak LR; dotted: optimum + {MARGIN:g} nats; "
                   "ringed: tolerance (surely within)", fontsize=9)
    if grids:
      axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result, {"loss_vs_lr.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
