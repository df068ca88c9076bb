"""Reading a claim's results folder: its CSV files, and the finished runs it records.

A run's workdir (checkpoints, metrics.jsonl) stays on the machine that trained it, and a
machine can be gone before a sweep of many hours ends. The results folder (results.csv,
curves.csv, config.json) is small and is committed with the code, so it is the sweep's durable
record: a run whose workdir holds no finished summary.json counts as finished when the folder
holds a row of the same run name whose config, from config.json's config file and overrides and
the row's seed, is the requested one (`same_run`). Such a run is not trained again; its row and
curves are carried into the rewritten folder as they were written, and config.json lists it
under "recorded" with the folder it came from. An experiment reads its own folder, and the
folders named by --recorded_from (another experiment's runs of the same config). A workdir's
own finished summary.json always wins over a record.
"""
import collections
import csv
import dataclasses
import functools
import json
import os

from geonorm_jax.studies import sweep


def _number(text):
  if text in ("", "None"):
    return None
  try:
    value = float(text)
  except ValueError:
    return text
  return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def read_csv(path):
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is this a claim experiment's results folder?")
  with open(path, newline="") as f:
    return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


@dataclasses.dataclass(frozen=True)
class Recorded:
  """One finished run as a results folder holds it: its results.csv row and curves.csv rows."""
  source: str  # the folder's name, e.g. "lr_tolerance"
  config_file: str  # config.json's: with the overrides and the seed, the run's train command
  overrides: str
  row: dict
  curves: tuple

  def summary(self):
    """The fields of summary.json that the selection protocol and sweep read."""
    return {"final_eval_loss": self.row.get("final_eval_loss", float("nan")),
            "final_train_loss": self.row.get("final_train_loss", float("nan")),
            "final_step": self.row.get("steps"), "recorded": True}


def recorded_runs(folder):
  """{run name: Recorded} of every run that `folder` records; {} while it has no results."""
  paths = {name: os.path.join(folder, name) for name in
           ("config.json", "results.csv", "curves.csv")}
  if not all(os.path.exists(p) for p in paths.values()):
    return {}
  with open(paths["config.json"]) as f:
    config = json.load(f)
  curves = collections.defaultdict(list)
  for curve in read_csv(paths["curves.csv"]):
    curves[curve["name"]].append(curve)
  overrides = config.get("runs", {})
  source = os.path.basename(os.path.normpath(folder))
  return {row["name"]: Recorded(source, config["config_file"], overrides[row["name"]], row,
                                tuple(curves[row["name"]]))
          for row in read_csv(paths["results.csv"]) if row.get("name") in overrides}


@functools.lru_cache(maxsize=None)
def _config(config_file, overrides, seed):
  return sweep.load_config(config_file, overrides, seed)


def same_run(record, run):
  """Whether `record` (of the same name) stands for `run`: the same train command, or a config
  equal in every field that changes the numbers, as a finished workdir is judged
  (sweep.config_differences): so the runs that two experiments share (the LR grid of
  lr_tolerance and lr_sensitivity's widest width) are one run. A record whose overrides no
  longer load (a field since renamed) stands for nothing."""
  seed = record.row.get("seed")
  if (record.config_file, record.overrides, seed) == (run.config_file, run.overrides, run.seed):
    return True
  try:
    saved = _config(record.config_file, record.overrides, seed)
    wanted = _config(run.config_file, run.overrides, run.seed)
  except (ValueError, KeyError, AttributeError):  # the run's own error comes from _checked
    return False
  # A row written before results.csv had the column: a run that could have given up may have.
  gave_up = record.row.get("gave_up_step", saved.train.give_up_steps)
  return not sweep.config_differences(saved, wanted, gave_up)
