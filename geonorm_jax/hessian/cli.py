"""`python -m geonorm_jax hessian --workdir=RUN [--workdir=RUN2 ...] [--step=S|all] [--every=K]`.

For each run and each chosen checkpoint (default the latest; `all`: every checkpoint, or
every K-th with `--every=K`), runs hessian_analysis (cost printed first, then a progress
bar) and writes into RUN/hessian/:

  step_<S>.json   every number of that checkpoint (settings, products, seconds included);
                  written once as soon as the top eigenvalues exist, then completed
  step_<S>.png    the SLQ density, titled with model, placement, step, parameters, tokens
                  and estimator settings
  spectra.csv     one row per analysed checkpoint (hessian_report.COLUMNS)
  spectra.png     top eigenvalues with 2/lr (and the preconditioned lambda_max with the
                  Adam threshold when `precond` is computed), traces below, over steps

A rerun skips checkpoints whose step_<S>.json already holds every requested estimate with
the same settings, so an interrupted loop resumes where it stopped. With several runs the
overlay figures go to `out` (default: hessian_compare/ next to the runs): densities.png
(each run's latest analysed density) and spectra.png (all runs' curves), labelled by
placement.
"""
import os
import sys

from geonorm_jax.hessian import report as report_lib
from geonorm_jax.hessian.analysis import Analyser, Settings
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import train


def parse_steps(text):
  """--step: None / "latest", "all", or an integer."""
  if text in (None, "", "latest"):
    return "latest"
  if text == "all":
    return "all"
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--step={text!r}: give a checkpoint step, `latest` or `all`") from None


def _checkpoint_steps(workdir, config):
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint)
  try:
    return ckpt.all_steps()
  finally:
    ckpt.close()


def choose_steps(available, steps, every):
  if not available:
    raise FileNotFoundError("no checkpoint in this run")
  if steps == "latest":
    return [available[-1]]
  if steps == "all":
    chosen = available[::every]
    if available[-1] not in chosen:
      chosen.append(available[-1])  # the end of training is always worth a look
    return chosen
  if steps not in available:
    raise FileNotFoundError(f"no checkpoint at step {steps}; available: {available}")
  return [steps]


def _label(config, workdir):
  return f"{config.model.placement} ({os.path.basename(os.path.normpath(workdir))})"


def analyse_run(workdir, steps, every, settings, *, stream=None, progress=True):
  """Analyse the chosen checkpoints of one run; returns (config, rows, reports by step)."""
  config = train.config_from_workdir(workdir)
  chosen = choose_steps(_checkpoint_steps(workdir, config), steps, every)
  out_dir = os.path.join(workdir, "hessian")
  os.makedirs(out_dir, exist_ok=True)
  settings_dict = settings.as_dict()
  analyser = None
  stream = sys.stderr if stream is None else stream
  for number, step in enumerate(chosen):
    path = report_lib.step_json_path(out_dir, step)
    if os.path.exists(path) and report_lib.is_complete(report_lib.read_json(path), settings_dict):
      stream.write(f"{workdir}: step {step} already analysed ({path}), skipped\n")
      continue
    _, setup, state = train.restore_params(workdir, step, config)
    if analyser is None:  # compiled once per run, reused for every checkpoint
      analyser = Analyser(setup, settings)
    header = f"[{number + 1}/{len(chosen)}] {workdir}: Hessian of the validation loss"
    write = lambda partial, p=path: report_lib.write_json(p, _with_run(partial, workdir, config))
    report = analyser.run(state, header=header, stream=stream, enabled=progress, on_top=write)
    report = _with_run(report, workdir, config)
    report_lib.write_json(path, report)
    if "density" in report:
      report_lib.plot_density(os.path.join(out_dir, f"step_{step}.png"), report,
                              f"{report_lib.model_description(config, report['num_params'])}, "
                              f"step {step} ({report['tokens_trained']:,} tokens trained)")
  reports = {}
  for step in _analysed_steps(out_dir):
    stored = report_lib.read_json(report_lib.step_json_path(out_dir, step))
    if stored.get("settings") == settings_dict:
      reports[step] = stored
  rows = [report_lib.table_row(r) for _, r in sorted(reports.items())]
  report_lib.write_table(os.path.join(out_dir, report_lib.TABLE), rows)
  if rows:
    num_params = next(iter(reports.values()))["num_params"]
    report_lib.plot_over_steps(os.path.join(out_dir, report_lib.FIGURE), [(_label(config, workdir), rows)],
                               f"{report_lib.model_description(config, num_params)}: Hessian of "
                               f"the validation loss over training ({_settings_line(settings)})")
  return config, rows, reports, chosen


def _analysed_steps(out_dir):
  steps = []
  for name in os.listdir(out_dir):
    if name.startswith("step_") and name.endswith(".json"):
      try:
        steps.append(int(name[len("step_"):-len(".json")]))
      except ValueError:
        pass
  return sorted(steps)


def _settings_line(settings):
  return (f"Lanczos {settings.num_steps} steps, {settings.num_probes} probes, "
          f"{settings.num_batches} val batches")


def _with_run(report, workdir, config):
  return {"workdir": os.path.abspath(workdir), "placement": config.model.placement,
          "model": {"backbone": config.model.backbone, "num_layers": config.model.num_layers,
                    "d_model": config.model.d_model}, **report}


def run(workdirs, step=None, every=1, settings=None, out=None, stream=None, progress=True):
  """Analyse every run in `workdirs` (a path or a list); returns a summary dict."""
  workdirs = [workdirs] if isinstance(workdirs, str) else list(workdirs)
  if not workdirs:
    raise ValueError("give at least one --workdir")
  settings = (settings or Settings()).validate()
  steps = parse_steps(step) if not isinstance(step, int) else step
  if not isinstance(every, int) or every < 1:
    raise ValueError(f"--every={every!r} must be a positive integer")
  for workdir in workdirs:  # every run checked before any is analysed
    train.config_from_workdir(workdir)
  summary = {"runs": []}
  overlay_curves, overlay_densities = [], []
  for workdir in workdirs:
    config, rows, reports, chosen = analyse_run(workdir, steps, every, settings, stream=stream,
                                                progress=progress)
    out_dir = os.path.join(workdir, "hessian")
    latest = reports[max(chosen)] if max(chosen) in reports else None
    summary["runs"].append({
        "workdir": workdir, "placement": config.model.placement, "steps": chosen,
        "table": os.path.join(out_dir, report_lib.TABLE),
        "figure": os.path.join(out_dir, report_lib.FIGURE),
        "json": [report_lib.step_json_path(out_dir, s) for s in chosen],
        "lambda_max": latest["lanczos"]["top_eigenvalues"][0]
                      if latest and "lanczos" in latest else None,
        "trace": latest.get("trace") if latest else None,
    })
    overlay_curves.append((_label(config, workdir), rows))
    if latest is not None and "density" in latest:
      overlay_densities.append((_label(config, workdir), latest))
  if len(workdirs) > 1:
    out = out or os.path.join(os.path.commonpath([os.path.abspath(w) for w in workdirs]),
                              "hessian_compare")
    os.makedirs(out, exist_ok=True)
    title = f"{len(workdirs)} runs: Hessian of the validation loss ({_settings_line(settings)})"
    report_lib.plot_over_steps(os.path.join(out, "spectra.png"), overlay_curves, title)
    if overlay_densities:
      report_lib.plot_density_overlay(os.path.join(out, "densities.png"), overlay_densities,
                                      title)
    summary["compare"] = out
  return summary
