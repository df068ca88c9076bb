"""Divergence with and without weight decay over the LRs where lr_sensitivity's curves rise:
the divergence_trials claim (Pre-LN diverges in 1/5 runs with weight decay and 3/5 without,
Peri-LN in 0/5) read on LR grids instead of at one aggressive LR.

  python experiments/divergence_by_lr.py [--with_wd=results/lr_sensitivity]
      [--without_wd=results/lr_sensitivity_wd0] [--out=results/divergence_by_lr]

Reads two lr_sensitivity results folders of the same recipe, one trained with the recipe's
weight decay and one with `--extra=weight_decay=0` (it refuses a pair that is not), and
trains nothing. The runs compared are those of the second folder's grid (its --lrs: the LRs
past the optimum, where the sensitivity curves rise) that the first folder also holds, per
(variant, width, LR, seed); runs of one seed share the initial model and the data order, so
the two weight decays are paired.

A run diverged when it ended no better than the model at initialisation: a final validation
loss at or above L0, or none (lr_sensitivity.lowest_diverged's reading; a record of a run
that gave up under train.give_up_steps, as lr_sensitivity's grids once did, stopped above L0
and counts as diverged, though trained on it might have come back below). L0 is the
seed's initial loss, read in the with-weight-decay folder: the first logged train loss of its
lowest-LR run (claims.grid_initial_loss), the run that moved least from the shared initial
model, which a grid cut to its high LRs does not have; weight decay does not act before the
first update, so one L0 serves both. Each seed counts once per LR; a seed's runs at several LRs
are not independent trials, so the table counts per LR and gives, per seed, the lowest LR
that diverged, and tests nothing pooled.

Writes OUT/{results.csv (one row per run: variant, width, lr, seed, weight decay, final loss,
L0, diverged), table.md}.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats, sweep  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM = ("Pre-LN diverges in 1/5 runs with weight decay and 3/5 without, Peri-LN in 0/5 (the "
         "divergence_trials claim), read over the LRs where lr_sensitivity's curves rise")
lr_sensitivity = claims.load_experiment("lr_sensitivity")


def weight_decay(config, folder):
  """The one weight decay that the folder's runs trained with (an error naming the folder if
  they differ or it has no runs)."""
  decays = {sweep.load_config(config["config_file"], overrides).train.weight_decay
            for overrides in config.get("runs", {}).values()}
  if len(decays) != 1:
    raise SystemExit(f"{folder}: its runs train with weight decays {sorted(decays)}, not one")
  return decays.pop()


def diverged(loss, l0):
  return not loss < l0  # a NaN or missing final loss counts as diverged


def compare(with_wd, without_wd):
  """Rows {variant, width, lr, seed, weight_decay, final_eval_loss, l0, diverged} of the runs
  in both folders at the without-weight-decay folder's LRs, L0 from the with folder's grid."""
  (config_a, rows_a, curves_a), (config_b, rows_b, curves_b) = with_wd, without_wd
  grids = lr_sensitivity.by_grid(rows_a, curves_a)
  by_run = {(r["variant"], r["width"], r["lr"], r["seed"]): r for r in rows_a}
  out = []
  for row in sorted(rows_b, key=lambda r: (r["variant"], r["width"], r["lr"], r["seed"])):
    key = (row["variant"], row["width"], row["lr"], row["seed"])
    grid = grids.get((row["variant"], row["width"], row["seed"]))
    if key not in by_run or grid is None or not math.isfinite(grid[2]):
      continue
    l0 = grid[2]
    for config, r in ((config_a, by_run[key]), (config_b, row)):
      loss = r["final_eval_loss"]
      loss = float("nan") if loss is None else float(loss)
      out.append(dict(variant=key[0], width=key[1], lr=key[2], seed=key[3],
                      weight_decay=config["weight_decay"], final_eval_loss=loss, l0=l0,
                      diverged=diverged(loss, l0)))
  return out


def table(rows, decays):
  """table.md's lines: per (variant, width, LR) the diverged counts and the paired loss
  difference; per (variant, width) each seed's lowest diverging LR under each weight decay."""
  wd_a, wd_b = decays
  cells = {}
  for r in rows:
    cells.setdefault((r["variant"], r["width"], r["lr"]), {}).setdefault(
        r["weight_decay"], {})[r["seed"]] = r
  lines = [f"| variant | width | lr | diverged, wd {wd_a:g} | diverged, wd {wd_b:g} | "
           f"final loss, wd {wd_a:g} | final loss, wd {wd_b:g} | wd {wd_b:g} - wd {wd_a:g} |",
           "|---|---|---|---|---|---|---|---|"]
  lowest = {}
  for (name, width, lr), by_wd in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0],
                                                                        kv[0][2])):
    a, b = by_wd.get(wd_a, {}), by_wd.get(wd_b, {})

    def count(runs):
      return f"{sum(r['diverged'] for r in runs.values())}/{len(runs)}"

    def losses(runs):
      return {s: r["final_eval_loss"] for s, r in runs.items()}

    d = stats.difference(losses(b), losses(a))
    lines.append(f"| {name} | {width} | {lr:g} | {count(a)} | {count(b)} | "
                 f"{claims.fmt(list(losses(a).values()))} | "
                 f"{claims.fmt(list(losses(b).values()))} | {d.describe()} |")
    for wd, runs in ((wd_a, a), (wd_b, b)):
      for seed, r in runs.items():  # cells run in increasing LR: the first diverged is lowest
        seeds = lowest.setdefault((name, width), {}).setdefault(wd, {})
        if seeds.get(seed) is None:
          seeds[seed] = lr if r["diverged"] else None
  lines += ["", "Per seed (in increasing seed order), the lowest LR of the grid whose run "
            "diverged (-: none did):"]
  for (name, width), by_wd in sorted(lowest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    lines.append(f"- {name} d={width}: " + "; ".join(
        f"wd {wd:g}: " + ", ".join(f"{by_wd[wd][s]:g}" if by_wd[wd][s] else "-"
                                   for s in sorted(by_wd[wd]))
        for wd in decays if wd in by_wd))
  lines += ["", "A run diverged when its final validation loss is at or above L0, the seed's "
            "loss at initialisation (the with-weight-decay grid's lowest-LR run's first train "
            "loss), or it has none. Final losses: mean +- sd over seeds, uncapped; the last "
            "column is the paired difference over seeds (95% t interval)."]
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--with_wd", default="results/lr_sensitivity")
  parser.add_argument("--without_wd", default="results/lr_sensitivity_wd0")
  parser.add_argument("--out", default="results/divergence_by_lr")
  args = parser.parse_args(argv)
  folders = []
  for folder in (args.with_wd, args.without_wd):
    config, rows, curves = lr_sensitivity.read_folder(folder)
    config["weight_decay"] = weight_decay(config, folder)
    folders.append((config, rows, curves))
  decays = tuple(f[0]["weight_decay"] for f in folders)
  if decays[1] != 0 or decays[0] == 0:
    raise SystemExit(f"--with_wd={args.with_wd} trains with weight decay {decays[0]:g} and "
                     f"--without_wd={args.without_wd} with {decays[1]:g}: the second must be 0, "
                     "the first not")
  rows = compare(*folders)
  if not rows:
    raise SystemExit(f"{args.without_wd} and {args.with_wd} share no finished run")
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  command = ("python experiments/divergence_by_lr.py " + " ".join(
      f"--{k}={os.path.relpath(os.path.abspath(v), REPO)}" for k, v in vars(args).items()))
  header = [f"# divergence_by_lr: {CLAIM}", "",
            f"Written by `{command}` from the two folders' results.csv and curves.csv.", ""]
  text = "\n".join(header + table(rows, decays))
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
