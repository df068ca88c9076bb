"""Two JAX processes on this machine train like one process with all their devices.

Each worker (tests/run_training.py, 2 CPU devices, gloo collectives) joins a local
coordinator through config.mesh.coordinator_address, so train.train runs
jax.distributed.initialize itself, and reads only its own rows of every batch (data.py picks
them from jax.process_index()). Both write orbax checkpoints into one shared workdir.
"""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from geonorm_jax.training import metrics
from geonorm_jax.training import train as train_lib

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_training.py")
CONFIG = ("tiny,num_layers=1,d_model=32,num_heads=2,seq_len=32,batch_size=8,max_seq_len=32,"
          "train.steps=4,train.warmup_steps=2,train.log_every=1,train.eval_every=4,"
          "train.eval_batches=2,train.progress_bar=false,checkpoint.every=4,"
          # No per-layer statistics: only losses are compared, and one program less compiles.
          "train.layer_stats_every=0")
TIMEOUT_S = 150

pytestmark = pytest.mark.slow  # two worker processes


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _start(config, workdir, devices, log_prefix):
  os.makedirs(workdir, exist_ok=True)
  out = open(f"{log_prefix}.stdout", "w")
  err = open(f"{log_prefix}.stderr", "w")
  with out, err:  # the child keeps its own copies of the descriptors
    return subprocess.Popen([sys.executable, DRIVER, config, str(workdir), "--devices",
                             str(devices)], stdout=out, stderr=err)


def _describe(procs):
  parts = []
  for name, (proc, log_prefix) in procs.items():
    with open(f"{log_prefix}.stderr") as f:
      stderr = f.read()
    parts.append(f"--- {name}: returncode={proc.returncode}, stderr tail ---\n{stderr[-4000:]}")
  return "\n".join(parts)


def _wait_all(procs):
  """Waits for every process; on a timeout or a failure kills the rest and fails with stderr."""
  try:
    for proc, _ in procs.values():
      proc.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"timed out after {TIMEOUT_S}s\n{_kill_all(procs)}")
  if any(proc.returncode != 0 for proc, _ in procs.values()):
    pytest.fail(f"a training process failed\n{_kill_all(procs)}")


def _kill_all(procs):
  for proc, _ in procs.values():
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return _describe(procs)


def _series(workdir, split):
  return {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if r["split"] == split}


def test_two_processes_match_one_process(tmp_path):
  multi, single = tmp_path / "two_processes", tmp_path / "one_process"
  address = f"127.0.0.1:{_free_port()}"
  procs = {}
  try:
    # All three at once: the workers spend much of their time waiting on each other.
    for process_id in range(2):
      distributed = (f",mesh.coordinator_address={address},mesh.num_processes=2,"
                     f"mesh.process_id={process_id}")
      log_prefix = str(tmp_path / f"worker{process_id}")
      procs[f"worker {process_id}"] = (_start(CONFIG + distributed, multi, 2, log_prefix),
                                       log_prefix)
    log_prefix = str(tmp_path / "single")
    procs["single process"] = (_start(CONFIG, single, 4, log_prefix), log_prefix)
    _wait_all(procs)
  finally:
    _kill_all(procs)

  for split, steps in (("train", [1, 2, 3, 4]), ("eval", [4])):
    got, want = _series(multi, split), _series(single, split)
    assert sorted(got) == steps and sorted(want) == steps, (got, want, _describe(procs))
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=0,
                               atol=1e-5, err_msg=f"{split} losses")

  # The checkpoint both workers wrote together is whole: it restores here, onto 8 devices, to
  # the single-process run's parameters.
  assert sorted(os.listdir(multi / "checkpoints")) == ["4"]
  _, _, multi_state = train_lib.restore_params(str(multi))
  _, _, single_state = train_lib.restore_params(str(single))
  assert int(multi_state["step"]) == 4
  got, want = jax.tree.leaves(multi_state["params"]), jax.tree.leaves(single_state["params"])
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
