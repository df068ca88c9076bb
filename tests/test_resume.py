"""Resuming train.train: after SIGKILL, after SIGTERM (preemption), and on a wrong config.

Training runs in subprocesses (tests/run_training.py) so they can be killed for real. All runs
share one persistent compilation cache, filled by the uninterrupted reference run, so the
later processes skip compiling; the cache changes no numerics (the same executable comes back).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics
from geonorm_jax.training import train as train_lib

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_training.py")
STEPS = 30
CONFIG = ("tiny,num_layers=1,d_model=32,num_heads=2,seq_len=32,batch_size=8,max_seq_len=32,"
          f"train.steps={STEPS},train.warmup_steps=5,train.log_every=1,train.eval_every=10,"
          # The progress bar (stderr, not a tty) prints one line per step of a 30-step run:
          # its first line tells at which step a run started.
          "train.eval_batches=2,train.progress_bar=true,checkpoint.every=5,"
          # No per-layer statistics: only losses are compared, and one program less compiles.
          "train.layer_stats_every=0")
TIMEOUT_S = 120
# Sleep before each batch of a run we are going to signal, so that polling metrics.jsonl
# catches it mid-way even when a step takes a few milliseconds. Killed at step 16 or 17, the
# run is 0.6 s or more away from its next checkpoint (step 20), which the resume must not use.
STEP_DELAY_S = 0.2

pytestmark = pytest.mark.slow  # training subprocesses, killed for real


class _Run:
  """One driver subprocess, its output going to files (a pipe could fill up and block it)."""

  def __init__(self, workdir, cache_dir, step_delay=0.0, config=CONFIG):
    self.workdir = str(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    tag = len([f for f in os.listdir(self.workdir) if f.startswith("stdout")])
    self.stdout_path = os.path.join(self.workdir, f"stdout.{tag}.txt")
    self.stderr_path = os.path.join(self.workdir, f"stderr.{tag}.txt")
    with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
      self.proc = subprocess.Popen(
          [sys.executable, DRIVER, config, self.workdir, "--devices", "8",
           "--cache_dir", str(cache_dir), "--step_delay", str(step_delay)],
          stdout=out, stderr=err)

  def stdout(self):
    with open(self.stdout_path) as f:
      return f.read()

  def stderr(self):
    with open(self.stderr_path) as f:
      return f.read()

  def describe(self):
    return (f"returncode={self.proc.returncode}\n--- stdout ---\n{self.stdout()[-3000:]}"
            f"\n--- stderr ---\n{self.stderr()[-5000:]}")

  def wait(self, expect_rc=0):
    try:
      self.proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      pytest.fail(f"training run timed out after {TIMEOUT_S}s\n{self.describe()}")
    if expect_rc is not None:
      assert self.proc.returncode == expect_rc, self.describe()
    return self

  def wait_for_step(self, step):
    """Blocks until metrics.jsonl holds a train record of `step` or later."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
      if _max_train_step(self.workdir) >= step:
        return
      if self.proc.poll() is not None:
        pytest.fail(f"run exited before step {step}\n{self.describe()}")
      time.sleep(0.02)
    self.proc.kill()
    self.proc.wait()
    pytest.fail(f"no step {step} within {TIMEOUT_S}s\n{self.describe()}")

  def first_progress_step(self):
    steps = re.findall(rf"^step (\d+)/{STEPS} ", self.stderr(), flags=re.M)
    assert steps, self.describe()
    return int(steps[0])

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def _max_train_step(workdir):
  return max((r["step"] for r in metrics.read_metrics(workdir) if r["split"] == "train"),
             default=0)


def _losses(workdir, split):
  """{step: loss} of one split; each step must appear once (a resume truncates the rest)."""
  records = [r for r in metrics.read_metrics(workdir) if r["split"] == split]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"{split} steps logged twice in {workdir}: {steps}"
  return {r["step"]: r["loss"] for r in records}


