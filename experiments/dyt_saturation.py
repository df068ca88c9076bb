"""DyT's unigram plateau read against its saturation: does a DyT run sit on the plateau exactly
while its final DyT is saturated?

  python experiments/dyt_saturation.py [--runs=GLOB,GLOB] [--out=results/dyt_saturation]

DyT (`gamma tanh(alpha x) + beta`) is not scale-invariant as a norm is: once the stream grows,
tanh saturates, passes little more than signs, and its derivative, hence the gradient through
it, is near 0. lr_sensitivity's DyT grids (d = 32) have runs that sit on the unigram plateau
(eval loss ~3.357, the loss of predicting character frequencies) for hundreds of steps or to
the end, at LRs scattered between runs that learn. Every DyT run logs, with the per-layer
statistics, the fraction of units of each DyT with |tanh(alpha x)| > 0.99
(`collapse/tanh_saturated_final` for the DyT before the head). This reads, at every
evaluation step where both are logged, whether the final DyT is saturated (that fraction above
--saturated) and whether the run is on the plateau (eval loss above --plateau_loss), and counts
the four cases per alpha_0 of the final DyT (and per warmup, where the runs' warmups differ).
Trains nothing; reads each run folder's metrics.jsonl and config.json (runs of other
placements are skipped).

The default globs are lr_sensitivity's d = 32 DyT runs under its default root (the LR-grid
runs of the selection seed and the sweep's of the other seeds); a sweep started with --root=R
names R instead of runs/claims.
Writes OUT/{results.csv (run, alpha_0 of the final DyT, lr, seed, step, eval loss, saturated
fraction, the RMS of the final DyT's input and of the stream entering block 1, the two
readings), table.md (the counts; per LR and alpha_0 the final DyT's input RMS at --early_step:
does the stream's growth follow alpha_0?; and the embedding's share of it there: is the growth
the embedding's or the blocks'?)}.
"""
import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.nn import placements  # pylint: disable=g-import-not-at-top
from geonorm_jax.studies import sweep  # pylint: disable=g-import-not-at-top
from geonorm_jax.training import metrics  # pylint: disable=g-import-not-at-top

KEY = "collapse/tanh_saturated_final"
INPUT_RMS = "norm_input_rms/final_norm"  # the RMS of what enters the final DyT
EMBED_RMS = "residual_rms/layer_00"  # the stream entering block 1: the scaled embedding
DEFAULT_RUNS = "runs/claims/lr_grid/d32/dyt*/lr*/seed*,runs/claims/d32/dyt*/lr*/seed*"


def run_readings(workdir, saturated, plateau_loss):
  """Rows of one run: at each eval step with the final DyT's saturation logged, both readings
  (none for a run that is not DyT)."""
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  if config["model"]["placement"] != "dyt":
    return []
  by_step = {}
  for record in metrics.read_metrics(workdir):
    if record.get("split") == "layers" and KEY in record:
      by_step.setdefault(record["step"], {}).update(
          saturated_fraction=record[KEY], input_rms=record.get(INPUT_RMS, float("nan")),
          embed_rms=record.get(EMBED_RMS, float("nan")))
    elif record.get("split") == "eval" and "loss" in record:
      by_step.setdefault(record["step"], {})["eval_loss"] = record["loss"]
  model = config["model"]  # dyt_alpha_final 0: the paper's table's value, as the model resolves it
  alpha = model["dyt_alpha_final"] or placements.dyt_authors_alphas(model["d_model"],
                                                                    model["num_layers"])[2]
  return [{"run": workdir, "alpha_0": alpha, "warmup_steps": config["train"]["warmup_steps"],
           "lr": config["train"]["lr"], "seed": config["seed"], "step": step, **values,
           "saturated": values["saturated_fraction"] > saturated,
           "on_plateau": values["eval_loss"] > plateau_loss}
          for step, values in sorted(by_step.items())
          if "eval_loss" in values and "saturated_fraction" in values]


def settings(rows):
  """Each row's group: its alpha_0, and its warmup where the runs' warmups differ (another way
  to hold the stream's early growth back), in table order."""
  by_warmup = len({row["warmup_steps"] for row in rows}) > 1
  def name(row):
    return f"{row['alpha_0']:g}" + (f", warmup {row['warmup_steps']}" if by_warmup else "")
  order = sorted({(row["alpha_0"], row["warmup_steps"], name(row)) for row in rows})
  return name, [label for _, _, label in order]


