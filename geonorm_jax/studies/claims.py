"""What every claim experiment (experiments/<claim>.py) shares: its flags, its runs as `train`
commands (sweep.py), its results folder, and `report`, which rebuilds a folder's tables and
figures from the folder alone.

An experiment module declares:
  NAME       the folder name under results/, also stored in config.json for `report`
  CLAIM      one line: the paper's statement under test
  SCALES     {"judge": Scale, "paper": Scale}: the recipe each run starts from (judge: the
             judge scale of configs/judge.py, where the models have learned; paper: the
             paper's sizes, for an accelerator)
  CURVES     (split, key) pairs of metrics.jsonl copied into curves.csv; a key is exact
             ("loss" is not "loss_z") or an fnmatch pattern ("residual_rms/layer_*")
  grid(args, scale) -> [Variant]      the grid without seeds (args.quick shrinks it)
  summarize(rows, curves, config) -> Summary     table, verdict and figures, from files only
and optionally add_arguments(parser), row_extra(run, workdir_config) -> dict,
measure(args) -> (rows, curves) for what needs no training (computed in this process, in the
same row and curve format, after the runs), and TUNED_LRS {scale: "lr,lr,..."}: the
learning-rate protocol (`run_tuned`): each variant of the grid at its own best peak LR, or
SWEPT_LRS {scale: "lr,lr,..."}: every variant at every LR of the grid and every seed, the
selection seed's runs being the shared LR-grid runs (an experiment about the LR curve itself),
or SELECTED, a Knob: the same protocol on another setting (geonorm_decay's alpha), with
selection_grid(args) -> [value] (every variant's starting grid); a tuned experiment may add
finalists(variants, optima) -> [(variant, value)], the cells the final seeds train (default:
every variant at its optimum).

The learning-rate protocol. Every variant first trains at each LR of the grid on one
selection seed (--selection_seed, never one of the final seeds); an optimum on an edge of the
grid extends the grid by a factor of 2 beyond that edge (at most --max_extensions times per
variant) until the best LR is interior; then the final seeds train at each variant's best LR.
Rows carry `lr` and `stage` (select | final); the verdict reads the final rows, and the
selection rows give the shared-LR comparison and the LR curves. Selection runs live under one
root for all experiments (runs/claims/lr_grid/SCALE), so experiments that share a variant and
a grid (norm_zoo and lr_tolerance) train it once. A SELECTED knob follows the same steps
(`tune`), its rows labelled with the knob's column and `stage`, its selection runs under the
experiment's own root.

A results folder holds results.csv (one row per finished run: labels, seed, final numbers),
curves.csv (name, split, key, step, value), config.json (the experiment, its scale, seeds and
every run's overrides), table.md, verdict.json and the figures. `python -m geonorm_jax report
DIR` reads only results.csv, curves.csv and config.json. The folder is also the sweep's record
across machines (results_folder.py): a run it holds with the same config is finished, even
where its workdir is gone, so a sweep resumes from a committed results folder.
"""
import argparse
import collections
import dataclasses
import fnmatch
import functools
import importlib.util
import json
import math
import os
import re
import sys

import numpy as np

from geonorm_jax.studies import results_folder, sweep
from geonorm_jax.studies.results_folder import read_csv
from geonorm_jax.training import metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERDICTS = ("reproduced", "not at this scale", "contradicted", "unresolved")
SELECTION_SEED = 100  # the LR grid's seed: never one of the final seeds (0, 1, 2, ...)


@dataclasses.dataclass(frozen=True)
class Scale:
  config_file: str  # relative to the repository root, e.g. configs/shakespeare.py
  overrides: str  # preset items every run of this scale gets
  seeds: str  # default --seeds
  note: str  # the setting in words, with its runtime


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str  # run name without the seed, e.g. "peri/dt0.1"; the workdir's subpath
  overrides: str
  labels: tuple  # (key, value) pairs, columns of results.csv


@dataclasses.dataclass
class Summary:
  table: list  # markdown lines
  verdict: str  # one of VERDICTS
  result: str  # one line: our number(s), mean +- spread and seeds
  figures: dict = dataclasses.field(default_factory=dict)  # filename -> draw(figure)


@dataclasses.dataclass(frozen=True)
class Knob:
  """A setting tuned on the selection seed (`tune`): its results.csv column and run-name part,
  the config override that sets it, and its name in messages."""
  label: str  # "lr": runs "VARIANT/lr0.002/seed100", rows with an "lr" column
  override: str  # "lr", "geo_alpha"
  what: str  # "LR", "alpha"


LR_KNOB = Knob("lr", "lr", "LR")

# Each placement's tuned peak LR (judge: results/norm_zoo/table.md, its selection seed), for
# the experiments that train placements at their own best LR without a grid of their own;
# None: any other placement. `--lr=X` of such an experiment is the shared-LR comparison.
ZOO_LRS = {"judge": {"pre": "4e-3", "post": "4e-3", "peri": "4e-3", "geonorm": "2e-3",
                     None: "4e-3"},
           "paper": {None: "6e-4"}}