def _checkpoint_steps(workdir):
  # Finished checkpoints only: orbax writes into a temporary name and renames when done.
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run: workdir, compilation cache, and every step's train/eval loss."""
  root = tmp_path_factory.mktemp("resume")
  cache_dir = root / "jax_cache"
  workdir = root / "reference"
  run = _Run(workdir, cache_dir).wait()
  train_losses, eval_losses = _losses(workdir, "train"), _losses(workdir, "eval")
  assert sorted(train_losses) == list(range(1, STEPS + 1)), run.describe()
  assert sorted(eval_losses) == [10, 20, 30], run.describe()
  assert "INIT_STATE" in run.stdout()
  return dict(workdir=str(workdir), cache_dir=str(cache_dir), train=train_losses,
              eval=eval_losses)


def _check_resumed(run, resume_from, reference):
  """The rerun restored `resume_from` (no fresh init) and then matched the reference bit for bit."""
  assert "INIT_STATE" not in run.stdout(), f"rerun started from fresh parameters\n{run.describe()}"
  assert run.first_progress_step() == resume_from + 1, run.describe()
  summary = _summary(run.workdir)
  assert summary["final_step"] == STEPS and not summary["preempted"], summary
  # Exact equality: same data, same state, same executables, so not one bit may differ.
  assert _losses(run.workdir, "train") == reference["train"]
  assert _losses(run.workdir, "eval") == reference["eval"]


def test_sigkill_then_rerun_resumes_bit_identically(reference, tmp_path):
  workdir = tmp_path / "killed"
  run = _Run(workdir, reference["cache_dir"], step_delay=STEP_DELAY_S)
  try:
    run.wait_for_step(16)
    run.proc.send_signal(signal.SIGKILL)
  finally:
    run.kill()
  assert run.proc.returncode == -signal.SIGKILL, run.describe()
  logged = _max_train_step(workdir)
  saved = _checkpoint_steps(workdir)
  assert saved and not os.path.exists(workdir / "summary.json"), run.describe()
  resume_from = saved[-1]
  # Steps after the checkpoint were logged and lost: the resume must redo them.
  assert 0 < resume_from < logged < STEPS, (saved, logged)

  rerun = _Run(workdir, reference["cache_dir"]).wait()
  _check_resumed(rerun, resume_from, reference)


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT],
                         ids=["sigterm", "ctrl_c"])
def test_a_signal_saves_exits_cleanly_and_rerun_matches(reference, tmp_path, signal_number):
  """SIGTERM is a preemption; SIGINT (Ctrl-C) used to lose every step since the last
  checkpoint, with a traceback, and now saves the same way."""
  workdir = tmp_path / "stopped"
  run = _Run(workdir, reference["cache_dir"], step_delay=STEP_DELAY_S)
  try:
    run.wait_for_step(12)
    run.proc.send_signal(signal_number)
    run.wait(expect_rc=0)
  finally:
    run.kill()
  assert "Traceback" not in run.stderr(), run.describe()
  summary = _summary(workdir)
  assert summary["preempted"] is True, summary
  assert summary["interrupted"] is (signal_number == signal.SIGINT), summary
  stopped = summary["final_step"]
  assert 12 <= stopped < STEPS, summary
  # The save is of the very step it stopped at, off the checkpoint.every grid or on it.
  assert _checkpoint_steps(workdir)[-1] == stopped, _checkpoint_steps(workdir)
  assert _max_train_step(workdir) == stopped

  rerun = _Run(workdir, reference["cache_dir"]).wait()
  _check_resumed(rerun, stopped, reference)


def _snapshot(workdir):
  """(relative path, is dir, size, mtime_ns) of everything under workdir but its own entry."""
  entries = []
  for root, dirs, files in os.walk(workdir):
    for name in dirs + files:
      path = os.path.join(root, name)
      stat = os.stat(path)
      entries.append((os.path.relpath(path, workdir), os.path.isdir(path), stat.st_size,
                      stat.st_mtime_ns))
  return sorted(entries)


def test_incompatible_config_raises_and_leaves_workdir_untouched(reference):
  workdir = reference["workdir"]
  before = _snapshot(workdir)
  assert _checkpoint_steps(workdir)
  config = config_lib.get_config(CONFIG.replace("d_model=32", "d_model=64")
                                 + ",train.progress_bar=false")
  # In-process (8 fake devices from conftest): it must fail before compiling anything.
  with pytest.raises(ValueError, match=r"model\.d_model: checkpoint=32, current=64") as info:
    train_lib.train(config, workdir)
  assert "Nothing was deleted" in str(info.value)
  assert _snapshot(workdir) == before


