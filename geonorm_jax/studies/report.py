"""Side-by-side comparison of finished runs: a loss-curve plot and a summary table; and one
run's instability mechanisms over training (`plot_mechanisms`).

Everything is read back from each run's files (metrics.jsonl, and summary.json when the
trainer wrote one), never passed in by hand, so a table can always be regenerated from
the run folders alone.
"""
import csv
import math
import os

import numpy as np

from geonorm_jax.training import metrics

PLOT_FILENAME = "loss_curves.png"
MECHANISMS_FILENAME = "mechanisms.png"
TABLE_FILENAME = "summary.md"
CSV_FILENAME = "summary.csv"

COLUMNS = ("placement", "final step", "final train loss", "final eval loss", "tokens/s",
           "wall time (s)")


def _last(values):
  return float(values[-1]) if len(values) else float("nan")


def run_row(name, run_dir):
  """One table row for a run folder; a number the run never logged is NaN."""
  train_steps, train_loss = metrics.read_scalar_series(run_dir, "loss", split="train")
  _, eval_loss = metrics.read_scalar_series(run_dir, "loss", split="eval")
  _, logged_tokens_per_s = metrics.read_scalar_series(run_dir, "tokens_per_s", split="train")
  summary = metrics.read_summary(run_dir)
  tokens_per_s = summary.get("tokens_per_s", _last(logged_tokens_per_s))
  return {
      "placement": name,
      "final step": int(train_steps[-1]) if len(train_steps) else 0,
      "final train loss": _last(train_loss),
      "final eval loss": _last(eval_loss),
      "tokens/s": float(tokens_per_s),
      # Only the trainer knows its wall time (the last session's, after a resume).
      "wall time (s)": float(summary.get("wall_s", float("nan"))),
  }


def _format(value, column):
  if isinstance(value, str):
    return value
  if isinstance(value, float) and not math.isfinite(value):
    return "n/a"
  if column in ("final train loss", "final eval loss"):
    return f"{value:.4f}"
  if column == "tokens/s":
    return f"{value:,.0f}"
  if column == "wall time (s)":
    return f"{value:.1f}"
  return str(value)


