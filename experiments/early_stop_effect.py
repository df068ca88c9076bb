"""What an early stop did to the LR sensitivity: the same LR-grid runs read once as they
stopped under train.give_up_steps and once trained to the end.

  python experiments/early_stop_effect.py [--stopped=results/early_stop/with_stop.csv]
      [--to_end=results/lr_sensitivity] [--out=results/early_stop]

--stopped is the results.csv of an lr_sensitivity sweep that ran with the stop (a run whose
train loss stayed above its first value for give_up_steps steps in a row ended there, its
gave_up_step set); --to_end is an lr_sensitivity results folder that holds the same runs
trained to the end. The committed with_stop.csv is results/lr_sensitivity/results.csv as the
sweep with train.give_up_steps=100 wrote it (554 runs, 47 of them stopped), before the grid
dropped the stop. Trains nothing.

Reads, over the runs both hold (same names):
- the share of the training steps the stop saved (steps to the end minus steps run, over all
  the shared runs' steps to the end; steps, not seconds: a narrow run's step costs less);
- per stopped run, its final loss trained to the end against L0, the seed's loss at
  initialisation (lr_sensitivity's cap: the first train loss of the grid's lowest-LR run, the
  same in both readings): the stop counted each at L0, so one that ends below L0 was counted
  too high;
- S per (variant, width) over the grids complete in both, with the stop and to the end, and
  lr_sensitivity's READINGS (paired differences over seeds) in both readings.

Writes OUT/{results.csv (one row per stopped run), table.md}.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, results_folder, sweep  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
lr_sensitivity = claims.load_experiment("lr_sensitivity")


def stopped(row):
  return row.get("gave_up_step") not in (None, "")


def per_run(stop_rows, end_rows, grids):
  """Rows {name, variant, width, lr, seed, gave_up_step, l0, final_eval_loss (to the end),
  ends_below_l0} of the runs that stopped, L0 from the trained-to-the-end grids."""
  out = []
  for name, row in sorted(stop_rows.items()):
    if not stopped(row):
      continue
    end = end_rows[name]
    l0 = grids[(row["variant"], row["width"], row["seed"])][2]
    loss = float(end["final_eval_loss"])
    out.append(dict(name=name, variant=row["variant"], width=row["width"], lr=row["lr"],
                    seed=row["seed"], gave_up_step=row["gave_up_step"], l0=l0,
                    final_eval_loss=loss, ends_below_l0=bool(loss < l0)))
  return out


def steps_saved(stop_rows, end_rows):
  """The share of the shared runs' steps to the end that the stop did not run."""
  total = sum(end_rows[n]["steps"] for n in stop_rows)
  return (total - sum(stop_rows[n]["steps"] for n in stop_rows)) / total


def table(runs, saved, shared, cells_stop, cells_end, widths):
  below = [r for r in runs if r["ends_below_l0"]]
  above = [r for r in runs if not r["ends_below_l0"]]
  lines = [f"{len(shared)} runs in both readings, {len(runs)} of them stopped; the stop saved "
           f"{saved:.1%} of their training steps.",
           f"Trained to the end, {len(below)} of the {len(runs)} stopped runs end below their "
           "L0 (the stop had counted them at L0)"
           + (f", at {min(r['final_eval_loss'] for r in below):.2f} to "
              f"{max(r['final_eval_loss'] for r in below):.2f}" if below else "")
           + f"; {len(above)} end at or above it"
           + (": " + ", ".join(f"{r['name']} ({r['final_eval_loss']:.2f})" for r in above)
              if above else "") + ".", "",
           "| variant | width | stopped runs | S with the stop | S trained to the end |",
           "|---|---|---|---|---|"]
  counts = {}
  for r in runs:
    counts[(r["variant"], r["width"])] = counts.get((r["variant"], r["width"]), 0) + 1
  for key in sorted(cells_end, key=lambda k: (k[1], k[0])):
    if key not in cells_stop:
      continue
    s_stop = [v[0] for v in cells_stop[key].values()]
    s_end = [v[0] for v in cells_end[key].values()]
    lines.append(f"| {key[0]} | {key[1]} | {counts.get(key, 0)} | {claims.fmt(s_stop)} | "
                 f"{claims.fmt(s_end)} |")
  lines += ["", "S: lr_sensitivity's (mean over the grid of the final loss capped at L0, minus "
            "the grid's best), mean +- sd over seeds, over the grids complete in both readings."]
  for title, cells in (("With the stop", cells_stop), ("Trained to the end", cells_end)):
    read = [line for line in lr_sensitivity.readings(cells, widths) if "the claim read" in line]
    if read:
      lines += ["", f"{title}:"] + read
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stopped", default="results/early_stop/with_stop.csv")
  parser.add_argument("--to_end", default="results/lr_sensitivity")
  parser.add_argument("--out", default="results/early_stop")
  args = parser.parse_args(argv)
  if not os.path.exists(args.stopped):
    raise SystemExit(f"--stopped={args.stopped}: no such file")
  config, end_list, curves = lr_sensitivity.read_folder(args.to_end)
  stop_rows = {r["name"]: r for r in results_folder.read_csv(args.stopped)}
  end_rows = {r["name"]: r for r in end_list}
  shared = sorted(set(stop_rows) & set(end_rows))
  if not shared:
    raise SystemExit(f"--stopped={args.stopped} and --to_end={args.to_end} share no run")
  if any(stopped(end_rows[n]) for n in shared):
    raise SystemExit(f"--to_end={args.to_end}: some of its runs stopped early too; it must hold "
                     "the runs trained to the end")
  stop_rows = {n: stop_rows[n] for n in shared}
  widths, lrs = lr_sensitivity.swept(config)
  by_grid_end = lr_sensitivity.by_grid([end_rows[n] for n in shared], curves)
  grids_end, _ = lr_sensitivity.complete(by_grid_end, lrs)
  grids_stop, _ = lr_sensitivity.complete(
      lr_sensitivity.by_grid(list(stop_rows.values()), curves), lrs)
  runs = per_run(stop_rows, end_rows, by_grid_end)
  lines = table(runs, steps_saved(stop_rows, end_rows), shared,
                lr_sensitivity.cells_of(grids_stop), lr_sensitivity.cells_of(grids_end), widths)
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), runs)
  command = ("python experiments/early_stop_effect.py " + " ".join(
      f"--{k}={os.path.relpath(os.path.abspath(v), REPO)}" for k, v in vars(args).items()))
  text = "\n".join(["# early_stop_effect: the LR sensitivity with and without the early stop",
                    "", f"Written by `{command}`.", ""] + lines)
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
