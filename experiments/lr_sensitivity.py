"""LR sensitivity: how far each placement's final loss rises as its peak learning rate leaves
the optimum, at several widths (Wortsman et al. 2023, arXiv 2309.14322, "Small-scale proxies
for large-scale Transformer training instabilities").

  python experiments/lr_sensitivity.py [--scale=judge|paper] [--widths=32,64,128] [--variants=pre,...]
      [--seeds=100] [--lrs=2.5e-4,...,1.024] [--jobs=N] [--print] [--quick]

Every variant trains at every LR of one wide grid (factors of 2 from 2.5e-4 to 1.024: the
issue's 3e-4 to 1 in steps finer than half-decades, and the norm zoo's and lr_tolerance's
1e-3..0.512 inside it), at each width d of --widths with the depth fixed at the judge
scale's 4 blocks and the head dimension fixed at 32 (d / 32 heads; the LLaMA variants' SwiGLU
width 23 d / 8, tiny_llama's 368 at d = 128). At d = 128 the runs are the judge-scale LR-grid
runs themselves (same names, same configs, under runs/claims/lr_grid/judge), so the norm zoo
and lr_tolerance share them; where their workdirs are gone,
--recorded_from=results/lr_tolerance,results/norm_zoo reads them from those experiments'
committed results (29 of the deciding pair's and pre's and post's d = 128 runs at the time of
writing).

Every run trains to the end, far past the optimum too. The grid used to stop a run early
(train.give_up_steps = 100: its train loss above its first value for 100 steps in a row) and
count it at L0, so that the grid's top would cost little. Measured, the stop saved little and
was not neutral: of the first 554 runs 47 gave up, 7.6% of the sweep's training steps had they
run on, and trained to the end 38 of them came back below L0 (about 5.5), most to the unigram
plateau (3.35). At d = 32 GeoNorm's 11 and Post-LN's 3, counted at L0, had raised GeoNorm's
S by 0.47 and Post-LN's by 0.16, enough to make a difference of +0.07 between them read as
+0.38 (experiments/early_stop_effect.py reads the runs both ways: results/early_stop).
The PyTorch trainer of experiments/torch_judge.py, on the same data and init, shows the same
at lr 0.128: above its start for 154 steps in a row (steps 688-841, up to 12.1), then 3.356
at the end. A run with on_divergence=skip keeps its last finite parameters and ends with a
finite loss; one without a finite final loss counts at L0.

Per (variant, width, seed), with L(lr) the final validation loss and L0 the loss at
initialisation (the first logged train loss of the grid's lowest-LR run: the seed fixes the
initial model, and a high-LR run can spike by its first log; a run without a finite final
loss counts at L0):
  LR sensitivity  S = mean over the grid of min(L(lr), L0) - min over the grid of L(lr)
  (Wortsman et al.'s definition, on our grid: S depends on the grid, which the table states);
  optimal LR      the grid LR of min L ("(edge)" on the grid's edge: extend --lrs);
  tolerance       the largest grid LR up to which, from the optimum upward, every L stays
                  within MARGIN = 0.05 nats of the optimum (lr_tolerance's margin), and its
                  ratio to the optimal LR: the "x-fold" tolerance SimpleGPT's claim needs.
A grid counts once a run has finished at every one of its LRs (S is a mean over the grid):
the table lists, and the verdict leaves out, the grids a stopped sweep left short, and a
width without a complete grid of both deciding variants leaves the verdict unresolved.
Seeds: the selection seed (100) first; --seeds=100,101 adds a second whole grid for the
spread of S (its mean and min-max over seeds in the table).

Variants: the GPT-2-backbone placements of the sweeps (pre, pre_qknorm, pre_qknorm_full,
peri, peri_dt0.1, geonorm, post, deepnorm, ngpt, dyt; dyt_alpha3 and dyt_alpha0.5 are DyT
at alpha_0 = 3, the norm zoo's control, and 0.5, dyt_saturation's counter-test, and
dyt_warmup500 DyT with a 500-step warmup, the stream's early growth held back) and
SimpleGPT's comparison on the LLaMA backbone (pre_llama, simplenorm_llama, as in
lr_tolerance). Judge scale: configs/judge.py.
Cost on this 2-core machine, measured with two runs at once: a full run takes about 8
minutes at d = 128, 5.3 at d = 64 and 3.3 at d = 32, so a sweep spends about 4, 2.7 and 1.7
minutes a run (a narrow run is mostly per-step overhead: d = 32 has 1/16 of d = 128's
weight-matrix FLOPs and a third of its step time). So a variant costs up to
13 x (4 + 2.7 + 1.7) = 110 minutes per seed over the three widths, less the runs the norm zoo
and lr_tolerance already trained at d = 128 (4 to 10 of its 13); all 12 variants at one seed,
up to 22 hours. Order if compute runs short: pre, pre_qknorm, pre_llama, simplenorm_llama,
peri, post, geonorm, deepnorm, at d = 32 and 64 first (--widths=32,64: about half the cost).
--quick: widths 32, two LRs, 60 steps, one seed: a smoke run, not a verdict. Paper scale
(an accelerator job): GPT-2 124M's recipe (configs/gpt2.py, 20k steps) at widths 768, 1024
and 1536 (head dimension 64) on a factor-2 grid from 7.5e-5 to 0.31 around its lr 6e-4.
Writes results/lr_sensitivity/{results.csv, curves.csv, table.md, config.json, verdict.json,
loss_vs_lr.png, sensitivity_vs_width.png}.
Verdict (one of the papers' stability claims in Wortsman et al.'s terms): reproduced when
simplenorm_llama's LR sensitivity is below pre_llama's at every width measured (paired over
seeds, 95% t interval of the difference below 0 at each width), not at this scale when it is
above at any width (Holm over the widths), unresolved otherwise, with fewer than two seeds,
or whenever a deciding optimum is on its grid's edge. The table also reads the other stability
claims in these terms (READINGS: Peri-LN against Pre-LN for divergence_trials, QK-norm against
Pre-LN for Wortsman et al. and its two scopes against each other, Peri-LN with dt = 0.1
against Peri-LN for the optimal-control paper's dt < 1, GeoNorm against Post-LN for
seq_length, DeepNorm against Post-LN for DeepNet, DyT (at each alpha_0 and warmup) and nGPT
against Pre-LN for their parity claims, each DyT setting against the paper's): the paired
difference of S at each width where both grids are complete, then of best loss (each seed at
its own best LR: a flatter curve is not a better model) for those pairs and the deciding one;
those do not enter this verdict. A folder whose --variants leave out the deciding pair
(results/lr_sensitivity_wd0: Pre-LN and Peri-LN without weight decay, which
experiments/divergence_by_lr.py reads) is unresolved and says why.
"""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, results_folder, stats, sweep  # pylint: disable=g-import-not-at-top

