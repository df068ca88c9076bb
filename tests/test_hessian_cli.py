"""The trainer's Hessian log and `python -m geonorm_jax hessian`, on a tiny trained run.

The numbers themselves are checked against dense Hessians in test_hessian.py and
test_hessian_model.py; here: the plumbing (keys, files, steps) and consistency relations
any correct spectrum satisfies.
"""
import json
import math
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # trains a run, then analyses its checkpoint end to end

from geonorm_jax import config as config_lib
from geonorm_jax import hessian_cli, metrics, optim, train

TINY = ("tiny,num_layers=1,d_model=16,num_heads=2,max_seq_len=16,seq_len=16,batch_size=8,"
        "steps=2,warmup_steps=1,eval_every=2,eval_batches=2,log_every=1,progress_bar=false,"
        "hessian_every=2,hessian_steps=8,hessian_per_block=true,checkpoint.every=2,"
        "async_save=false")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("hessian_run"))
  config = config_lib.get_config(TINY)
  train.train(config, workdir)
  return config, workdir


def test_trainer_logs_hessian_scalars(trained):
  config, workdir = trained
  rows = [r for r in metrics.read_metrics(workdir) if r["split"] == "hessian"]
  assert [r["step"] for r in rows] == [2]
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


def test_hessian_command_writes_json_and_png(trained):
  _, workdir = trained
  summary = hessian_cli.run(workdir, num_steps=20, num_probes=4, num_batches=2, top_k=5)
  assert summary["step"] == 2
  assert os.path.getsize(summary["png"]) > 1000
  with open(summary["json"]) as f:
    report = json.load(f)
  top = report["lanczos"]["top_eigenvalues"]
  assert len(top) == 5 and top == sorted(top, reverse=True)
  assert len(report["lanczos"]["residual_bounds"]) == 5
  assert report["lanczos"]["lambda_min"] < 0 < top[0] == summary["lambda_max"]
  assert report["num_batches"] == 2 and report["num_tokens"] == 2 * 8 * 16
  grid, values = np.asarray(report["density"]["grid"]), np.asarray(report["density"]["values"])
  assert grid[0] < report["lanczos"]["lambda_min"] and grid[-1] > top[0]
  assert np.trapezoid(values, grid) == pytest.approx(1.0, abs=1e-3)
  # Two independent unbiased trace estimates agree within their combined error.
  slq, hutch = report["trace"]["slq"], report["trace"]["hutchinson"]
  assert abs(slq["estimate"] - hutch["estimate"]) <= 4 * math.hypot(slq["stderr"],
                                                                    hutch["stderr"])
