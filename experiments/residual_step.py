"""Residual step: is Peri-LN best at dt = 0.1?

  python experiments/residual_step.py [--scale=cpu|paper] [--seeds=0,1] [--quick]
      [--variants=pre,peri] [--dts=1,0.5,0.2,0.1,0.05,0.02] [--jobs=N] [--print]

Every sublayer adds dt x its output (model.dt). CPU scale: configs/shakespeare.py cut to 300
steps, 2 placements x 6 dt x 2 seeds, about 18 minutes on a quiet 2-core CPU; --quick: dt in
{1, 0.1}, one seed. Paper scale: configs/gpt2.py:124m, 20k steps. Writes
results/residual_step/{results.csv, curves.csv, table.md, config.json, verdict.json,
loss_vs_dt.png}.
Verdict: reproduced when Peri-LN at dt=0.1 has a lower mean final validation loss than every
other (placement, dt) cell by more than twice the standard error of the difference over seeds
(claims.compare); not reproduced when some other cell is lower by that margin.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "residual_step"
CLAIM = "Peri-LN is best at residual step dt = 0.1"
PAPER_NUMBER = "best: Peri-LN, dt = 0.1 (Stability paper)"
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", claims.steps_overrides(300), "0,1",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 300 steps x 16 x 128 tokens, lr 3e-3."),
    "paper": claims.Scale("configs/gpt2.py", "124m," + claims.steps_overrides(20000), "0,1,2",
                          "GPT-2 124M on OpenWebText, 20k steps x 480 x 1024 tokens, lr 6e-4 "
                          "(configs/gpt2.py)."),
}
CURVES = (("train", "loss"), ("eval", "loss"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "peri"))
  parser.add_argument("--dts", default="1,0.5,0.2,0.1,0.05,0.02")


def grid(args, scale):
  del scale
  dts = ["1", "0.1"] if args.quick else args.dts.split(",")
  return [claims.variant(f"{name}/dt{dt}", claims.join(overrides, f"dt={dt}"), variant=name,
                         dt=float(dt))
          for name, overrides in claims.variant_list(args) for dt in dts]


def summarize(rows, curves, config):
  del curves
  cells = claims.group(rows, "variant", "dt")
  table = ["| variant | dt | seeds | final validation loss |", "|---|---|---|---|"]
  for (name, dt), runs in sorted(cells.items()):
    table.append(f"| {name} | {dt:g} | {len(runs)} | {claims.cell(runs, 'final_eval_loss')} |")
  holds = None
  if ("peri", 0.1) in cells:
    target = claims.values(cells[("peri", 0.1)], "final_eval_loss")
    outcomes = [claims.compare(target, claims.values(runs, "final_eval_loss"))
                for key, runs in cells.items() if key != ("peri", 0.1)]
    if any(o == "higher" for o in outcomes):
      holds = False
    elif outcomes and all(o == "lower" for o in outcomes):
      holds = True
  best = min(cells, key=lambda k: claims.mean_spread(claims.values(cells[k],
                                                                   "final_eval_loss"))[0])
  result = (f"lowest mean final validation loss: {best[0]} at dt={best[1]:g} "
            f"{claims.cell(cells[best], 'final_eval_loss')}"
            + (f"; peri at dt=0.1 {claims.cell(cells[('peri', 0.1)], 'final_eval_loss')}"
               if ("peri", 0.1) in cells else "") + ".")

  def draw(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((name,), runs) in enumerate(claims.group(rows, "variant").items()):
      dts, means, stds = claims.curve_over(runs, "dt", "final_eval_loss")
      axes.errorbar(dts, means, yerr=stds, marker="o", capsize=3, color=f"C{i}", label=name)
    axes.set_xscale("log")
    axes.set_xlabel("residual step dt (dimensionless)")
    axes.set_ylabel("final validation loss (nats/token)")
    axes.set_title("final loss vs residual step (mean +- std over seeds)", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result, {"loss_vs_dt.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