NAME = "lr_sensitivity"
CLAIM = ("SimpleNorm lowers Pre-LN's learning-rate sensitivity (the stability claims, read as "
         "Wortsman et al.'s LR sensitivity)")
PAPER_NUMBER = "SimpleGPT: 3-10x the LR; Wortsman et al.: QK-layernorm lowers LR sensitivity"
LRS = "2.5e-4,5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2,6.4e-2,0.128,0.256,0.512,1.024"
# Paper scale: GPT-2 124M's recipe (lr 6e-4) on the same factor-2 grid around its LR.
SWEPT_LRS = {"judge": LRS, "paper": "7.5e-5,1.5e-4,3e-4,6e-4,1.2e-3,2.4e-3,4.8e-3,9.6e-3,"
                                     "1.92e-2,3.84e-2,7.68e-2,0.1536,0.3072"}
WIDTHS = {"judge": "32,64,128", "paper": "768,1024,1536"}
# The scale's own width (no override): at the judge scale its runs are the shared LR-grid runs.
BASE_WIDTH = {"judge": 128, "paper": 768}
HEAD_DIM = {"judge": 32, "paper": 64}
PAPER_PREFIX = "gpt2_124m/"  # apart from the norm zoo's paper-scale grid runs
MARGIN = 0.05  # nats, as lr_tolerance
SCALES = {
    "judge": claims.Scale("configs/judge.py", "on_divergence=skip", "100",
                          "judge scale (configs/judge.py: 4 blocks, character-level "
                          "tinyshakespeare, 2000 steps x 16 x 128 tokens) at widths 32, 64, 128 "
                          "(head dim 32); one wide LR grid per variant and width."),
    "paper": claims.Scale("configs/gpt2.py", "124m,on_divergence=skip," +
                          claims.steps_overrides(20000), "100",
                          "GPT-2 124M's recipe (12 blocks, OpenWebText, seq 1024), 20k steps, at "
                          "widths 768, 1024, 1536 (head dim 64); one wide LR grid per variant "
                          "and width: an accelerator job."),
}
CURVES = (("train", "loss"), ("eval", "loss"))
# SimpleGPT's pair on the LLaMA backbone: the tiny size's LLaMA twin at the judge scale, the
# GPT-2 124M recipe's at paper scale (RMSNorm, SwiGLU, no biases, untied head).
LLAMA_VARIANTS = {"pre_llama": {"judge": "size=tiny_llama,placement=pre",
                                "paper": "backbone=llama,placement=pre"},
                  "simplenorm_llama": {"judge": "size=tiny_llama,placement=simplenorm",
                                       "paper": "backbone=llama,placement=simplenorm"}}
