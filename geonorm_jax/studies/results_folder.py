"""Reading a claim's results folder: its CSV files, and the finished runs it records.

A run's workdir (checkpoints, metrics.jsonl) stays on the machine that trained it, and a
machine can be gone before a sweep of many hours ends. The results folder (results.csv,
curves.csv, config.json) is small and is committed with the code, so it is the sweep's durable
record: a run whose workdir holds no finished summary.json counts as finished when the folder
holds a row of the same run name and config.json gives that name the same overrides, under the
same config file, scale and --quick (together they are the same `train` command). Such a run
is not trained again; its row and curves are carried into the rewritten folder as they were
written, and config.json lists it under "recorded". A workdir's own finished summary.json
always wins over a record.
"""
import collections
import csv
import dataclasses
import json
import os


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
  overrides: str  # config.json's entry for the run: what makes it the same run
  row: dict
  curves: tuple

  def summary(self):
    """The fields of summary.json that the selection protocol and sweep read."""
    return {"final_eval_loss": self.row.get("final_eval_loss", float("nan")),
            "final_train_loss": self.row.get("final_train_loss", float("nan")),
            "final_step": self.row.get("steps"), "recorded": True}


def recorded_runs(folder, config_file, scale, quick):
  """{run name: Recorded} of the runs that `folder` records for this config file, scale and
  --quick; {} when the folder has no results yet or was written for another setting."""
  paths = {name: os.path.join(folder, name) for name in
           ("config.json", "results.csv", "curves.csv")}
  if not all(os.path.exists(p) for p in paths.values()):
    return {}
  with open(paths["config.json"]) as f:
    config = json.load(f)
  setting = (config.get("config_file"), config.get("scale"),
             bool(config.get("args", {}).get("quick")))
  if setting != (config_file, scale, bool(quick)):
    return {}
  curves = collections.defaultdict(list)
  for curve in read_csv(paths["curves.csv"]):
    curves[curve["name"]].append(curve)
  overrides = config.get("runs", {})
  return {row["name"]: Recorded(overrides[row["name"]], row, tuple(curves[row["name"]]))
          for row in read_csv(paths["results.csv"]) if row.get("name") in overrides}
