"""Residual step: is Peri-LN best at dt = 0.1?

  python experiments/residual_step.py [--scale=judge|paper] [--seeds=0,1,2] [--quick]
      [--variants=peri] [--dts=1,0.5,0.2,0.1,0.05,0.02,0.01] [--lr=4e-3] [--jobs=N]
      [--print]

Every sublayer adds dt x its output (model.dt). The dt grid runs down to 0.01 so that Peri-LN's
best dt can be interior: on the 300-step runs this grid replaced, the best was 0.02, then the
grid's smallest. Every run trains at one stated peak LR (LR below, --lr): tuning the LR of each
(placement, dt) cell is unaffordable here, so it is the norm zoo's tuned LR for the base
placement, Peri-LN at dt 1, on the judge scale: 4e-3 (results/norm_zoo/table.md). Only Peri-LN's
line decides; --variants=pre,peri adds Pre-LN's dt line for reference (it decides nothing).
Judge scale: configs/judge.py (tiny model, 2000 steps x 16 x 128 characters of
tinyshakespeare); 7 dt x 3 seeds = 21 runs, about 21 x 3.8 = 80 minutes on this 2-core
machine, two runs at once (--variants=pre,peri: 42 runs, 160 minutes). --quick: dt in
{1, 0.1}, one seed, 150 steps: a smoke run, not a verdict. Paper scale: configs/gpt2.py:124m,
20k steps, lr 6e-4. Writes results/residual_step/{results.csv, curves.csv, table.md,
config.json, verdict.json, loss_vs_dt.png}.
Verdict (stats.py; 95% level), on Peri-LN's cells, paired over the seeds (every cell shares the
seeds' init and data order): reproduced when Peri-LN's best dt (lowest mean final validation
loss) is 0.1, interior to the grid, and dt=0.1 is below every other dt (each t interval of the
difference below 0: an intersection, no correction); not at this scale (contradicted at paper
scale) when some other dt is below dt=0.1 (Holm over the comparisons): that needs no optimum,
so it holds whatever lies beyond the grid; unresolved otherwise, with the "optimum at the grid
edge" text when Peri-LN's best dt is the grid's smallest or largest.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats  # pylint: disable=g-import-not-at-top

NAME = "residual_step"
CLAIM = "Peri-LN is best at residual step dt = 0.1"
PAPER_NUMBER = "best: Peri-LN, dt = 0.1 (Stability paper)"
# The stated peak LR of every run: set it from the norm zoo's tuned LR for Peri-LN.
LR = {"judge": "4e-3", "paper": "6e-4"}
DTS = "1,0.5,0.2,0.1,0.05,0.02,0.01"
CLAIMED_DT = 0.1
SCALES = {
    "judge": claims.Scale("configs/judge.py", "", "0,1,2",
                          "judge scale: tiny model (4 blocks x 128, untied head), "
                          "character-level tinyshakespeare, 2000 steps x 16 x 128 tokens, "
                          "cosine to 0.1x (configs/judge.py); one stated LR for every cell."),
    "paper": claims.Scale("configs/gpt2.py", "124m," + claims.steps_overrides(20000), "0,1,2",
                          "GPT-2 124M on OpenWebText, 20k steps x 480 x 1024 tokens "
                          "(configs/gpt2.py); one stated LR."),
}
CURVES = (("train", "loss"), ("eval", "loss"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("peri",))
  parser.add_argument("--dts", default=DTS)
  parser.add_argument("--lr", default=None, help="peak LR of every run; default LR[scale]")


def grid(args, scale):
  del scale
  args.lr = args.lr or LR[args.scale]
  dts = ["1", "0.1"] if args.quick else args.dts.split(",")
  steps = claims.steps_overrides(150) if args.quick else ""
  return [claims.variant(f"{name}/dt{dt}", claims.join(overrides, f"dt={dt},lr={args.lr}",
                                                       steps), variant=name, dt=float(dt))
          for name, overrides in claims.variant_list(args) for dt in dts]


def dt_optimum(cells, name):
  """Optimum over dt of the placement's mean final validation loss (NaN when any seed's is
  not finite, so such a cell never wins)."""
  dts = sorted(dt for (n, dt) in cells if n == name)
  return claims.grid_optimum(dts, [float(np.mean(claims.values(cells[(name, dt)],
                                                               "final_eval_loss")))
                                   for dt in dts])


def verdict_of(rows):
  """(holds, {dt: Difference of dt=0.1 - dt}, Peri-LN's Optimum): the rule of the docstring."""
  cells = claims.group(rows, "variant", "dt")
  if ("peri", CLAIMED_DT) not in cells:
    return None, {}, None
  optimum = dt_optimum(cells, "peri")
  target = stats.by_seed(cells[("peri", CLAIMED_DT)], "final_eval_loss")
  diffs = {dt: stats.difference(target, stats.by_seed(runs, "final_eval_loss"))
           for (name, dt), runs in sorted(cells.items()) if name == "peri" and dt != CLAIMED_DT}
  if not diffs:
    return None, diffs, optimum
  if any(o == "higher" for o in stats.outcomes(diffs).values()):
    return False, diffs, optimum
  if (optimum.x == CLAIMED_DT and not optimum.at_edge
      and all(d.outcome == "lower" for d in diffs.values())):
    return True, diffs, optimum
  return None, diffs, optimum


def summarize(rows, curves, config):
  del curves
  cells = claims.group(rows, "variant", "dt")
  table = ["| variant | dt | seeds | final validation loss |", "|---|---|---|---|"]
  for (name, dt), runs in sorted(cells.items()):
    table.append(f"| {name} | {dt:g} | {len(runs)} | {claims.cell(runs, 'final_eval_loss')} |")
  optima = {name: dt_optimum(cells, name) for name in dict.fromkeys(n for n, _ in cells)}
  table += ["", "Best dt (mean over the seeds): " + "; ".join(
      f"{name}: {o.describe('dt')}" for name, o in optima.items()) + "."]
  holds, diffs, optimum = verdict_of(rows)
  lr = config["args"].get("lr")
  result = (f"at lr {lr}, Peri-LN final validation loss at dt=0.1 - at dt: " if diffs
            else "Peri-LN at dt=0.1 and another dt not both run; ")
  result += "; ".join(f"{dt:g} {d.describe()}" for dt, d in diffs.items()) + "."
  edge = claims.at_edge({"peri": optimum}, "dt") if optimum is not None else None
  if edge and holds is False:  # a dt below 0.1 already: more beyond the grid changes nothing
    result += (f" Peri-LN: {optimum.describe('dt')}; a dt already below 0.1 refutes the claim "
               "whatever lies beyond the grid.")
  elif edge:
    result += " " + edge + "."

  def draw(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((name,), runs) in enumerate(claims.group(rows, "variant").items()):
      dts, means, stds = claims.curve_over(runs, "dt", "final_eval_loss")
      axes.errorbar(dts, means, yerr=stds, marker="o", capsize=3, color=f"C{i}", label=name)
    axes.axvline(CLAIMED_DT, color="grey", ls=":", lw=0.8, label="claimed dt 0.1")
    axes.set_xscale("log")
    axes.set_xlabel("residual step dt (dimensionless)")
    axes.set_ylabel("final validation loss (nats/token)")
    axes.set_title(f"final loss vs residual step at lr {lr} (mean +- std over seeds)",
                   fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result, {"loss_vs_dt.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
