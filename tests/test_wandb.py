"""Weights & Biases tracking (`train.wandb`), offline: the run's own files read back.

An offline run is one `.wandb` file per process start: W&B's transaction log, a LevelDB log
(github.com/google/leveldb doc/log_format.md: 32 KiB blocks of records, each a CRC-32, a
length and a FULL/FIRST/MIDDLE/LAST type) behind a 7-byte `:W&B` header, each record one
`wandb.proto.wandb_internal_pb2.Record`. The pinned wandb (0.31) writes it from its Go core
and ships no Python reader, so `_records` below reads the format itself, checking every
checksum, and wandb's own protobuf classes decode the records.
"""
import glob
import json
import math
import os
import struct
import sys
import zlib

import pytest

from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics
from geonorm_jax.training import tracking
from geonorm_jax.training import train as train_lib

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

TINY = ("tiny,num_layers=2,d_model=32,num_heads=2,seq_len=16,max_seq_len=16,batch_size=8,"
        "train.warmup_steps=2,train.log_every=1,train.eval_every=3,train.eval_batches=2,"
        "train.layer_stats_every=2,train.progress_bar=false,checkpoint.every=3,"
        "checkpoint.async_save=false,train.wandb=offline,train.wandb_project=tests")

_BLOCK = 32768
_RECORD_HEADER = struct.Struct("<IHB")  # CRC-32 of type + data, data length, type
_FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path):
  """Every Record of a .wandb file, in order; a bad checksum or header fails the test."""
  with open(path, "rb") as f:
    data = f.read()
  assert _FILE_HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), data[:7]
  position, pieces, records = _FILE_HEADER.size, [], []
  while position + _RECORD_HEADER.size <= len(data):
    left_in_block = _BLOCK - position % _BLOCK
    if left_in_block < _RECORD_HEADER.size:  # a block's tail too short for a header: padding
      position += left_in_block
      continue
    checksum, length, kind = _RECORD_HEADER.unpack_from(data, position)
    if (checksum, length, kind) == (0, 0, 0):  # zero padding to the block's end
      position += left_in_block
      continue
    start = position + _RECORD_HEADER.size
    chunk = data[start:start + length]
    assert len(chunk) == length and kind in (_FULL, _FIRST, _MIDDLE, _LAST), (position, kind)
    assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"bad CRC at {position}"
    position = start + length
    pieces = [chunk] if kind in (_FULL, _FIRST) else pieces + [chunk]
    if kind in (_FULL, _LAST):
      record = wandb_pb2.Record()
      record.ParseFromString(b"".join(pieces))
      records.append(record)
  return records


def _offline_run(path):
  """(run id, config {key: value}, history {step: {key: value}}, summary {key: value})."""
  records = _records(path)
  runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
  assert len(runs) == 1, path
  config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
  history, summary = {}, {}
  for record in records:
    kind = record.WhichOneof("record_type")
    if kind == "history":
      row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
             for item in record.history.item}
      step = int(row["_step"])
      assert step not in history, f"step {step} sent twice"
      history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    elif kind == "summary":
      for item in record.summary.update:
        summary["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
  return runs[0].run_id, config, history, summary


def _runs_in(workdir):
  """The offline run files of `workdir`, oldest process first."""
  return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))


def _jsonl_rows(workdir):
  """metrics.jsonl as W&B rows, {step: {split/name: value}}; a later line wins."""
  rows = {}
  for record in metrics.read_metrics(workdir):
    row = rows.setdefault(record["step"], {})
    for name, value in record.items():
      if name not in ("step", "split"):
        row[f"{record['split']}/{name}"] = value
  return rows


def _assert_same_rows(actual, expected):
  assert sorted(actual) == sorted(expected)
  for step, row in expected.items():
    assert sorted(actual[step]) == sorted(row), step
    for name, value in row.items():
      got = actual[step][name]
      assert got == value or (math.isnan(got) and math.isnan(value)), (step, name, got, value)


def _probe(every=2):
  """A StepLogger like the Hessian log: written at step t before step t-1's train metrics,
  the order that W&B (which drops a row below its newest step) would lose."""
  make = lambda setup: lambda state, tokens, step: {"step_squared": float(step * step)}
  return train_lib.StepLogger(split="probe", every=every, make=make)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
  """W&B silent and offline, with its settings, cache and data under tmp_path, not $HOME."""
  for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_ENTITY",
               "WANDB_RESUME", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_API_KEY"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
  for name in ("CONFIG", "CACHE", "DATA"):
    monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / "wandb_home" / name.lower()))
  return tmp_path


