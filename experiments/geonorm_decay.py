"""GeoNorm decay: is the harmonic step size alpha/k the best schedule over depth?

  python experiments/geonorm_decay.py [--scale=judge|paper] [--seeds=0,1,2] [--quick]
      [--schedules=...] [--alphas=1,4,16,32,64] [--counters=blocks] [--lr=1e-3] [--jobs=N]
      [--print]

Grid: geo_schedule in {constant, harmonic (alpha/k), sqrt (alpha/sqrt k), linear
(alpha (T-k+1)/T), linear_paper (alpha (T-k)/T)} x geo_alpha x geo_counter (k counts blocks;
--counters=blocks,sublayers adds k over the 2T sublayers). The alpha grid runs from 1 to 64 so
that each schedule's best alpha can be interior: on the 300-step runs this grid replaced, every
schedule's best was alpha 2, then the grid's largest; and at initialisation GeoNorm turns the
stream by alpha x (a few thousandths of a radian) per sublayer, so that only alpha near 32
turns the first block's sublayers as far as Pre-LN's do (results/init_angles/table.md).
Every run trains at one stated peak LR (LR below, --lr): tuning the LR of each of the 25
cells is unaffordable here, so LR is to be set from the norm zoo's tuned LR for the base
placement, GeoNorm harmonic alpha 1 (results/norm_zoo/table.md); until that table is on the
judge scale it is 1e-3 (at 3e-3 GeoNorm collapsed in some seeds of the 500-step recipe:
results/shakespeare/table.md).
Judge scale: configs/judge.py (tiny model, 2000 steps x 16 x 128 characters of
tinyshakespeare); 5 schedules x 5 alphas x 3 seeds = 75 runs, about 75 x 3.8 = 285 minutes
(4.8 hours) on this 2-core machine, two runs at once; --counters=blocks,sublayers doubles it.
--quick: alpha 1, blocks, one seed, 150 steps (5 short runs, a few minutes): a smoke run, not
a verdict. Paper scale: configs/geonorm_paper.py:125m at lr 6e-4. Writes
results/geonorm_decay/{results.csv, curves.csv, table.md, config.json, verdict.json,
loss_vs_alpha.png}.
Verdict (stats.py; 95% level). The best cell of a schedule: its (alpha, counter) of the lowest
mean final validation loss over the seeds. Unresolved, with the "optimum at the grid edge"
text, while the best alpha of any (schedule, counter) line is the grid's smallest or largest
(the loss may go on falling beyond it). Otherwise, paired over the seeds (every cell shares the
seeds' init and data order): reproduced when harmonic's best cell is below the best cell of
each of the four other schedules (all four t intervals of the difference below 0: an
intersection, so no correction); not at this scale (contradicted at paper scale) when some
other schedule's best cell is below harmonic's (Holm over the four); unresolved otherwise. The
best cells are chosen on the seeds they are then compared on; every schedule chooses among
the same number of cells, so the choice favours none of them.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats  # pylint: disable=g-import-not-at-top

NAME = "geonorm_decay"
CLAIM = "the harmonic step size alpha/k is GeoNorm's best decay over depth"
PAPER_NUMBER = "ablation in the GeoNorm paper (harmonic best)"
# The stated peak LR of every run: set it from the norm zoo's tuned LR for GeoNorm.
LR = {"judge": "1e-3", "paper": "6e-4"}
SCALES = {
    "judge": claims.Scale("configs/judge.py", "", "0,1,2",
                          "judge scale: tiny model (4 blocks x 128, untied head), "
                          "character-level tinyshakespeare, 2000 steps x 16 x 128 tokens, "
                          "cosine to 0.1x (configs/judge.py); one stated LR for every cell."),
    "paper": claims.Scale("configs/geonorm_paper.py", "125m", "0,1,2",
                          "GeoNorm's 125M (12 x 768, RoPE, untied), seq 2048, 20k steps x "
                          "256 x 2048 tokens (configs/geonorm_paper.py); one stated LR."),
}
CURVES = (("train", "loss"), ("eval", "loss"))
SCHEDULES = ("constant", "harmonic", "sqrt", "linear", "linear_paper")
ALPHAS = "1,4,16,32,64"


def add_arguments(parser):
  parser.add_argument("--schedules", default=",".join(SCHEDULES))
  parser.add_argument("--alphas", default=ALPHAS)
  parser.add_argument("--counters", default="blocks", help="blocks and/or sublayers")
  parser.add_argument("--lr", default=None, help="peak LR of every run; default LR[scale]")


def grid(args, scale):
  del scale
  args.lr = args.lr or LR[args.scale]
  alphas = ["1"] if args.quick else args.alphas.split(",")
  counters = ["blocks"] if args.quick else args.counters.split(",")
  steps = claims.steps_overrides(150) if args.quick else ""
  return [claims.variant(f"{s}/alpha{a}/{c}", claims.join(
      f"placement=geonorm,geo_schedule={s},geo_alpha={a},geo_counter={c},lr={args.lr}", steps),
                         schedule=s, alpha=float(a), counter=c)
          for s in args.schedules.split(",") for a in alphas for c in counters]


def _mean(runs):
  """Mean final validation loss over the seeds; NaN when any seed's is not finite (a cell
  with a diverged seed never wins)."""
  return float(np.mean(claims.values(runs, "final_eval_loss")))


def line_optima(rows):
  """{(schedule, counter): Optimum over alpha of the mean final validation loss}."""
  out = {}
  for (schedule, counter), runs in claims.group(rows, "schedule", "counter").items():
    cells = claims.group(runs, "alpha")
    alphas = sorted(a for (a,) in cells)
    out[(schedule, counter)] = claims.grid_optimum(alphas, [_mean(cells[(a,)]) for a in alphas])
  return out


def best_cells(rows, optima):
  """{schedule: (alpha, counter, rows)}: the line of the lowest optimum, at its best alpha."""
  best = {}
  for (schedule, counter), optimum in optima.items():
    if optimum.x is None:
      continue
    if schedule not in best or optimum.loss < best[schedule][0]:
      runs = [r for r in rows if (r["schedule"], r["counter"], r["alpha"]) ==
              (schedule, counter, optimum.x)]
      best[schedule] = (optimum.loss, optimum.x, counter, runs)
  return {s: cell[1:] for s, cell in best.items()}


def verdict_of(rows):
  """(holds, differences, edge text): the rule of the docstring."""
  optima = line_optima(rows)
  edge = claims.at_edge({f"{s}, k={c}": o for (s, c), o in optima.items()}, "alpha")
  best = best_cells(rows, optima)
  if "harmonic" not in best:
    return None, {}, edge
  harmonic = stats.by_seed(best["harmonic"][2], "final_eval_loss")
  diffs = {s: stats.difference(harmonic, stats.by_seed(runs, "final_eval_loss"))
           for s, (_, _, runs) in best.items() if s != "harmonic"}
  if edge or not diffs:
    return None, diffs, edge
  if any(o == "higher" for o in stats.outcomes(diffs).values()):
    return False, diffs, edge
  others = set(SCHEDULES) - {"harmonic"}
  if others <= set(diffs) and all(d.outcome == "lower" for d in diffs.values()):
    return True, diffs, edge
  return None, diffs, edge


def summarize(rows, curves, config):
  del curves
  table = ["| schedule | alpha | k counts | seeds | final validation loss |",
           "|---|---|---|---|---|"]
  for (schedule, alpha, counter), runs in claims.group(rows, "schedule", "alpha",
                                                       "counter").items():
    table.append(f"| {schedule} | {alpha:g} | {counter} | {len(runs)} | "
                 f"{claims.cell(runs, 'final_eval_loss')} |")
  optima = line_optima(rows)
  best = best_cells(rows, optima)
  holds, diffs, edge = verdict_of(rows)
  table += ["", "Best alpha of each line (mean over the seeds): " + "; ".join(
      f"{s}, k={c}: {o.describe('alpha')}" for (s, c), o in optima.items()) + ".",
            "", "Best cell of each schedule: " + "; ".join(
                f"{s} (alpha {a:g}, {c}) {claims.cell(r, 'final_eval_loss')}"
                for s, (a, c, r) in best.items()) + "."]
  lr = config["args"].get("lr")
  result = (f"at lr {lr}, harmonic's best cell - each schedule's best, final validation loss: "
            if diffs else "harmonic or the other schedules not run; ")
  result += "; ".join(f"{s} {d.describe()}" for s, d in diffs.items()) + "."
  if edge:
    result += " " + edge + "."

  def draw(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((schedule, counter), runs) in enumerate(claims.group(rows, "schedule",
                                                                 "counter").items()):
      alphas, means, stds = claims.curve_over(runs, "alpha", "final_eval_loss")
      axes.errorbar(alphas, means, yerr=stds,
                    marker="o" if counter == "blocks" else "s", capsize=3,
                    color=f"C{SCHEDULES.index(schedule) if schedule in SCHEDULES else i}",
                    ls="-" if counter == "blocks" else "--", label=f"{schedule}, k={counter}")
    axes.set_xscale("log")
    axes.set_xlabel("geo_alpha (step-size scale, dimensionless)")
    axes.set_ylabel("final validation loss (nats/token)")
    axes.set_title(f"GeoNorm step-size schedules at lr {lr} (mean +- std over seeds)",
                   fontsize=9)
    axes.legend(fontsize=7, ncol=2)
    axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result,
                        {"loss_vs_alpha.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