DEFAULT_VARIANTS = ("pre", "pre_qknorm", "pre_qknorm_full", "peri", "peri_dt0.1", "geonorm",
                    "post", "deepnorm", "ngpt", "dyt", "pre_llama", "simplenorm_llama")
DECIDING = ("pre_llama", "simplenorm_llama")  # (baseline, SimpleNorm)
# The other stability claims in these terms: (variant, its baseline, the claim read). Each is a
# paired difference of S per width where both have complete grids; the table states it, the
# verdict stays SimpleGPT's pair's (these pairs decide their own experiments' verdicts).
READINGS = (("peri", "pre", "Peri-LN is the more stable (divergence_trials)"),
            ("pre_qknorm", "pre", "QK-layernorm lowers S (Wortsman et al.)"),
            ("pre_qknorm_full", "pre", "QK-layernorm lowers S (Wortsman et al.)"),
            # At one head (d = 32) the scopes are one function: that pair reads rounding noise.
            ("pre_qknorm_full", "pre_qknorm", "QK-norm's scope, full width against per head "
             "(parity)"),
            ("peri_dt0.1", "peri", "a residual step dt < 1 steadies Peri-LN further (Stability "
             "under LayerNorm)"),
            ("geonorm", "post", "GeoNorm is the more stable (seq_length)"),
            ("deepnorm", "post", "DeepNorm's up-weighted stream steadies Post-LN (DeepNet)"),
            # Not claims about S: a difference near 0 is these papers' direction.
            ("dyt", "pre", "DyT stands in for Pre-LN's norms (Transformers without "
             "Normalization: parity)"),
            ("dyt_alpha3", "pre", "DyT stands in for Pre-LN's norms, at alpha_0 = 3 (parity)"),
            ("dyt_alpha3", "dyt", "DyT's alpha_0, 3 against the paper's table extrapolated (1.0)"),
            ("dyt_alpha0.5", "pre", "DyT stands in for Pre-LN's norms, at alpha_0 = 0.5 "
             "(parity)"),
            # If DyT's plateau is saturation, a smaller alpha_0 takes a larger stream to reach it.
            ("dyt_alpha0.5", "dyt", "DyT's alpha_0, 0.5 against the paper's table extrapolated "
             "(1.0)"),
            ("dyt_warmup500", "dyt", "DyT's warmup, 500 steps against 100 (the growth held "
             "back early)"),
            ("dyt_warmup500", "pre", "DyT stands in for Pre-LN's norms, with a 500-step warmup "
             "(parity)"),
            ("ngpt", "pre", "nGPT trains as well as its Pre-LN baseline (nGPT claims speed, "
             "not S: parity)"))


def add_arguments(parser):
  parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list of "
                      f"{', '.join(LLAMA_VARIANTS)} and {', '.join(sweep.PLACEMENT_VARIANTS)}")
  parser.add_argument("--widths", default=None, help="comma list of d_model values (each a "
                      "multiple of the head dimension); default the scale's: "
                      + "; ".join(f"{k} {v}" for k, v in WIDTHS.items()))