def zoo_lr(args, name):
  """--lr when given (every variant at it), else the variant's ZOO_LRS at --scale."""
  if args.lr:
    return args.lr
  lrs = ZOO_LRS[args.scale]
  return lrs.get(name, lrs[None])


def variant(name, overrides, **labels):
  return Variant(name, overrides, tuple(labels.items()))


def steps_overrides(steps, evals=5):
  """A recipe cut to `steps`: warmup a tenth, `evals` validation checks, one final save."""
  return (f"steps={steps},warmup_steps={max(1, steps // 10)},"
          f"eval_every={max(1, steps // evals)},checkpoint.every={steps}")


def join(*parts):
  return ",".join(p for p in parts if p)


# ---------------------------------------------------------------------------
# Running an experiment.
# ---------------------------------------------------------------------------

def parse_args(experiment, argv=None):
  parser = argparse.ArgumentParser(description=experiment.__doc__.splitlines()[0])
  parser.add_argument("--scale", choices=tuple(experiment.SCALES), default="judge",
                      help="judge: the judge scale (configs/judge.py) on this machine; "
                      "paper: the paper's sizes, for an accelerator")
  parser.add_argument("--seeds", default=None, help="comma list (init and data order); "
                      "default the scale's")
  parser.add_argument("--quick", action="store_true", help="a smoke run: the smallest grid, "
                      "one seed unless --seeds; its numbers are not verdicts (the verdict is "
                      "'unresolved') and it writes results/NAME_quick unless --out")
  parser.add_argument("--extra", default="", help="overrides added to every run, e.g. steps=20")
  parser.add_argument("--jobs", type=int, default=None, help="runs at a time (processes), "
                      "each pinned to its share of the cores; default one per core on a CPU")
  parser.add_argument("--root", default=None, help="folder of the runs' workdirs; default "
                      "runs/claims/NAME/SCALE")
  parser.add_argument("--out", default=None, help="results folder; default results/NAME "
                      "(results/NAME_paper at paper scale)")
  parser.add_argument("--print", action="store_true", dest="print_only",
                      help="print one train command per run (for a cluster) and exit")
  parser.add_argument("--report_only", action="store_true",
                      help="collect the finished runs without training any")
  parser.add_argument("--recorded_from", default="", help="comma list of other results "
                      "folders whose recorded runs of the same config count as finished here "
                      "(e.g. lr_sensitivity's widest width from results/lr_tolerance); the "
                      "experiment's own --out folder always counts")
  tuned = hasattr(experiment, "TUNED_LRS") or hasattr(experiment, "SELECTED")
  if hasattr(experiment, "TUNED_LRS") or hasattr(experiment, "SWEPT_LRS"):
    parser.add_argument("--lrs", default=None, help="the (starting) LR grid; default the "
                        "experiment's TUNED_LRS or SWEPT_LRS for the scale")
  if tuned or hasattr(experiment, "SWEPT_LRS"):
    parser.add_argument("--selection_seed", type=int, default=SELECTION_SEED,
                        help="the seed every grid value trains on (never a final seed)")
  if tuned:
    parser.add_argument("--max_extensions", type=int, default=3, help="how often an optimum "
                        "on an edge extends the grid by 2x on that side")
  if hasattr(experiment, "add_arguments"):
    experiment.add_arguments(parser)
  args = parser.parse_args(argv)
  scale = experiment.SCALES[args.scale]
  args.seeds = args.seeds or (scale.seeds.split(",")[0] if args.quick else scale.seeds)
  try:
    args.seed_list = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds: {args.seeds!r} is not a comma list of integers")
  if tuned and args.selection_seed in args.seed_list:
    parser.error(f"--selection_seed={args.selection_seed} is one of --seeds={args.seeds}: the "
                 "final seeds must be fresh")
  suffix = ("_quick" if args.quick else "") + ("" if args.scale == "judge" else "_" + args.scale)
  # The LR grid's runs are shared by the experiments: runs/claims/lr_grid/SCALE, or
  # ROOT/lr_grid under an explicit --root.
  # --quick runs have their own folders: same names, other configs (sweep.check_finished).
  scale_dir = args.scale + ("_quick" if args.quick else "")
  args.grid_root = (os.path.join(args.root, "lr_grid" + ("_quick" if args.quick else ""))
                    if args.root else os.path.join("runs", "claims", "lr_grid", scale_dir))
  args.root = args.root or os.path.join("runs", "claims", experiment.NAME, scale_dir)
  args.default_out = os.path.join(REPO, "results", experiment.NAME + suffix)
  args.out = args.out or args.default_out
  # Earlier results stand for runs whose workdirs are not on this machine.
  args.recorded = [results_folder.recorded_runs(args.out)] + [
      _other_records(experiment, folder) for folder in args.recorded_from.split(",") if folder]
  return args