def test_offline_run_holds_the_config_every_scalar_and_the_summary_and_resumes(wandb_env):
  workdir = str(wandb_env / "run")
  config = config_lib.get_config(TINY + ",train.steps=6")
  summary = train_lib.train(config, workdir, loggers=[_probe()])
  first_rows = _jsonl_rows(workdir)
  assert {"train/loss", "eval/loss", "probe/step_squared", "layers/collapse/token_cosine",
          "layers/residual_rms/layer_00"} <= {k for row in first_rows.values() for k in row}

  [first] = _runs_in(workdir)
  run_id, logged_config, history, logged_summary = _offline_run(first)
  assert run_id == tracking.run_id(workdir)
  assert run_id.startswith("run-")
  assert {k: v for k, v in logged_config.items() if k != "_wandb"} == config.to_dict()
  _assert_same_rows(history, first_rows)  # every scalar, same name, step and value
  for name, value in json.load(open(os.path.join(workdir, "summary.json"))).items():
    assert logged_summary[name] == value, name

  # The same workdir trained further: a second offline file of the same run id, whose rows
  # and the first's (a later value wins, as in metrics.jsonl) are metrics.jsonl's.
  config.train.steps = 10
  train_lib.train(config, workdir, loggers=[_probe()])
  first_again, second = _runs_in(workdir)
  assert first_again == first
  resumed_id, resumed_config, resumed_history, _ = _offline_run(second)
  assert resumed_id == run_id
  assert resumed_config["train"]["steps"] == 10
  assert min(resumed_history) >= summary["final_step"]
  merged = {step: dict(row) for step, row in history.items()}
  for step, row in resumed_history.items():
    merged.setdefault(step, {}).update(row)
  _assert_same_rows(merged, _jsonl_rows(workdir))
  assert max(_jsonl_rows(workdir)) == 10

  # W&B's files of the run lie in WORKDIR/wandb/; only its service's own debug log goes to
  # its cache folder (WANDB_CACHE_DIR, here under wandb_home).
  outside = [os.path.join(root, name) for root, _, files in os.walk(wandb_env) for name in files
             if not os.path.join(root, name).startswith(
                 (workdir + os.sep, str(wandb_env / "wandb_home") + os.sep))]
  assert outside == []


def test_a_run_that_raises_is_finished_as_failed_with_its_rows_sent(wandb_env):
  def make(setup):
    def measure(state, tokens, step):
      if step == 4:
        raise RuntimeError("the probe broke")
      return {"step_squared": float(step * step)}
    return measure

  workdir = str(wandb_env / "broken")
  with pytest.raises(RuntimeError, match="the probe broke"):
    train_lib.train(config_lib.get_config(TINY + ",train.steps=6"), workdir,
                    loggers=[train_lib.StepLogger(split="probe", every=2, make=make)])
  [path] = _runs_in(workdir)
  exits = [r.exit for r in _records(path) if r.WhichOneof("record_type") == "exit"]
  assert [e.exit_code for e in exits] == [1]
  _, _, history, _ = _offline_run(path)
  _assert_same_rows(history, _jsonl_rows(workdir))
  assert max(history) == 3


def test_run_id_is_stable_per_workdir_and_distinct_for_repeated_folder_names(tmp_path):
  pre, post = tmp_path / "pre" / "seed1", tmp_path / "post" / "seed1"
  assert tracking.run_id(pre) == tracking.run_id(str(pre) + os.sep) == tracking.run_id(
      os.path.relpath(pre))
  assert tracking.run_id(pre) != tracking.run_id(post)
  assert tracking.run_id(pre).startswith("seed1-")
  assert tracking.run_id(tmp_path / "a b:c;d'e").startswith("a_b_c_d_e-")


def test_missing_package_is_one_error_naming_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  config = config_lib.get_config(TINY + ",train.steps=2")
  with pytest.raises(ValueError) as info:
    train_lib.validate(config)
  message = str(info.value)
  assert message.startswith("train.wandb='offline' needs the wandb package")
  assert 'pip install -e ".[wandb]"' in message and "\n" not in message
  config.train.wandb = "off"
  train_lib.validate(config)  # off never imports it


def test_a_run_w_and_b_refuses_to_start_is_one_line_naming_the_mode(wandb_env, monkeypatch):
  import wandb  # pylint: disable=g-import-not-at-top

  def refuse(**kwargs):
    raise wandb.errors.UsageError("api_key not configured (no-tty).\ncall wandb.login(key=...)")

  monkeypatch.setattr(wandb, "init", refuse)
  config = config_lib.get_config(TINY.replace("wandb=offline", "wandb=online"))
  workdir = wandb_env / "run"
  with pytest.raises(RuntimeError) as info:
    train_lib.train(config, str(workdir))
  assert str(info.value).startswith("train.wandb=online: W&B could not start the run: "
                                    "api_key not configured (no-tty).")
  assert "\n" not in str(info.value)
  assert not (workdir / "config.json").exists() and not (workdir / "metrics.jsonl").exists()