def width_overrides(name, width, scale):
  """The overrides that set a variant's width; none at the scale's own width (at the judge
  scale: the shared LR-grid runs)."""
  if width == BASE_WIDTH[scale]:
    return ""
  parts = f"d_model={width},num_heads={width // HEAD_DIM[scale]}"
  # tiny_llama's SwiGLU width is 23/8 d (368 at 128); at paper scale LLaMA's own rounding.
  return parts + (f",d_ff={23 * width // 8}" if name in LLAMA_VARIANTS and scale == "judge"
                  else "")


def run_name(name, width, scale):
  base = name if width == BASE_WIDTH[scale] else f"d{width}/{name}"
  return (PAPER_PREFIX if scale == "paper" else "") + base


def variant_overrides(name, scale):
  return LLAMA_VARIANTS[name][scale] if name in LLAMA_VARIANTS else sweep.variant_overrides(name)


def _widths(text, scale):
  """The d_model values of a --widths comma list (None: the scale's), each checked against
  the head dimension."""
  text = text or WIDTHS[scale]
  try:
    widths = [int(w) for w in text.split(",")]
  except ValueError:
    raise SystemExit(f"--widths: {text!r} is not a comma list of integers") from None
  head_dim = HEAD_DIM[scale]
  bad = [w for w in widths if w <= 0 or w % head_dim]
  if bad:
    raise SystemExit(f"--widths: {bad} are not positive multiples of the head dimension {head_dim}")
  return widths


def grid(args, scale):
  del scale
  names = args.variants.split(",")
  steps = claims.steps_overrides(60) if args.quick else ""
  if args.quick:
    args.widths, args.lrs = "32", args.lrs or "1e-3,0.512"
    names = [n for n in names if n in DECIDING] or names
  return [claims.variant(run_name(name, width, args.scale),
                         claims.join(variant_overrides(name, args.scale),
                                     width_overrides(name, width, args.scale), steps),
                         variant=name, width=width)
          for width in _widths(args.widths, args.scale) for name in names]


def tolerance(lrs, losses, margin=MARGIN):
  """(optimal LR, largest LR within `margin` of the optimum going up from it without a gap)."""
  order = np.argsort(lrs)
  x = np.asarray(lrs, float)[order]
  y = np.asarray(losses, float)[order]
  y = np.where(np.isfinite(y), y, np.inf)
  if not np.isfinite(y).any():
    return None, None
  best = int(np.argmin(y))
  top = best
  while top + 1 < len(y) and y[top + 1] <= y[best] + margin:
    top += 1
  return float(x[best]), float(x[top])


def lowest_diverged(lrs, losses, l0):
  """The lowest grid LR whose run ended no better than at initialisation (a final loss at or
  above L0, or none): divergence_trials' "diverged", read at the end of a run; None if none."""
  ended_above = [lr for lr, loss in zip(lrs, losses) if not loss < l0]
  return min(ended_above) if ended_above else None


def by_grid(rows, curves):
  """{(variant, width, seed): (lrs, losses, L0)} of the finished runs."""
  out = {}
  for row in rows:
    key = (row["variant"], row["width"], row["seed"])
    lrs, losses, names = out.setdefault(key, ([], [], []))
    lrs.append(row["lr"])
    losses.append(row["final_eval_loss"])
    names.append(row["name"])
  return {k: (lrs, losses, claims.grid_initial_loss(curves, names, lrs))
          for k, (lrs, losses, names) in out.items()}


def read_folder(folder):
  """(config.json, results.csv rows, curves.csv rows) of an lr_sensitivity results folder, for
  the experiments that read one (divergence_by_lr, early_stop_effect); an error naming it if it
  is not one."""
  path = os.path.join(folder, "config.json")
  if not os.path.exists(path):
    raise SystemExit(f"{folder}: no config.json, not a results folder")
  with open(path) as f:
    config = json.load(f)
  if config.get("experiment") != NAME:
    raise SystemExit(f"{folder}: written by {config.get('experiment')!r}, not {NAME}")
  return (config, results_folder.read_csv(os.path.join(folder, "results.csv")),
          results_folder.read_csv(os.path.join(folder, "curves.csv")))


