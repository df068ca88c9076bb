"""Sweeps as train commands: the command line of a run, skipping finished runs, aggregation,
and one real run of the shakespeare experiment at its smallest settings."""
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from geonorm_jax.studies import sweep
from geonorm_jax.training import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_run_is_the_cli_train_command(tmp_path):
  run = sweep.Run("post/seed2", "configs/shakespeare.py", "placement=post", 2, str(tmp_path))
  command = run.command(python="python")
  assert command[:4] == ["python", "-m", "geonorm_jax", "train"]
  assert "--config=configs/shakespeare.py:placement=post" in command
  assert "--config.seed=2" in command and "--config.data.seed=2" in command
  assert f"--workdir={tmp_path}/post/seed2" in command


def test_every_variant_is_a_valid_preset():
  for name, overrides in sweep.PLACEMENT_VARIANTS.items():
    config = config_lib.get_config("tiny," + overrides)
    assert config.model.placement in name or name.startswith(config.model.placement), name


def test_finished_runs_are_skipped_and_grid_names_are_unique(tmp_path, capsys):
  runs = sweep.placement_grid(["pre", "post"], ["false", "true"], ["1e-3"], [0, 1], 10,
                              "configs/shakespeare.py", str(tmp_path))
  assert len({run.name for run in runs}) == 8
  for run in runs:
    os.makedirs(run.workdir)
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump({"final_eval_loss": 3.0, "preempted": False}, f)
  assert sweep.run_all(runs, jobs=2) == []
  assert "8 of 8 runs already finished; 0 to run" in capsys.readouterr().out
  sweep.print_commands(runs[:1])
  printed = capsys.readouterr().out.strip()
  assert shlex.split(printed) == runs[0].command(python="python")


def test_aggregate_gives_mean_sample_std_and_range():
  rows = [{"v": "a", "loss": 1.0}, {"v": "a", "loss": 3.0}, {"v": "b", "loss": 2.0},
          {"v": "a", "loss": float("nan")}]
  stats = {s["v"]: s for s in sweep.aggregate(rows, ["v"], "loss")}
  assert stats["a"]["n"] == 3 and stats["a"]["mean"] == 2.0
  assert stats["a"]["std"] == pytest.approx(np.std([1.0, 3.0], ddof=1))
  assert (stats["a"]["min"], stats["a"]["max"]) == (1.0, 3.0)
  assert stats["b"]["n"] == 1 and np.isnan(stats["b"]["std"])


@pytest.mark.slow
def test_shakespeare_experiment_writes_its_table(tmp_path):
  out = tmp_path / "out"
  subprocess.run([sys.executable, "experiments/shakespeare.py", "--variants=pre", "--seeds=0",
                  "--extra=steps=3,warmup_steps=1,eval_batches=1,eval_every=3,"
                  "layer_stats_every=2,model.num_layers=1,model.d_model=32,model.num_heads=2",
                  f"--root={tmp_path / 'runs'}", f"--out={out}"], cwd=REPO, check=True)
  header = (out / "results.csv").read_text().splitlines()[0].split(",")
  for column in ("variant", "seed", "final_eval_loss", "token_cosine", "logit_spread"):
    assert column in header
  table = (out / "table.md").read_text()
  assert "| pre | 1 |" in table
  assert json.loads((out / "config.json").read_text())["variants"] == {"pre": "placement=pre"}
