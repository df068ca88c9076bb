"""Divergence trials: at an aggressive LR, does Pre-LN diverge in some seeds (more often
without weight decay) while Peri-LN never does?

  python experiments/divergence_trials.py [--scale=cpu|paper] [--seeds=0,1,2,3,4] [--quick]
      [--variants=pre,peri] [--weight_decays=0.1,0] [--lr=3e-2] [--jobs=N] [--print]

A run diverged (claims.diverged) when a step's loss or gradient was non-finite (the step is
skipped, train.on_divergence=skip, and counted), or when its train loss, after warmup, rose
above its step-1 value (every step is logged). CPU scale: configs/shakespeare.py cut to 300
steps at lr 3e-2 (10x the recipe's), 2 placements x 2 weight decays x 5 seeds, about 15
minutes on a quiet 2-core CPU; --quick: 100 steps, one seed. Paper scale: configs/gpt2.py:124m
at lr 6e-3 (10x nanoGPT's), 20k steps. Writes results/divergence_trials/{results.csv,
curves.csv, table.md, config.json, verdict.json, loss_curves.png}.
Verdict: reproduced when Peri-LN diverges in no run and Pre-LN in at least one run without
weight decay; not reproduced when Pre-LN never diverges or Peri-LN diverges as often as Pre-LN.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "divergence_trials"
CLAIM = "Pre-LN diverges in 1/5 runs with weight decay and 3/5 without; Peri-LN in 0/5"
PAPER_NUMBER = "Pre-LN 1/5 (wd), 3/5 (no wd); Peri-LN 0/5 (Stability paper)"
LR = {"cpu": "3e-2", "paper": "6e-3"}
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", claims.steps_overrides(300), "0,1,2,3,4",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 300 steps x 16 x 128 tokens."),
    "paper": claims.Scale("configs/gpt2.py", "124m," + claims.steps_overrides(20000),
                          "0,1,2,3,4", "GPT-2 124M on OpenWebText, 20k steps x 480 x 1024 "
                          "tokens (configs/gpt2.py)."),
}
CURVES = (("train", "loss"),)


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "peri"))
  parser.add_argument("--weight_decays", default="0.1,0")
  parser.add_argument("--lr", default=None, help="default 3e-2 (cpu), 6e-3 (paper)")


def grid(args, scale):
  del scale
  args.lr = args.lr or LR[args.scale]
  steps = claims.steps_overrides(100) if args.quick else ""
  return [claims.variant(f"{name}/wd{wd}", claims.join(
      overrides, f"lr={args.lr},weight_decay={wd},log_every=1,on_divergence=skip", steps),
                         variant=name, weight_decay=float(wd))
          for name, overrides in claims.variant_list(args)
          for wd in args.weight_decays.split(",")]


def summarize(rows, curves, config):
  for row in rows:
    row["diverged"] = claims.diverged(row, curves, max(1, row["steps"] // 10))
  cells = claims.group(rows, "variant", "weight_decay")
  table = ["| variant | weight decay | runs diverged | non-finite steps per run | "
           "final train loss |", "|---|---|---|---|---|"]
  for (name, wd), runs in cells.items():
    table.append(f"| {name} | {wd:g} | {sum(r['diverged'] for r in runs)}/{len(runs)} | "
                 f"{claims.cell(runs, 'skipped_steps', 1)} | "
                 f"{claims.cell(runs, 'final_train_loss')} |")
  table += ["", f"lr {config['args']['lr']}. Diverged: a non-finite step, or the train loss "
            "above its step-1 value after warmup."]
  count = lambda name, wd=None: sum(r["diverged"] for (n, w), runs in cells.items()
                                    for r in runs if n == name and (wd is None or w == wd))
  holds = None
  if any(n == "pre" for n, _ in cells) and any(n == "peri" for n, _ in cells):
    if count("peri") == 0 and count("pre", 0.0) > 0:
      holds = True
    elif count("pre") == 0 or count("peri") >= count("pre"):
      holds = False
  result = "diverged: " + ", ".join(f"{n} wd={wd:g} {sum(r['diverged'] for r in runs)}/"
                                    f"{len(runs)}" for (n, wd), runs in cells.items()) + "."
  figures = {"loss_curves.png": lambda fig: claims.plot_curves(
      fig, curves, rows, lambda row: f"{row['variant']}, wd={row['weight_decay']:g}",
      log_y=True, title=f"train loss at lr {config['args']['lr']}, every seed")}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
