"""Files of a Hessian analysis: one JSON and density figure per checkpoint, a table and a
figure over a run's steps, and figures overlaying several runs.

Every figure says what it shows: model, placement, step(s), parameters, tokens and the
estimator settings, so a PNG copied out of its folder still reads on its own.
"""
import csv
import json
import math
import os

import numpy as np

# Columns of spectra.csv, one row per analysed checkpoint; empty where not computed.
COLUMNS = ("step", "tokens_trained", "val_loss", "lambda_1", "lambda_1_bound", "lambda_2",
           "lambda_3", "lambda_min", "trace", "trace_stderr", "lambda_max_precond", "lr",
           "two_over_lr", "adam_threshold")
TABLE = "spectra.csv"
FIGURE = "spectra.png"


def step_json_path(out_dir, step):
  return os.path.join(out_dir, f"step_{step}.json")


def write_json(path, report):
  # Written whole to a temporary name, then renamed: an interrupted analysis never
  # leaves a truncated file that a resumed one would trust.
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, path)


def read_json(path):
  with open(path) as f:
    return json.load(f)


def is_complete(report, settings_dict):
  """Whether a stored report holds every estimate of these settings (resume skips it)."""
  if report.get("settings") != settings_dict:
    return False
  needed = {"top": "lanczos", "density": "density", "trace": "trace", "precond": "precond"}
  return all(needed[e] in report for e in settings_dict["estimates"])


def model_description(config, num_params):
  m = config.model
  return (f"{m.backbone} {m.num_layers}x{m.d_model}, placement {m.placement}, "
          f"{num_params:,} params")


def settings_description(report):
  s = report["settings"]
  parts = [f"{report['num_tokens']:,} val tokens"]
  if "lanczos" in report:
    parts.append(f"Lanczos {s['num_steps']} steps")
  if "density" in report:
    parts.append(f"SLQ {report['density']['num_probes']} probes x {s['num_steps']}, "
                 f"sigma {report['density']['sigma']:.2g}")
  if "trace" in report:
    parts.append(f"trace {report['trace']['num_probes']} probes")
  return ", ".join(parts)


def table_row(report):
  top = report.get("lanczos", {})
  values = top.get("top_eigenvalues", [])
  row = {
      "step": report["step"], "tokens_trained": report["tokens_trained"],
      "val_loss": report.get("val_loss"),
      "lambda_1": values[0] if values else None,
      "lambda_1_bound": top["residual_bounds"][0] if values else None,
      "lambda_2": values[1] if len(values) > 1 else None,
      "lambda_3": values[2] if len(values) > 2 else None,
      "lambda_min": top.get("lambda_min"),
      "trace": report.get("trace", {}).get("estimate"),
      "trace_stderr": report.get("trace", {}).get("stderr"),
      "lambda_max_precond": report.get("precond", {}).get("lambda_max"),
      "lr": report["lr"], "two_over_lr": report["two_over_lr"],
      "adam_threshold": report["adam_threshold"],
  }
  return row


def write_table(path, rows):
  with open(path + ".tmp", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    for row in sorted(rows, key=lambda r: r["step"]):
      writer.writerow({k: "" if row.get(k) is None else row[k] for k in COLUMNS})
  os.replace(path + ".tmp", path)


def read_table(path):
  with open(path) as f:
    return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
            for row in csv.DictReader(f)]


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _density_floor(values):
  positive = values[values > 0]
  # A log axis spans the Gaussian tails down to ~1e-300; 1e-8 of the peak is the
  # range a reader can use (bulk vs outliers) without the plot being all tails.
  return max(float(positive.min()) if positive.size else 1e-12, 1e-8 * float(values.max()))


def plot_density(path, report, title):
  plt = _pyplot()
  grid = np.asarray(report["density"]["grid"])
  values = np.asarray(report["density"]["values"])
  floor = _density_floor(values)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.semilogy(grid, np.maximum(values, floor), lw=1.2)
  ax.set_ylim(bottom=floor)
  if "lanczos" in report:
    top = report["lanczos"]
    for value, label in ((top["top_eigenvalues"][0], "lambda_max"),
                         (top["lambda_min"], "lambda_min")):
      ax.axvline(value, color="gray", ls=":", lw=1)
      ax.annotate(f"{label}={value:.4g}", (value, values.max()), fontsize=8, rotation=90,
                  va="top", ha="right")
  ax.set_xlabel("eigenvalue")
  ax.set_ylabel("density (SLQ)")
  ax.set_title(f"{title}\n{settings_description(report)}", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _series(rows, key):
  steps = [r["step"] for r in rows if r.get(key) is not None]
  return steps, [r[key] for r in rows if r.get(key) is not None]


def plot_over_steps(path, runs, title):
  """runs: [(label, rows of table_row)]; top eigenvalues with 2/lr (and the preconditioned
  lambda_max with the Adam threshold), traces below."""
  plt = _pyplot()
  fig, (ax_eig, ax_trace) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for index, (label, rows) in enumerate(runs):
    rows = sorted(rows, key=lambda r: r["step"])
    color = colors[index % len(colors)]
    steps, values = _series(rows, "lambda_1")
    if steps:
      ax_eig.plot(steps, values, "o-", color=color, label=f"{label}: lambda_max")
    for key, style in (("lambda_2", ":"), ("lambda_3", ":")):
      steps, values = _series(rows, key)
      if steps:
        ax_eig.plot(steps, values, style, color=color, lw=0.8, alpha=0.7)
    steps, values = _series(rows, "two_over_lr")
    ax_eig.plot(steps, values, "--", color=color, lw=1, label=f"{label}: 2/lr")
    steps, values = _series(rows, "lambda_max_precond")
    if steps:
      ax_eig.plot(steps, values, "s-", color=color, alpha=0.6,
                  label=f"{label}: lambda_max of P^-1/2 H P^-1/2")
      steps, values = _series(rows, "adam_threshold")
      ax_eig.plot(steps, values, "-.", color=color, lw=1,
                  label=f"{label}: Adam threshold (2+2b1)/((1-b1) lr)")
    steps, values = _series(rows, "trace")
    if steps:
      errors = [r["trace_stderr"] or 0.0 for r in rows if r.get("trace") is not None]
      ax_trace.errorbar(steps, values, yerr=errors, fmt="o-", color=color, capsize=3,
                        label=label)
  ax_eig.set_yscale("log")
  ax_eig.set_ylabel("eigenvalue (lambda_2, lambda_3 dotted)")
  ax_eig.legend(fontsize=7)
  ax_trace.set_ylabel("trace (Hutchinson, +-1 stderr)")
  ax_trace.set_xlabel("training step")
  if ax_trace.has_data():
    ax_trace.legend(fontsize=7)
  ax_eig.set_title(title, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_density_overlay(path, runs, title):
  """runs: [(label, report)] each with a density; one curve per run, normalised so the
  shapes compare (each integrates to 1)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.5))
  floor = math.inf
  for label, report in runs:
    grid = np.asarray(report["density"]["grid"])
    values = np.asarray(report["density"]["values"])
    run_floor = _density_floor(values)
    floor = min(floor, run_floor)
    ax.semilogy(grid, np.maximum(values, run_floor), lw=1.2,
                label=f"{label} (step {report['step']}, {settings_description(report)})")
  if math.isfinite(floor):
    ax.set_ylim(bottom=floor)
  ax.set_xlabel("eigenvalue")
  ax.set_ylabel("density (SLQ)")
  ax.legend(fontsize=7)
  ax.set_title(title, fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
