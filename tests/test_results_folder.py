"""A results folder as the sweep's record across machines (studies/results_folder.py): with the
workdirs gone, claims.run trains only what the folder does not hold, rewrites the folder with
the same rows and curves, and never takes a record of another run for this one."""
import dataclasses
import json
import math
import os
import shutil
import types

import fake_sweep  # tests/ is on sys.path (no __init__.py)
import pytest
from geonorm_jax.studies import claims, results_folder, sweep

OPTIMUM = {"a": 4e-3, "b": 2e-3}  # a's optimum is past the starting grid's top: one extension


def _experiment(name="fake", curves=(("eval", "loss"),)):
  return types.SimpleNamespace(
      __doc__="A fake tuned experiment.\n", NAME=name, CLAIM="fake", CURVES=curves,
      SCALES={"judge": claims.Scale("configs/judge.py", "", "0,1", "fake")},
      TUNED_LRS={"judge": "1e-3,2e-3"},
      grid=lambda args, scale: [claims.variant("a", "placement=pre", variant="a"),
                                claims.variant("b", "placement=post", variant="b")],
      summarize=lambda rows, curves, config: claims.Summary(["| fake |"], "unresolved", "fake"))


def _loss(run):
  labels = dict(run.labels)
  return 1.5 + math.log2(labels["lr"] / OPTIMUM[labels["variant"]]) ** 2 + 0.01 * run.seed


def _run(monkeypatch, root, out, *flags, experiment=None):
  trained = []
  monkeypatch.setattr(sweep, "execute", fake_sweep.execute(trained, _loss))
  experiment = experiment or _experiment()
  experiments = {"fake": _experiment(), experiment.NAME: experiment}
  monkeypatch.setattr(claims, "load_experiment", lambda name: experiments[name])
  claims.run(experiment, [f"--root={root}", f"--out={out}", *flags])
  return trained


def _folder(out):
  rows = sorted(results_folder.read_csv(os.path.join(out, "results.csv")),
                key=lambda row: row["name"])
  curves = sorted(results_folder.read_csv(os.path.join(out, "curves.csv")),
                  key=lambda c: (c["name"], c["step"]))
  with open(os.path.join(out, "config.json")) as f:
    return rows, curves, json.load(f)


def test_a_sweep_resumes_from_its_results_folder_on_a_new_machine(monkeypatch, tmp_path):
  out = tmp_path / "results"
  first = _run(monkeypatch, tmp_path / "machine1", out)
  # a: 1e-3, 2e-3 and the extension 4e-3, 8e-3 (4e-3 was the edge); b: 1e-3, 2e-3, 4e-3
  # (2e-3 an edge, then interior); then 2 final seeds each.
  assert len(first) == 4 + 3 + 4
  rows, curves, config = _folder(out)
  assert config["recorded"] == {} and not config["missing"]
  shutil.rmtree(tmp_path / "machine1")  # the machine is gone; the committed folder is not

  assert _run(monkeypatch, tmp_path / "machine2", out) == []  # nothing trains again
  rows2, curves2, config2 = _folder(out)
  assert rows2 == rows and curves2 == curves  # carried as written, extensions and finals too
  assert config2["recorded"] == {name: "results" for name in first}
  assert config2["runs"] == config["runs"]

  # A row the folder lacks (that run had not finished when the folder was written) trains,
  # and only it; the rest keep their recorded numbers.
  dropped = "a/lr0.004/seed1"
  sweep.write_csv(out / "results.csv", [row for row in rows if row["name"] != dropped])
  assert _run(monkeypatch, tmp_path / "machine3", out) == [dropped]
  rows3, curves3, _ = _folder(out)
  assert rows3 == rows and curves3 == curves  # the fake trainer is deterministic


def test_a_record_of_another_config_is_not_this_run(monkeypatch, tmp_path):
  out = tmp_path / "results"
  first = _run(monkeypatch, tmp_path / "machine1", out)
  written = {f: (out / f).read_bytes() for f in ("results.csv", "curves.csv", "config.json")}
  # Another --extra into the same folder would replace its runs: refused, the folder intact.
  with pytest.raises(SystemExit, match=r"--out: .*results holds runs of --extra='' at scale "
                     r"judge, not --extra='steps=20'"):
    _run(monkeypatch, tmp_path / "machine2", out, "--extra=steps=20")
  assert {f: (out / f).read_bytes() for f in written} == written
  # Another --extra is another config under the same names: everything trains.
  other = tmp_path / "results_steps20"
  again = _run(monkeypatch, tmp_path / "machine2", other, "--extra=steps=20",
               f"--recorded_from={out}")
  assert sorted(again) == sorted(first)
  _, _, config = _folder(other)
  assert config["recorded"] == {} and all("steps=20" in o for o in config["runs"].values())
  record = results_folder.recorded_runs(out)["a/lr0.001/seed100"]
  run = sweep.Run("a/lr0.001/seed100", "configs/judge.py", record.overrides, 100)
  assert results_folder.same_run(record, run)
  # The same config spelled otherwise is the same run; another seed, file or field is not.
  reordered = ",".join(reversed(record.overrides.split(",")))
  assert results_folder.same_run(record, dataclasses.replace(run, overrides=reordered))
  assert not results_folder.same_run(record, dataclasses.replace(run, seed=101))
  assert not results_folder.same_run(record, dataclasses.replace(run, overrides=record.overrides
                                                                  + ",warmup_steps=7"))
  assert not results_folder.same_run(record, dataclasses.replace(run,
                                                                 config_file="configs/llama.py"))