def swept(config):
  """(widths, LRs) the results folder's command asked for: its --widths and --lrs or the
  scale's defaults (--quick's cut grid is in its args)."""
  args, scale = config["args"], config["scale"]
  return _widths(args.get("widths"), scale), claims.parse_lrs(args.get("lrs") or SWEPT_LRS[scale])


def complete(grids, lrs):
  """(the grids with a finished run at every LR of `lrs`, {key: how many of them the others
  have}): S is a mean over the grid, so a grid that a stopped sweep left short is not S."""
  def has(grid_lrs, lr):
    return any(math.isclose(lr, x, rel_tol=1e-6) for x in grid_lrs)
  full, short = {}, {}
  for key, grid in grids.items():
    present = sum(has(grid[0], lr) for lr in lrs)
    if present == len(lrs):
      full[key] = grid
    else:
      short[key] = present
  return full, short


def cells_of(grids):
  """{(variant, width): {seed: (S, Optimum, optimal lr, largest lr within MARGIN)}} of
  by_grid's grids: what the table, the verdict and stability.ipynb read."""
  cells = {}
  for (name, width, seed), (lrs, losses, l0) in grids.items():
    optimum = claims.grid_optimum(lrs, losses)
    best, top = tolerance(lrs, losses)
    cells.setdefault((name, width), {})[seed] = (claims.lr_sensitivity(losses, l0), optimum, best,
                                                   top)
  return cells