def table(rows, args):
  name, order = settings(rows)
  counts = {}  # setting (and "all") -> {(saturated, on the plateau): readings}
  for row in rows:
    for group in (name(row), "all"):
      cell = counts.setdefault(group, {})
      key = (row["saturated"], row["on_plateau"])
      cell[key] = cell.get(key, 0) + 1
  lines = [f"Written by `python experiments/dyt_saturation.py --runs={args.runs} "
           f"--saturated={args.saturated} --plateau_loss={args.plateau_loss}` "
           f"({len({r['run'] for r in rows})} DyT runs, {len(rows)} readings: one per run and "
           "evaluation step with the final DyT's saturation logged).", "",
           f"Saturated: more than {args.saturated:g} of the final DyT's units at |tanh| > 0.99. "
           f"On the plateau: eval loss above {args.plateau_loss:g} (the unigram loss is about "
           "3.357; a run still coming down from its initial loss counts too). alpha_0: the run's, "
           "or the paper's table's value for its width where the run left it to the table (1 "
           "below width 1024).", "",
           "| alpha_0 of the final DyT | saturated, on the plateau | neither | saturated only "
           "| on the plateau only | agree |", "|---|---|---|---|---|---|"]
  for group in order + ["all"]:
    cell = counts[group]
    both, neither = cell.get((True, True), 0), cell.get((False, False), 0)
    total = sum(cell.values())
    lines.append(f"| {group} | {both} | {neither} | {cell.get((True, False), 0)} | "
                 f"{cell.get((False, True), 0)} | {both + neither} of {total} |")
  return "\n".join(lines + [""] + early_growth(rows, args.early_step, name, order) + [""] +
                   embedding_share(rows, args.early_step, name, order)) + "\n"


def _lr_table(rows, step, name, order, header, text):
  """Table lines: one row per LR, one column per setting; a cell is text(its runs' rows at
  `step`, one per seed) under the column title header(setting)."""
  cells = {}  # (lr, setting) -> rows over seeds
  for row in rows:
    if row["step"] == step:
      cells.setdefault((row["lr"], name(row)), []).append(row)
  groups = [group for group in order if any(g == group for _, g in cells)]
  lines = ["| lr | " + " | ".join(header(g) for g in groups) + " |", "|---|" + "---|" * len(groups)]
  for lr in sorted({lr for lr, _ in cells}):
    row = [text(cells[lr, g]) if (lr, g) in cells else "-" for g in groups]
    lines.append(f"| {lr:g} | " + " | ".join(row) + " |")
  return lines


def early_growth(rows, step, name, order):
  """Table lines: per LR and setting, the final DyT's input RMS at one early evaluation step
  (median over seeds). If the stream grew by itself, the RMS would not depend on alpha_0; if
  training drove the final DyT to one degree of saturation, alpha_0 x RMS would not."""
  def text(cell):
    median = statistics.median(r["input_rms"] for r in cell)
    return (f"{median:.3g}, {cell[0]['alpha_0'] * median:.3g}, "
            f"{sum(r['saturated'] for r in cell)} of {len(cell)}")
  return ([f"The final DyT's input RMS at step {step}, median over seeds (alpha is learnable: "
           "alpha_0 x RMS is the argument's scale before alpha moves), and how many of the "
           "seeds' runs are saturated there:", ""] +
          _lr_table(rows, step, name, order,
                    lambda g: f"alpha_0 {g}: RMS, alpha_0 x RMS, saturated", text))


def embedding_share(rows, step, name, order):
  """Table lines: per LR and setting, at the same step, the RMS of the stream entering block 1
  (the embedding times its learnable scale, sqrt(d) at init) and its share of the final DyT's
  input RMS (medians over seeds). A small share puts the growth in the blocks' updates, where a
  smaller embedding scale does not act directly."""
  def text(cell):
    embed = statistics.median(r["embed_rms"] for r in cell)
    return f"{embed:.3g}, {embed / statistics.median(r['input_rms'] for r in cell):.2f}"
  return ([f"The stream entering block 1 (the scaled embedding) at step {step}: its RMS and "
           "that RMS over the final DyT's input RMS, medians over seeds:", ""] +
          _lr_table(rows, step, name, order, lambda g: f"alpha_0 {g}: RMS, share", text))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma list of run-folder globs")
  parser.add_argument("--saturated", type=float, default=0.95)
  parser.add_argument("--plateau_loss", type=float, default=3.3)
  parser.add_argument("--early_step", type=int, default=250,
                      help="the evaluation step the input-RMS table reads")
  parser.add_argument("--out", default="results/dyt_saturation")
  args = parser.parse_args(argv)
  workdirs = sorted(w for pattern in args.runs.split(",") for w in glob.glob(pattern)
                    if os.path.exists(os.path.join(w, "config.json")))
  rows = [row for w in workdirs for row in run_readings(w, args.saturated, args.plateau_loss)]
  if not rows:
    raise SystemExit(f"--runs: no DyT run with {KEY} and eval losses under {args.runs}")
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  text = table(rows, args)
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