def test_another_experiments_folder_lends_its_runs_of_the_same_config(monkeypatch, tmp_path):
  """lr_sensitivity's widest width and lr_tolerance's grid are the same runs; a run that may
  give up early (train.give_up_steps) is the same run as one that may not, unless it gave up."""
  lender = tmp_path / "lender"
  lent = _run(monkeypatch, tmp_path / "machine1", lender, "--extra=steps=20")
  rows = {row["name"]: row for row in results_folder.read_csv(lender / "results.csv")}
  gave_up = "b/lr0.004/seed100"  # as if it had given up: that run is not the same run any more
  rows[gave_up]["gave_up_step"] = 300
  sweep.write_csv(lender / "results.csv", list(rows.values()))
  borrower = _experiment("borrower")
  out = tmp_path / "borrower"
  trained = _run(monkeypatch, tmp_path / "machine2", out, "--extra=steps=20,give_up_steps=100",
                 f"--recorded_from={lender}", experiment=borrower)
  assert trained == [gave_up]
  borrowed, _, config = _folder(out)
  assert config["recorded"] == {name: "lender" for name in lent if name != gave_up}
  assert str(tmp_path) not in json.dumps(config)  # no machine path written
  assert {r["name"]: r["final_eval_loss"] for r in borrowed if r["name"] != gave_up} == {
      name: row["final_eval_loss"] for name, row in rows.items() if name != gave_up}
  # A folder whose curves.csv lacks a curve the borrower reads lends nothing: one clear error.
  reads_more = _experiment("reads_more", curves=(("eval", "loss"), ("train", "loss")))
  with pytest.raises(SystemExit, match=r"--recorded_from: .*lender was written by fake, whose "
                     r"curves.csv lacks \[\('train', 'loss'\)\]"):
    _run(monkeypatch, tmp_path / "machine3", tmp_path / "other", f"--recorded_from={lender}",
         experiment=reads_more)
  with pytest.raises(SystemExit, match="--recorded_from: .*nowhere is not a results folder"):
    _run(monkeypatch, tmp_path / "machine3", tmp_path / "other",
         f"--recorded_from={tmp_path / 'nowhere'}")
  (tmp_path / "hand_made").mkdir()
  (tmp_path / "hand_made" / "config.json").write_text("{}")
  with pytest.raises(SystemExit, match="--recorded_from: .*hand_made.config.json does not name "
                     "a claim experiment"):
    _run(monkeypatch, tmp_path / "machine3", tmp_path / "other",
         f"--recorded_from={tmp_path / 'hand_made'}")


def test_a_finished_workdir_wins_over_the_record(monkeypatch, tmp_path):
  out = tmp_path / "results"
  _run(monkeypatch, tmp_path / "machine1", out)
  rows, _, _ = _folder(out)
  # The same run trained again here, on this machine, to another number (say a fixed bug):
  # the workdir's summary is read, not the folder's record.
  name = "b/lr0.002/seed0"
  summary = tmp_path / "machine1" / name / "summary.json"
  summary.write_text(json.dumps({"final_eval_loss": 9.0, "final_step": 10,
                                 "tokens_per_s": 100.0}))
  assert _run(monkeypatch, tmp_path / "machine1", out) == []
  rows2, _, config = _folder(out)
  assert {r["name"]: r["final_eval_loss"] for r in rows2}[name] == 9.0
  assert name not in config["recorded"]
  assert [r for r in rows2 if r["name"] != name] == [r for r in rows if r["name"] != name]


def test_a_record_that_may_have_given_up_is_not_a_full_run():
  """A record of a run with train.give_up_steps=100 (lr_sensitivity's grids used to set it)
  stands for the same run without the setting only when its row says it never gave up; a row
  written before results.csv had the column says nothing, so it does not."""
  overrides = "placement=pre,lr=0.5"
  row = {"name": "pre/lr0.5/seed100", "seed": 100}
  full_run = sweep.Run(row["name"], "configs/judge.py", overrides, 100)
  def record(**fields):
    return results_folder.Recorded("lr_sensitivity", "configs/judge.py",
                                   overrides + ",give_up_steps=100", {**row, **fields}, ())
  assert results_folder.same_run(record(gave_up_step=None), full_run)
  assert not results_folder.same_run(record(gave_up_step=300), full_run)
  assert not results_folder.same_run(record(), full_run)
  never_could = results_folder.Recorded("norm_zoo", "configs/judge.py", overrides, row, ())
  assert results_folder.same_run(never_could, dataclasses.replace(
      full_run, overrides=overrides + ",give_up_steps=100"))


def test_curves_csv_holds_the_keys_curves_names_and_no_more(monkeypatch, tmp_path):
  """A CURVES key is exact ("loss" is not the spike z-score "loss_z") or an fnmatch pattern;
  a record carried from a folder written when a key was a prefix loses what it no longer
  names."""
  experiment = _experiment("layers", curves=(("train", "loss"), ("train", "grad_norm/layer_*")))
  out = tmp_path / "results"
  _run(monkeypatch, tmp_path / "machine1", out, experiment=experiment)
  rows, curves, _ = _folder(out)
  wanted = {("train", "loss"), ("train", "grad_norm/layer_00"), ("train", "grad_norm/layer_01")}
  assert {(c["split"], c["key"]) for c in curves} == wanted
  assert len(curves) == 3 * len(rows)
  extra = [{**c, "key": "loss_z", "value": 0.5} for c in curves if c["key"] == "loss"]
  sweep.write_csv(out / "curves.csv", curves + extra)
  assert _run(monkeypatch, tmp_path / "machine2", out, experiment=experiment) == []
  _, carried, config = _folder(out)
  assert set(config["recorded"]) == {row["name"] for row in rows}
  assert carried == curves