def markdown_table(rows, columns=COLUMNS):
  """A markdown table of dict rows; the comparison's own columns get their number formats."""
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(_format(row[c], c) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def plot_loss_curves(run_dirs, path):
  """Train (left) and eval (right) loss against step, one line per run."""
  plt = _pyplot()
  figure, (train_axes, eval_axes) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for index, (name, run_dir) in enumerate(run_dirs.items()):
    color = f"C{index}"
    steps, values = metrics.read_scalar_series(run_dir, "loss", split="train")
    train_axes.plot(steps, values, color=color, label=name)
    steps, values = metrics.read_scalar_series(run_dir, "loss", split="eval")
    eval_axes.plot(steps, values, "o-", color=color, label=name)
  for axes, title in ((train_axes, "train loss"), (eval_axes, "eval loss")):
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    axes.legend()
  train_axes.set_ylabel("cross-entropy (nats / token)")
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # files only: works headless and never opens a window
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def is_run_dir(path):
  """Whether `path` is a training run's folder (it has the trainer's metrics.jsonl)."""
  return os.path.exists(os.path.join(path, metrics.METRICS_FILENAME))


def plot_mechanisms(run_dir, path=None):
  """RUN/mechanisms.png (or `path`): the instability mechanisms over the steps of one run,
  as draw_mechanisms draws them. Returns the path written."""
  path = path or os.path.join(run_dir, MECHANISMS_FILENAME)
  plt = _pyplot()
  figure = plt.figure(figsize=(20, 4.2))
  try:
    draw_mechanisms(figure, run_dir)  # a run without them is refused before anything is saved
    figure.tight_layout()
    figure.savefig(path, dpi=120)
  finally:
    plt.close(figure)
  return path


def _series(records_by_step, key):
  """(steps, values) of one scalar of {step: record}, for the steps that logged it."""
  steps = [step for step in sorted(records_by_step) if key in records_by_step[step]]
  return steps, [float(records_by_step[step][key]) for step in steps]


def draw_mechanisms(figure, run_dir):
  """Four panels from the `layers` split of RUN/metrics.jsonl (train.make_stream_stats, every
  train.layer_stats_every steps): per layer the max attention logit (attention-logit growth,
  which QK-norm bounds) and the attention entropy; the output logits' mean log Z and max logit
  (output-logit divergence, which z-loss pulls back); per norm site the input RMS, log scale
  (what the norm divides by: a site whose input grows by orders of magnitude is where the
  stream or a sublayer blows up). A record at step t measures the parameters after t updates,
  on the batch of step t + 1, so a logged spike at step s is marked at t = s - 1 (dotted red).
  A run that never logged them (train.layer_stats_every=0, or older than these statistics) is
  refused by name. Returns the four axes."""
  logit_steps, layers, logit_max = metrics.read_layer_series(run_dir, "attn_logit_max")
  if not len(logit_steps):
    raise ValueError(f"{os.path.join(run_dir, metrics.METRICS_FILENAME)} has no "
                     "attn_logit_max/layer_XX in its `layers` split: train with "
                     "train.layer_stats_every > 0 to log the mechanisms")
  records = metrics.read_metrics(run_dir)  # once, for every scalar below
  # A step logged twice (a resumed run): the later line's value of each key wins, as in
  # metrics.read_scalar_series.
  layer_records = {}
  for record in records:
    if record["split"] == "layers":
      layer_records.setdefault(int(record["step"]), {}).update(record)
  entropy_steps, entropy_layers, entropy = metrics.read_layer_series(run_dir, "attn_entropy")
  logit_axes, entropy_axes, output_axes, norm_axes = figure.subplots(1, 4)
  for column, layer in enumerate(layers):
    logit_axes.plot(logit_steps, logit_max[:, column], color=f"C{column % 10}",
                    label=f"layer {layer}")
  for column, layer in enumerate(entropy_layers):
    entropy_axes.plot(entropy_steps, entropy[:, column], color=f"C{column % 10}",
                      label=f"layer {layer}")
  for name, label, style in (("logits/log_z_mean", "mean log Z", "-"),
                             ("logits/max", "max logit", "--")):
    output_axes.plot(*_series(layer_records, name), style, color="k", label=label)
  prefix = "norm_input_rms/"
  sites = sorted({key for record in layer_records.values() for key in record
                  if key.startswith(prefix)})
  for index, key in enumerate(sites):
    steps, values = _series(layer_records, key)
    norm_axes.plot(steps, values, color=f"C{index % 10}", ls=("-", "--", ":")[index // 10 % 3],
                   label=key[len(prefix):])
  if sites:
    norm_axes.set_yscale("log")
  spikes = sorted({int(r["step"]) for r in records if r["split"] == "spikes"})
  panels = ((logit_axes, "max attention logit (before softmax)"),
            (entropy_axes, "attention entropy (nats, mean over rows)"),
            (output_axes, "output logits"), (norm_axes, "norm input RMS per site"))
  for axes, title in panels:
    for index, step in enumerate(spikes):
      axes.axvline(step - 1, color="r", ls=":", lw=0.8, label="spike" if index == 0 else None)
    axes.set_title(title)
    axes.set_xlabel("step t (the parameters after t updates)")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
      axes.legend(fontsize=7, ncol=2)
    if axes is not norm_axes:
      axes.ticklabel_format(axis="y", useOffset=False)
  figure.suptitle(f"instability mechanisms: {os.path.basename(os.path.normpath(run_dir))}"
                  f" ({len(spikes)} logged spikes)")
  return logit_axes, entropy_axes, output_axes, norm_axes


def compare_runs(run_dirs, out_dir, title="Comparison"):
  """Writes out_dir/loss_curves.png, summary.md and summary.csv; returns the table rows.

  Args:
    run_dirs: display name -> run folder, in the order the table should list them.
    out_dir: where the plot and tables go (created if needed).
    title: the heading of summary.md.
  """
  os.makedirs(out_dir, exist_ok=True)
  rows = [run_row(name, run_dir) for name, run_dir in run_dirs.items()]
  plot_loss_curves(run_dirs, os.path.join(out_dir, PLOT_FILENAME))
  sources = "\n".join(f"- {name}: `{run_dir}`" for name, run_dir in run_dirs.items())
  with open(os.path.join(out_dir, TABLE_FILENAME), "w", encoding="utf-8") as f:
    f.write(f"# {title}\n\n{markdown_table(rows)}\n"
            f"Read from each run's metrics.jsonl and summary.json:\n{sources}\n\n"
            f"![loss curves]({PLOT_FILENAME})\n")
  with open(os.path.join(out_dir, CSV_FILENAME), "w", encoding="utf-8", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
  return rows


def best_run(rows):
  """The row with the lowest final eval loss (a run without eval loses to any with)."""
  def key(row):
    loss = row["final eval loss"]
    return loss if np.isfinite(loss) else float("inf")
  return min(rows, key=key)


def _parse_cell(text):
  if text == "":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def read_results_csv(path):
  """The rows of an experiment's results.csv (sweep.write_csv): integers and floats parsed
  (`nan` included), empty cells None (e.g. no collapse_step), any other text kept as is."""
  with open(path, encoding="utf-8", newline="") as f:
    return [{key: _parse_cell(value) for key, value in row.items()}
            for row in csv.DictReader(f)]