def summarize(rows, curves, config):
  widths, lrs = swept(config)
  grids, short = complete(by_grid(rows, curves), lrs)
  cells = cells_of(grids)
  table = ["| variant | width | seeds | LR sensitivity (nats) | min-max | best loss | optimal lr | "
           f"largest lr within {MARGIN} | x-fold | lowest lr ending at or above init, per seed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for (name, width), by_seed in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    s = [v[0] for v in by_seed.values()]
    first = by_seed[min(by_seed)]
    optimum, best, top = first[1], first[2], first[3]
    opt = "-" if optimum.x is None else f"{optimum.x:g}" + (" (edge)" if optimum.at_edge else "")
    fold = f"{top / best:g}" if best else "-"
    diverged = ", ".join(f"{x:g}" if x else "-" for x in (
        lowest_diverged(*grids[(name, width, seed)]) for seed in sorted(by_seed)))
    best_loss = claims.fmt([v[1].loss for v in by_seed.values()]).split(" (")[0]
    table.append(f"| {name} | {width} | {len(s)} | {claims.fmt(s)} | "
                 f"{min(s):.3f}-{max(s):.3f} | {best_loss} | {opt} | {top if top else '-'} | "
                 f"{fold} | {diverged} |")
  table += ["", f"LR sensitivity: mean over the LR grid of the final validation loss capped at "
            "the loss at initialisation, minus the grid's best (Wortsman et al. 2023). Best loss: "
            "the grid's lowest final validation loss, each seed at its own best LR (mean +- sd "
            "over seeds). Optimal lr, "
            "tolerance and x-fold from the lowest seed's grid (the selection seed). Grid: "
            f"{','.join(f'{lr:g}' for lr in lrs)}."]
  if short:
    table += ["", "Not counted, grids that the sweep has not finished (finished LRs of "
              f"{len(lrs)}): " + ", ".join(f"{name} d={width} seed {seed} ({n})" for
                                           (name, width, seed), n in sorted(short.items())) + "."]
  table += readings(cells, widths)
  holds, diffs = verdict_of(cells, widths)
  asked = (config["args"].get("variants") or ",".join(DEFAULT_VARIANTS)).split(",")
  result = ("; ".join(f"simplenorm_llama - pre_llama at d={w}: {d.describe()}"
                      for w, d in diffs.items()) or "the deciding variants have no grids yet"
            if set(DECIDING) <= set(asked) else
            f"not this folder's question: its --variants leave out {', '.join(DECIDING)} "
            "(it reads the other stability claims only)")
  drawn = sorted({w for _, w in cells})
  figures = {
      "loss_vs_lr.png": lambda fig: plot_grids(fig, grids, drawn),
      "sensitivity_vs_width.png": lambda fig: plot_sensitivity(fig, cells)} if cells else {}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


def readings(cells, widths):
  """Table lines: READINGS' paired differences of S, variant minus baseline, per width; then
  of their best losses and the deciding pair's, each grid at its own best LR (the fair
  comparison of the two at tuned LRs that the stability claims leave aside)."""
  lines, best = [], []
  for name, base, claim in ((DECIDING[1], DECIDING[0], None),) + READINGS:
    for width in widths:
      a, b = cells.get((name, width)), cells.get((base, width))
      if a and b:
        d = stats.difference({k: v[0] for k, v in a.items()}, {k: v[0] for k, v in b.items()})
        if claim:  # the deciding pair's S is the verdict's, stated there
          lines.append(f"- {name} - {base} at d={width}: {d.describe()}; the claim read: {claim}")
        d = stats.difference({k: v[1].loss for k, v in a.items()},
                             {k: v[1].loss for k, v in b.items()})
        best.append(f"- {name} - {base} at d={width}: {d.describe()}")
  out = []
  if lines:
    out += ["", "Other stability claims read as S (the same grids; a negative difference is a "
            "'more stable' claim's direction, one near 0 a parity claim's; not this "
            "experiment's verdict):"] + lines
  if best:
    out += ["", "Best losses, each seed at its own best LR of the grid (variant minus baseline; "
            "the pairs above and SimpleGPT's):"] + best
  return out


def verdict_of(cells, widths):
  """(holds, {width: Difference of S, simplenorm_llama - pre_llama}) by the docstring's rule."""
  diffs = {}
  for width in widths:
    base, simple = cells.get((DECIDING[0], width)), cells.get((DECIDING[1], width))
    if not base or not simple:
      continue
    diffs[width] = stats.difference({k: v[0] for k, v in simple.items()},
                                    {k: v[0] for k, v in base.items()})
  edged = [c for name in DECIDING for w in widths for c in (cells.get((name, w)) or {}).values()
           if c[1].at_edge or c[1].x is None]
  if not diffs or len(diffs) < len(widths) or edged:
    return None, diffs
  if any(o == "higher" for o in stats.outcomes(diffs).values()):
    return False, diffs
  if all(d.outcome == "lower" for d in diffs.values()):
    return True, diffs
  return None, diffs


def plot_grids(figure, grids, widths):
  """Final loss (capped at L0) against peak LR, one panel per width, one colour per variant,
  a line per seed."""
  for i, width in enumerate(widths):
    axes = figure.add_subplot(1, len(widths), i + 1)
    names = sorted({n for n, w, _ in grids if w == width})
    for j, name in enumerate(names):
      for seed in sorted(s for n, w, s in grids if n == name and w == width):
        lrs, losses, l0 = grids[(name, width, seed)]
        order = np.argsort(lrs)
        y = np.minimum(np.where(np.isfinite(losses), losses, l0), l0)
        axes.plot(np.asarray(lrs)[order], y[order], marker="o", ms=3, color=f"C{j % 10}",
                  label=name if seed == min(s for n, w, s in grids if n == name) else None)
    axes.set_xscale("log")
    axes.set_title(f"d = {width}", fontsize=9)
    axes.set_xlabel("peak learning rate")
    if i == 0:
      axes.set_ylabel("final validation loss, capped at init (nats)")
    axes.grid(alpha=0.3)
  figure.axes[-1].legend(fontsize=6)
  figure.set_size_inches(4 * len(widths), 4)


def plot_sensitivity(figure, cells):
  """S against width per variant: the mean over seeds, bars to the min and max."""
  axes = figure.add_subplot(1, 1, 1)
  for j, name in enumerate(sorted({n for n, _ in cells})):
    widths = sorted(w for n, w in cells if n == name)
    s = [[v[0] for v in cells[(name, w)].values()] for w in widths]
    mean = [np.nanmean(x) for x in s]
    axes.errorbar(widths, mean, yerr=[[m - np.nanmin(x) for m, x in zip(mean, s)],
                                      [np.nanmax(x) - m for m, x in zip(mean, s)]],
                  marker="o", capsize=3, color=f"C{j % 10}", label=name)
  axes.set_xscale("log", base=2)
  axes.set_xlabel("width d_model")
  axes.set_ylabel("LR sensitivity (nats)")
  axes.legend(fontsize=7, ncol=2)
  axes.grid(alpha=0.3)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