def _refuse_another_recipe(args):
  """One error, before anything trains, when --out holds a folder written with other --extra
  overrides or at another scale: its runs would not count here and rewriting the folder would
  drop them (a sweep extends a folder with more variants, widths or seeds, never another
  recipe)."""
  path = os.path.join(args.out, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  was = (saved.get("args", {}).get("extra", ""), saved.get("scale", args.scale))
  if was != (args.extra, args.scale):
    raise SystemExit(
        f"--out: {_shown_path(args.out)} holds runs of --extra={was[0]!r} at scale {was[1]}, "
        f"not --extra={args.extra!r} at scale {args.scale}; rewriting it would drop them: name "
        "another --out (its command: config.json)")


def _other_records(experiment, folder):
  """--recorded_from's folder: its records, when it copied every curve this experiment reads."""
  path = os.path.join(folder, "config.json")
  if not os.path.exists(path):
    raise SystemExit(f"--recorded_from: {folder} is not a results folder (no config.json)")
  try:
    with open(path) as f:
      other = load_experiment(json.load(f)["experiment"])
  except (ValueError, KeyError, FileNotFoundError) as e:  # not JSON, no or an unknown experiment
    raise SystemExit(f"--recorded_from: {path} does not name a claim experiment ({e!r})") from None
  missing = sorted(set(experiment.CURVES) - set(other.CURVES))
  if missing:
    raise SystemExit(f"--recorded_from: {folder} was written by {other.NAME}, whose curves.csv "
                     f"lacks {missing} that {experiment.NAME} reads")
  return results_folder.recorded_runs(folder)


def _make_run(args, scale, v, seed, root, value=None, stage=None, knob=LR_KNOB):
  """One train run of variant v; with a value, at that value of the knob (the peak LR unless
  told) and labelled with it and the stage."""
  tuned = value is not None
  overrides = join(scale.overrides, v.overrides, f"{knob.override}={value:g}" if tuned else "",
                   args.extra, "progress_bar=false")
  name = f"{v.name}/{knob.label}{value:g}/seed{seed}" if tuned else f"{v.name}/seed{seed}"
  labels = v.labels + (((knob.label, value), ("stage", stage)) if tuned else ())
  run = sweep.Run(name, scale.config_file, overrides, seed, root, labels=labels)
  for records in getattr(args, "recorded", ()):  # its own folder first
    record = records.get(name)
    if record is not None and results_folder.same_run(record, run):
      return dataclasses.replace(run, record=record)
  return run


def _checked(experiment, runs):
  if len({run.name for run in runs}) != len(runs):
    raise ValueError(f"{experiment.NAME}: two runs share a name")
  for r in runs:  # a bad --extra or grid value: one error now, not one per train process
    try:
      r.config()
    except ValueError as e:
      raise SystemExit(f"{experiment.NAME}: run {r.name}: {e}") from None
  return runs


def make_runs(experiment, args):
  """Every run of an untuned experiment; of a tuned one, the selection runs of the starting
  grid (the final runs depend on their results: run_tuned)."""
  scale = experiment.SCALES[args.scale]
  if hasattr(experiment, "TUNED_LRS") or hasattr(experiment, "SELECTED"):
    variants = experiment.grid(args, scale)
    knob, start, root = _tuning(experiment, args)
    return [r for _, line in _selection_runs(experiment, args, variants,
                                             {v.name: start for v in variants}, knob, root)
            for r in line]
  if hasattr(experiment, "SWEPT_LRS"):
    lrs = starting_lrs(experiment, args)
    runs = []
    for v in experiment.grid(args, scale):
      for seed in args.seed_list:
        shared = seed == args.selection_seed
        runs += [_make_run(args, scale, v, seed, args.grid_root if shared else args.root, lr,
                           "select" if shared else "sweep") for lr in lrs]
    return _checked(experiment, runs)
  return _checked(experiment, [_make_run(args, scale, v, seed, args.root)
                               for v in experiment.grid(args, scale) for seed in args.seed_list])


def starting_lrs(experiment, args):
  lrs = getattr(experiment, "TUNED_LRS", None) or experiment.SWEPT_LRS
  return parse_lrs(args.lrs or lrs[args.scale])


def parse_lrs(text):
  """The sorted distinct LRs of an --lrs comma list (or a scale's default grid)."""
  try:
    return sorted({float(lr) for lr in str(text).split(",")})
  except ValueError:
    raise SystemExit(f"--lrs: {text!r} is not a comma list of numbers") from None


def _tuning(experiment, args):
  """(knob, starting grid, root of the selection runs) of a tuned experiment; call after its
  grid(), which may set flags (--quick)."""
  if hasattr(experiment, "TUNED_LRS"):
    return LR_KNOB, starting_lrs(experiment, args), args.grid_root
  return experiment.SELECTED, experiment.selection_grid(args), args.root


def _selection_runs(experiment, args, variants, grids, knob, root):
  """[(variant, [its run at each value of its grid])] on the selection seed ({name: [value]})."""
  scale = experiment.SCALES[args.scale]
  lines = [(v, [_make_run(args, scale, v, args.selection_seed, root, x, "select", knob)
                for x in grids[v.name]]) for v in variants]
  _checked(experiment, [r for _, line in lines for r in line])
  return lines


def tune(experiment, args, variants, grids, knob, root, finalists=None):
  """The selection protocol (module docstring) on any knob: every variant at each value of its
  starting grid ({name: [value]}) on the selection seed under `root`, a grid extended beyond an
  edge optimum (x2 above its top, /2 below its bottom; an unfinished run extends nothing) and
  rerun (finished runs are skipped), then the final seeds under args.root at the cells
  finalists(variants, optima) names ([(variant, value)]; default every variant at its
  optimum). Returns the selection runs and the final runs."""
  scale = experiment.SCALES[args.scale]
  grids = dict(grids)
  extensions = {v.name: 0 for v in variants}
  while True:
    lines = _selection_runs(experiment, args, variants, grids, knob, root)
    runs = [r for _, line in lines for r in line]
    sweep.execute(args, runs)  # exits after --print: the final runs need these results
    optima, extended = {}, False
    for v, line in lines:
      losses = [(r.summary() or {}).get("final_eval_loss", float("nan")) for r in line]
      optimum = optima[v.name] = grid_optimum(grids[v.name], losses)
      unfinished = any(math.isnan(loss) for loss in losses)
      if not optimum.at_edge or extensions[v.name] >= args.max_extensions or unfinished:
        continue
      values = grids[v.name]
      added = values[0] / 2 if optimum.x == values[0] else values[-1] * 2
      if args.report_only and _make_run(args, scale, v, args.selection_seed, root, added,
                                        "select", knob).summary() is None:
        continue  # --report_only trains nothing: it reads an extension once it has finished
      grids[v.name] = sorted(values + [added])
      extensions[v.name] += 1
      extended = True
      print(f"{experiment.NAME}: {v.name}: best {knob.what} {optimum.x:g} is on the grid's "
            f"edge; adding {added:g}", flush=True)
    if not extended:
      break
  cells = (finalists(variants, optima) if finalists else
           [(v, optima[v.name].x) for v in variants if optima[v.name].x is not None])
  final = _checked(experiment, [_make_run(args, scale, v, seed, args.root, x, "final", knob)
                                for v, x in cells for seed in args.seed_list])
  sweep.execute(args, final)
  return runs + final


def run_tuned(experiment, args):
  """The learning-rate protocol (module docstring), or the same on the SELECTED knob: selection
  grid, extended until each variant's optimum is interior, then the final seeds at each
  variant's best value (or at the experiment's finalists)."""
  variants = experiment.grid(args, experiment.SCALES[args.scale])
  knob, start, root = _tuning(experiment, args)
  return tune(experiment, args, variants, {v.name: start for v in variants}, knob, root,
              getattr(experiment, "finalists", None))


def run(experiment, argv=None):
  """Parse the flags, run (or print) the unfinished runs, collect, write and report."""
  args = parse_args(experiment, argv)
  _refuse_another_recipe(args)
  if hasattr(experiment, "TUNED_LRS") or hasattr(experiment, "SELECTED"):
    runs = run_tuned(experiment, args)
  else:
    runs = make_runs(experiment, args)
    sweep.execute(args, runs)  # exits after --print
  finished = [r for r in runs if r.summary() is not None]
  rows, curves = collect(experiment, finished)
  if hasattr(experiment, "measure"):
    measured_rows, measured_curves = experiment.measure(args)
    rows, curves = rows + measured_rows, curves + measured_curves
  if not rows:
    raise SystemExit(f"{experiment.NAME}: no finished run under {args.root}")
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  sweep.write_csv(os.path.join(args.out, "curves.csv"), curves)
  scale = experiment.SCALES[args.scale]
  extra_args = {k: v for k, v in vars(args).items()
                if k not in ("seed_list", "root", "grid_root", "out", "default_out", "print_only",
                             "report_only", "jobs", "recorded", "recorded_from")}
  sweep.write_config(os.path.join(args.out, "config.json"), experiment=experiment.NAME,
                     claim=experiment.CLAIM, command=_command(experiment, argv, args.default_out),
                     scale=args.scale, scale_note=scale.note,
                     config_file=scale.config_file, args=extra_args,
                     runs={r.name: r.overrides for r in runs},
                     missing=[r.name for r in runs if r.summary() is None],
                     recorded={r.name: r.record.source for r in finished if r.from_record()})
  summary = report(args.out)
  print("\n".join(summary.table))
  print(f"verdict: {summary.verdict}: {summary.result}")
  return summary


def _command(experiment, argv, default_out):
  """The command line that wrote a results folder, as a reader would retype it."""
  import shlex  # pylint: disable=g-import-not-at-top
  arguments = sys.argv[1:] if argv is None else argv
  # Where the runs went and how many ran at once change no number: left out, so no results
  # file names a machine's folders. --report_only too: the command to retype is the one that
  # trains the runs. A results folder inside the repository other than the default stays: the
  # retyped command must write there, not over the default folder.
  kept = []
  for a in arguments:
    if a.startswith("--out="):
      out = os.path.relpath(os.path.abspath(a[len("--out="):]), REPO)
      if not out.startswith("..") and out != os.path.relpath(default_out, REPO):
        kept.append(f"--out={out}")
    elif not a.startswith(("--root=", "--jobs=", "--recorded_from=", "--report_only")):
      kept.append(a)
  return shlex.join(["python", f"experiments/{experiment.NAME}.py", *kept])


@functools.lru_cache(maxsize=None)
def _num_params(model_json):
  from geonorm_jax.nn import model as model_lib, spec as spec_lib
  from geonorm_jax.training import config as config_lib
  config = config_lib.from_dict({"model": json.loads(model_json)})
  _, abstract = model_lib.abstract_params(spec_lib.resolve(config.model))
  return model_lib.count_params(abstract)


def copies_curve(experiment, split, key):
  """Whether curves.csv holds metrics.jsonl's `key` of `split` (experiment.CURVES)."""
  return any(split == s and fnmatch.fnmatchcase(key, pattern) for s, pattern in experiment.CURVES)


def collect(experiment, runs):
  """results.csv rows and curves.csv rows of the finished runs."""
  rows, curves = [], []
  for r in runs:
    if r.from_record():  # as the results folder holds it, under the run's labels of today
      rows.append({**r.record.row, **dict(r.labels)})
      # A record written when a key matched more (a prefix) keeps only what CURVES names.
      curves += [dict(c) for c in r.record.curves
                 if copies_curve(experiment, c["split"], c["key"])]
      continue
    summary = r.summary()
    with open(os.path.join(r.workdir, "config.json")) as f:
      run_config = json.load(f)
    tokens_per_step = run_config["data"]["batch_size"] * run_config["data"]["seq_len"]
    tokens_per_s = summary.get("tokens_per_s", float("nan"))
    row = dict(r.labels)
    row.update(name=r.name, seed=r.seed,
               params=_num_params(json.dumps(run_config["model"], sort_keys=True)),
               steps=summary.get("final_step"),
               tokens=summary.get("final_step", 0) * tokens_per_step,
               final_eval_loss=summary.get("final_eval_loss", float("nan")),
               final_train_loss=summary.get("final_train_loss", float("nan")),
               step_time_s=tokens_per_step / tokens_per_s if tokens_per_s else float("nan"),
               loss_spikes=summary.get("loss_spikes", 0),
               skipped_steps=summary.get("skipped_steps", 0),
               collapse_step=summary.get("collapse_step"),
               # train.give_up_steps stopped it there: a record of it is not a full run's
               gave_up_step=summary.get("gave_up_step"))
    if hasattr(experiment, "row_extra"):
      row.update(experiment.row_extra(r, run_config))
    rows.append(row)
    for record in metrics.read_metrics(r.workdir):
      split = record.get("split")
      for key, value in record.items():
        if isinstance(value, (int, float)) and copies_curve(experiment, split, key):
          curves.append({"name": r.name, "split": split, "key": key,
                         "step": int(record["step"]), "value": float(value)})
  return rows, curves


# ---------------------------------------------------------------------------
# Reading a results folder back, and `report`.
# ---------------------------------------------------------------------------

def load_experiment(name):
  """experiments/<name>.py of this repository, as a module."""
  path = os.path.join(REPO, "experiments", f"{name}.py")
  if not os.path.exists(path):
    raise FileNotFoundError(f"config.json names experiment {name!r}, but {path} does not exist")
  spec = importlib.util.spec_from_file_location(f"claim_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def unfinished_note(missing, listed=10):
  """The setting line's account of the unfinished runs: their names while few, else their
  count by run name less the LR (config.json's "missing" keeps every name)."""
  if not missing:
    return ""
  if len(missing) <= listed:
    return f"; unfinished: {', '.join(missing)}"
  groups = collections.Counter(re.sub(r"/lr[^/]*", "", name) for name in missing)
  return (f"; {len(missing)} unfinished, named in config.json, by run less its LR: "
          + ", ".join(f"{group} ({n})" for group, n in groups.items()))


def _shown_path(path):
  relative = os.path.relpath(os.path.abspath(path), REPO)
  return os.path.abspath(path) if relative.startswith("..") else relative


def report(out_dir):
  """Rebuild table.md, verdict.json and the figures of a results folder from its files."""
  config_path = os.path.join(out_dir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{config_path} not found: is {out_dir} a claim results folder?")
  with open(config_path) as f:
    config = json.load(f)
  if "experiment" not in config:
    raise ValueError(f"{config_path} has no 'experiment' field: not written by a claim "
                     "experiment")
  experiment = load_experiment(config["experiment"])
  rows = read_csv(os.path.join(out_dir, "results.csv"))
  curves = read_csv(os.path.join(out_dir, "curves.csv"))
  summary = experiment.summarize(rows, curves, config)
  if summary.verdict not in VERDICTS:
    raise ValueError(f"{config['experiment']}: verdict {summary.verdict!r} is not one of "
                     f"{VERDICTS}")
  if config["args"].get("quick"):  # a smoke run decides nothing, whatever its numbers say
    summary.result = (f"--quick smoke run, not a verdict (the rule read "
                      f"'{summary.verdict}'): {summary.result}")
    summary.verdict = "unresolved"
  seeds = sorted({row["seed"] for row in rows})
  steps = sorted({row["steps"] for row in rows if row["steps"]})
  quick = (" With --quick (a cut grid; the script's docstring says what is cut); steps per run: "
           + ", ".join(map(str, steps)) + "." if config["args"].get("quick") else "")
  header = [f"# {config['experiment']}: {config['claim']}", "",
            f"Setting ({config['scale']} scale): {config['scale_note']}{quick} Seeds: "
            f"{', '.join(map(str, seeds))} ({len(rows)} finished runs"
            + unfinished_note(config.get("missing") or [])
            + f"). Written by `{config['command']}`; regenerate with "
            f"`python -m geonorm_jax report {_shown_path(out_dir)}`.",
            ""]
  footer = ["", f"**Verdict: {summary.verdict}.** {summary.result}"]
  with open(os.path.join(out_dir, "table.md"), "w") as f:
    f.write("\n".join(header + summary.table + footer) + "\n")
  with open(os.path.join(out_dir, "verdict.json"), "w") as f:
    json.dump({"experiment": config["experiment"], "claim": config["claim"],
               "verdict": summary.verdict, "result": summary.result,
               "seeds": len(seeds), "runs": len(rows)}, f, indent=2)
  if summary.figures:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    for filename, draw in summary.figures.items():
      figure = plt.figure(figsize=(7, 4.5))
      draw(figure)
      figure.tight_layout()
      figure.savefig(os.path.join(out_dir, filename), dpi=110)
      plt.close(figure)
  return summary


# ---------------------------------------------------------------------------
# Statistics every summary uses.
# ---------------------------------------------------------------------------

def group(rows, *keys):
  """{(values of keys): [rows]} in first-seen order."""
  out = {}
  for row in rows:
    out.setdefault(tuple(row[k] for k in keys), []).append(row)
  return out


def values(rows, key):
  return np.asarray([np.nan if row[key] is None else row[key] for row in rows], float)


def mean_spread(x):
  """(mean, sample std, n) over the finite values; std NaN with fewer than two."""
  x = np.asarray(x, float)
  finite = x[np.isfinite(x)]
  mean = float(finite.mean()) if len(finite) else float("nan")
  std = float(finite.std(ddof=1)) if len(finite) > 1 else float("nan")
  return mean, std, len(x)


def curve_over(runs, x_key, metric):
  """(xs, means, stds) of `metric` over seeds at each value of `x_key`, xs sorted; a std that
  one seed leaves undefined is 0, so it draws as no error bar."""
  cells = group(runs, x_key)
  xs = sorted(x for (x,) in cells)
  stats = [mean_spread(values(cells[(x,)], metric)) for x in xs]
  return xs, [s[0] for s in stats], [0.0 if np.isnan(s[1]) else s[1] for s in stats]


def fmt(x, digits=3):
  """'2.183 +- 0.023 (3 seeds)', '2.183 (1 seed)'; non-finite values are counted apart."""
  x = np.asarray(x, float)
  mean, std, n = mean_spread(x)
  bad = int(np.sum(~np.isfinite(x)))
  text = f"{mean:.{digits}f}" + (f" +- {std:.{digits}f}" if math.isfinite(std) else "")
  text += f" ({n} seed{'s' if n != 1 else ''}"
  return text + (f", {bad} non-finite)" if bad else ")")


@dataclasses.dataclass(frozen=True)
class Optimum:
  """The best value of a grid: x (None when no loss is finite), its loss, and whether it lies
  on an edge of the grid (its smallest or largest value, or a grid of fewer than 3 values),
  where the loss may go on falling beyond the grid: such an optimum decides no verdict."""
  x: float | None
  loss: float
  at_edge: bool
  grid: tuple

  def describe(self, what="lr"):
    if self.x is None:
      return f"no finite loss on the {what} grid {list(self.grid)}"
    edge = " (optimum at the grid edge)" if self.at_edge else ""
    return f"best {what} {self.x:g} of {', '.join(f'{x:g}' for x in self.grid)}{edge}"


def grid_optimum(xs, losses):
  """The Optimum of losses over the grid xs (any order); non-finite losses never win."""
  order = np.argsort(np.asarray(xs, float))
  xs = [float(xs[i]) for i in order]
  y = np.asarray([losses[i] for i in order], float)
  y = np.where(np.isfinite(y), y, np.inf)
  if not len(y) or not np.isfinite(y.min()):
    return Optimum(None, float("nan"), False, tuple(xs))
  best = int(np.argmin(y))
  return Optimum(xs[best], float(y[best]), len(xs) < 3 or best in (0, len(xs) - 1), tuple(xs))


def initial_loss(curves, name):
  """L0: a run's first logged train loss (NaN without one)."""
  _, losses = curve(curves, name, "loss")
  return float(losses[0]) if len(losses) else float("nan")


def grid_initial_loss(curves, names, lrs):
  """L0 of an LR grid (its runs `names` at peak LRs `lrs`, one seed, so one initialisation):
  the first logged train loss of its lowest-LR run that logged one, the run that has moved
  least from the initial model by its first log; NaN when none has one. Not the grid's
  largest first loss: a run far past its optimum can already spike above the initial loss by
  its first log (seen at step 10: 7.70 against 5.54), which would raise the cap."""
  for _, name in sorted(zip(lrs, names)):
    loss = initial_loss(curves, name)
    if math.isfinite(loss):
      return loss
  return float("nan")


def lr_sensitivity(losses, initial):
  """Wortsman et al.'s (arXiv 2309.14322) LR sensitivity of one LR grid's final losses: the
  mean of min(L, L0) minus the min of L, a non-finite L counted at L0 (the loss at
  initialisation); NaN when no loss is finite or L0 is unknown. It depends on the grid."""
  y = np.asarray(losses, float)
  if not math.isfinite(initial) or not np.isfinite(y).any():
    return float("nan")
  capped = np.where(np.isfinite(y), np.minimum(y, initial), initial)
  return float(capped.mean() - capped.min())


def tuned_variant(run_name):
  """'pre/lr0.002/seed100' -> 'pre': the variant a tuned run belongs to."""
  return run_name.rsplit("/lr", 1)[0]


def tuned_lrs(rows, key="final_eval_loss"):
  """{variant: Optimum of the selection rows' `key` over their LR grid}."""
  selection = [row for row in rows if row.get("stage") == "select"]
  out = {}
  for row in selection:
    out.setdefault(tuned_variant(row["name"]), {})[row["lr"]] = row[key]
  return {name: grid_optimum(list(by_lr), list(by_lr.values())) for name, by_lr in out.items()}


def at_edge(optima, what="lr"):
  """The 'optimum at the grid edge' refusal for a verdict resting on these optima, or None."""
  edged = [f"{name}: {o.describe(what)}" for name, o in optima.items() if o.at_edge or o.x is None]
  return ("optimum at the grid edge, no verdict (extend the grid): " + "; ".join(edged)
          if edged else None)


def curve(curves, name, key, split="train"):
  """(steps, values) of one run's scalar in curves.csv, sorted by step."""
  points = sorted((c["step"], c["value"]) for c in curves
                  if c["name"] == name and c["key"] == key and c["split"] == split)
  return (np.asarray([p[0] for p in points], int), np.asarray([p[1] for p in points], float))


def diverged(row, curves, warmup_steps):
  """A run diverged if any step was non-finite (skipped, train.on_divergence=skip) or its
  train loss, after warmup, rose above its first logged value (the loss at step 1 when
  log_every=1)."""
  if row["skipped_steps"] or not math.isfinite(row["final_train_loss"]):
    return True
  steps, losses = curve(curves, row["name"], "loss")
  if not len(steps):
    return False
  after = losses[steps > warmup_steps]
  return bool(np.any(~np.isfinite(after)) or np.any(after > losses[0]))


def plot_curves(figure, curves, rows, label_of, key="loss", split="train", ylabel="loss (nats/token)",
                title="", log_y=False):
  """Every run's curve of `key`, one colour per label, seeds as thin lines of that colour."""
  axes = figure.add_subplot(1, 1, 1)
  labels = list(dict.fromkeys(label_of(row) for row in rows))
  # Past ten labels the default cycle repeats: take tab20 and alternate the line style.
  many = len(labels) > 10
  import matplotlib  # pylint: disable=g-import-not-at-top
  colours = {label: matplotlib.colormaps["tab20"](i % 20) if many else f"C{i}"
             for i, label in enumerate(labels)}
  styles = {label: ("-", "--", "-.")[i % 3] if many else "-" for i, label in enumerate(labels)}
  seen = set()
  for row in rows:
    steps, ys = curve(curves, row["name"], key, split)
    if not len(steps):
      continue
    label = label_of(row)
    axes.plot(steps, ys, color=colours[label], ls=styles[label], lw=1.0, alpha=0.8,
              label=None if label in seen else label)
    seen.add(label)
  axes.set_xlabel("training step")
  axes.set_ylabel(ylabel)
  if log_y:
    axes.set_yscale("log")
  axes.set_title(title, fontsize=9)
  if seen:  # no run with a curve yet: an empty panel, no empty legend
    axes.legend(fontsize=7, ncol=2)
  axes.grid(alpha=0.3)
  return axes


def cell(rows, key, digits=3):
  return fmt(values(rows, key), digits)


# Reference losses on character-level tinyshakespeare, drawn on the loss axes: a model that
# knows only character frequencies (the unigram entropy of the file), and nanoGPT's two
# published recipes (its README).
REFERENCE_LOSSES = (("unigram", 3.35), ("nanoGPT CPU recipe", 1.88), ("nanoGPT GPU recipe", 1.47))


def _reference_lines(axes, horizontal=True):
  for i, (label, value) in enumerate(REFERENCE_LOSSES):
    line = axes.axhline if horizontal else axes.axvline
    line(value, color="grey", ls=(":", "--", "-.")[i], lw=0.8, label=f"{label} {value:g}")


def plot_mean_curves(figure, curves, rows, label_key, key="loss", split="eval",
                     ylabel="validation loss (nats/token)", title=""):
  """Per label the mean curve over its seeds, with the min-max band; reference losses drawn
  and the y axis cut to the range the curves reach after their first point (where the
  placements differ), not the loss at initialisation."""
  axes = figure.add_subplot(1, 1, 1)
  lows = []
  for i, ((label,), runs) in enumerate(group(rows, label_key).items()):
    series = [curve(curves, row["name"], key, split) for row in runs]
    series = [(s, y) for s, y in series if len(s)]
    if not series:
      continue
    steps = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
    ys = np.asarray([[dict(zip(s.tolist(), y))[t] for t in steps] for s, y in series])
    axes.plot(steps, ys.mean(0), color=f"C{i % 10}", lw=1.5, label=f"{label} ({len(series)})")
    axes.fill_between(steps, ys.min(0), ys.max(0), color=f"C{i % 10}", alpha=0.2, lw=0)
    lows.append((np.nanmin(ys), np.nanmax(ys[:, 1:]) if ys.shape[1] > 1 else np.nanmax(ys)))
  _reference_lines(axes)
  if lows:
    low, high = min(l for l, _ in lows), max(h for _, h in lows)
    axes.set_ylim(min(low, 1.47) - 0.05, max(high, 3.35) + 0.05)
  axes.set_xlabel("training step")
  axes.set_ylabel(ylabel)
  axes.set_title(title, fontsize=9)
  axes.legend(fontsize=7, ncol=2)
  axes.grid(alpha=0.3)
  return axes


def plot_final_losses(figure, rows, label_key, key="final_eval_loss", title=""):
  """Final losses as dots (mean over seeds) with min-max bars, one row per label, sorted."""
  axes = figure.add_subplot(1, 1, 1)
  cells = [(label, values(runs, key)) for (label,), runs in group(rows, label_key).items()]
  cells = sorted(cells, key=lambda c: mean_spread(c[1])[0])
  for i, (label, x) in enumerate(cells):
    finite = x[np.isfinite(x)]
    if not len(finite):
      continue
    mean = finite.mean()
    axes.errorbar([mean], [i], xerr=[[mean - finite.min()], [finite.max() - mean]], fmt="o",
                  color="C0", capsize=3)
    axes.plot(finite, [i] * len(finite), "|", color="C0", alpha=0.5)
  axes.set_yticks(range(len(cells)), [f"{label} ({len(x)})" for label, x in cells], fontsize=8)
  axes.invert_yaxis()
  _reference_lines(axes, horizontal=False)
  axes.set_xlabel("final validation loss (nats/token)")
  axes.set_title(title, fontsize=9)
  axes.legend(fontsize=7)
  axes.grid(alpha=0.3)
  return axes


def plot_lr_grid(figure, rows, label_key, key="final_eval_loss", title=""):
  """The selection seed's final loss against peak LR, one line per label; the tuned LR ringed."""
  axes = figure.add_subplot(1, 1, 1)
  selection = [row for row in rows if row.get("stage") == "select"]
  optima = tuned_lrs(selection, key)
  for i, ((label,), runs) in enumerate(group(selection, label_key).items()):
    lrs, means, _ = curve_over(runs, "lr", key)
    axes.plot(lrs, means, marker="o", color=f"C{i % 10}", label=label)
    best = optima.get(tuned_variant(runs[0]["name"]))
    if best is not None and best.x is not None:
      axes.plot([best.x], [best.loss], "o", ms=12, mfc="none", color=f"C{i % 10}")
  _reference_lines(axes)
  axes.set_xscale("log")
  axes.set_xlabel("peak learning rate")
  axes.set_ylabel("final validation loss (nats/token)")
  axes.set_title(title, fontsize=9)
  axes.legend(fontsize=7, ncol=2)
  axes.grid(alpha=0.3)
  return axes



def verdict(config, holds):
  """holds: True (the claim's direction, resolved), False (the opposite, resolved), None.
  A claim that fails on this machine's small models is 'not at this scale'; one that fails
  at the paper's scale is 'contradicted'."""
  if holds is None:
    return "unresolved"
  if holds:
    return "reproduced"
  return "contradicted" if config["scale"] == "paper" else "not at this scale"


def add_variants_argument(parser, default):
  parser.add_argument("--variants", default=",".join(default),
                      help=f"comma list of {', '.join(sweep.PLACEMENT_VARIANTS)}")


def variant_list(args):
  return [(name, sweep.variant_overrides(name)) for name in args.variants.split(",")]
