"""The trainer's Hessian log and `python -m geonorm_jax hessian`, on a tiny trained run.

The numbers themselves are checked against dense Hessians in test_hessian*.py; here: the
plumbing (keys, files, columns, steps, progress output, resuming) and consistency relations
any correct spectrum satisfies.
"""
import csv
import json
import io
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fast_compile  # tests/ is on sys.path (no __init__.py)

pytestmark = pytest.mark.slow  # trains a run, then analyses its checkpoint end to end

from geonorm_jax.hessian import analysis as hessian_analysis, callback as hessian_callback
from geonorm_jax.hessian import cli as hessian_cli, report as hessian_report
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, optim, train

TINY = ("tiny,num_layers=1,d_model=16,num_heads=2,max_seq_len=16,seq_len=16,batch_size=8,"
        "steps=4,warmup_steps=1,eval_every=4,eval_batches=2,log_every=1,progress_bar=false,"
        "hessian_every=2,hessian_steps=8,hessian_per_block=true,checkpoint.every=2,"
        "async_save=false,layer_stats_every=0")  # no per-layer statistics: none is read
CLI_FLAGS = ["--step=all", "--lanczos_steps=12", "--probes=3", "--batches=2", "--eigenvalues=3"]
SETTINGS = hessian_analysis.Settings(num_steps=12, num_probes=3, num_batches=2, top_k=3)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("hessian_runs")
  workdir = str(root / "run_a")
  config = config_lib.get_config(TINY)
  train.train(config, workdir, loggers=hessian_callback.step_loggers(config))
  # A second run for the overlay: a copy is enough to test the comparison's plumbing.
  shutil.copytree(workdir, str(root / "run_b"))
  return config, workdir, str(root / "run_b")


@pytest.fixture(scope="module")
def analysed(trained, tmp_path_factory):
  """The CLI as a user runs it, on two runs and every checkpoint."""
  _, run_a, run_b = trained
  # Run b is a copy of run a: its programs come from the cache (tests/fast_compile.py).
  env = dict(os.environ, PYTHONPATH=REPO,
             **fast_compile.subprocess_env(tmp_path_factory.mktemp("jax_cache")))
  proc = subprocess.run(
      [sys.executable, "-m", "geonorm_jax", "hessian", f"--workdir={run_a}",
       f"--workdir={run_b}", *CLI_FLAGS], capture_output=True, text=True, env=env, cwd=REPO,
      timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout), proc.stderr


def test_trainer_logs_hessian_scalars(trained):
  config, workdir, _ = trained
  rows = [r for r in metrics.read_metrics(workdir) if r["split"] == "hessian"]
  assert [r["step"] for r in rows] == [2, 4]
  row = rows[0]
  for key in ("lambda_max", "lambda_max_bound", "lambda_min", "lambda_max_precond",
              "two_over_lr", "adam_threshold", "lambda_max/blocks.0"):
    assert math.isfinite(row[key]), key
  lr = float(optim.learning_rate_schedule(config.train)(2))
  assert row["two_over_lr"] == pytest.approx(2.0 / lr, rel=1e-6)
  b1 = config.train.b1
  assert row["adam_threshold"] == pytest.approx((2 + 2 * b1) / ((1 - b1) * lr), rel=1e-6)
  # A block of the Hessian is a principal submatrix: its top eigenvalue cannot exceed
  # the full one (Cauchy interlacing), up to the Lanczos residual.
  assert row["lambda_max/blocks.0"] <= row["lambda_max"] + row["lambda_max_bound"] + 1e-4
  assert row["lambda_min"] < 0 < row["lambda_max"] and row["lambda_max_precond"] > 0


def test_cli_prints_cost_then_progress(analysed):
  _, stderr = analysed
  # Cost first: the plan with products per estimate, then a timed product, then the bar.
  plan = stderr.index("Hessian-vector products")
  assert "top       Lanczos, 12 steps" in stderr and "SLQ, 2 probes x 12 steps" in stderr
  timed = stderr.index("one Hessian-vector product took")
  bar = stderr.index("HVP ")
  assert plan < timed and plan < bar
  assert "ETA" in stderr and "HVP 36/36" in stderr  # 12 top + 2 x 12 density products
  assert stderr.count("[1/2]") == 2 and stderr.count("[2/2]") == 2  # 2 steps x 2 runs


def test_cli_writes_per_step_files_table_and_figures(trained, analysed):
  _, run_a, run_b = trained
  summary, _ = analysed
  assert [r["steps"] for r in summary["runs"]] == [[2, 4], [2, 4]]
  for workdir in (run_a, run_b):
    out = os.path.join(workdir, "hessian")
    for step in (2, 4):
      assert os.path.getsize(os.path.join(out, f"step_{step}.png")) > 1000
      report = hessian_report.read_json(os.path.join(out, f"step_{step}.json"))
      top = report["lanczos"]["top_eigenvalues"]
      assert report["step"] == step and len(top) == 3 and top == sorted(top, reverse=True)
      assert report["lanczos"]["lambda_min"] < 0 < top[0]
      assert report["num_batches"] == 2 and report["num_tokens"] == 2 * 8 * 16
      assert report["products"] == {"top": 12, "density": 24, "trace": 0}
      grid = np.asarray(report["density"]["grid"])
      values = np.asarray(report["density"]["values"])
      assert grid[0] < report["lanczos"]["lambda_min"] and grid[-1] > top[0]
      assert np.trapezoid(values, grid) == pytest.approx(1.0, abs=1e-3)
      assert report["trace"]["stderr"] > 0 and math.isfinite(report["trace"]["estimate"])
      assert report["two_over_lr"] == pytest.approx(2 / report["lr"])
    with open(os.path.join(out, "spectra.csv")) as f:
      rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == hessian_report.COLUMNS
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert all(float(r["lambda_1"]) > 0 and float(r["two_over_lr"]) > 0 for r in rows)
    assert os.path.getsize(os.path.join(out, "spectra.png")) > 1000
  compare = summary["compare"]
  assert compare == os.path.join(os.path.dirname(run_a), "hessian_compare")
  for name in ("spectra.png", "densities.png"):
    assert os.path.getsize(os.path.join(compare, name)) > 1000


def test_rerun_skips_what_is_done(trained, analysed):
  _, run_a, _ = trained
  path = os.path.join(run_a, "hessian", "step_4.json")
  before = os.stat(path).st_mtime_ns
  stream = io.StringIO()
  hessian_cli.run([run_a], "all", settings=SETTINGS, stream=stream)
  assert stream.getvalue().count("already analysed") == 2
  assert os.stat(path).st_mtime_ns == before


def test_bad_input_names_the_field(trained):
  _, run_a, _ = trained
  with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 3; available: \[2, 4\]"):
    hessian_cli.run([run_a], "3", settings=SETTINGS)
  with pytest.raises(ValueError, match="--step='last'"):
    hessian_cli.run([run_a], "last", settings=SETTINGS)
  with pytest.raises(ValueError, match="estimates=top,curvature"):
    hessian_analysis.Settings(estimates=("top", "curvature")).validate()
  with pytest.raises(ValueError, match="top_k=60 exceeds num_steps=50"):
    hessian_analysis.Settings(top_k=60).validate()
  with pytest.raises(FileNotFoundError, match="config.json"):
    hessian_cli.run([run_a, os.path.dirname(run_a)], "all", settings=SETTINGS)
