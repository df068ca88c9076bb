"""Faults a long job meets, each reproduced on a tiny model and shown handled: divergence,
corrupt checkpoints, failed saves, two trainers on one workdir, old checkpoints, reruns of
finished runs, and nonsense config values.

Training runs in-process (8 fake CPU devices from conftest) unless a real process boundary is
the point (a lock held by a killed process).
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import paths
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics
from geonorm_jax.training import train as train_lib

STEPS = 30
# No per-layer statistics (nothing here reads them: one program less to compile per run, and a
# smaller train step); the divergence message's per-layer gradient norms are always computed.
TINY = ("tiny,num_layers=2,d_model=32,num_heads=2,seq_len=16,max_seq_len=16,batch_size=8,"
        "train.warmup_steps=3,train.log_every=1,train.eval_every=10,train.eval_batches=2,"
        "train.layer_stats_every=0,train.progress_bar=false,checkpoint.every=10,"
        "checkpoint.keep_last=3")


def _config(extra=""):
  return config_lib.get_config(f"{TINY},train.steps={STEPS}" + (f",{extra}" if extra else ""))


def _records(workdir, split):
  return [r for r in metrics.read_metrics(workdir) if r["split"] == split]


def _losses(workdir, split="train"):
  records = _records(workdir, split)
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"{split} steps logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


def _steps_on_disk(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _snapshot(workdir, ignore=()):
  entries = []
  for root, dirs, files in os.walk(workdir):
    for name in dirs + files:
      path = os.path.join(root, name)
      if name in ignore:
        continue
      stat = os.stat(path)
      entries.append((os.path.relpath(path, workdir), stat.st_size, stat.st_mtime_ns))
  return sorted(entries)


def _params_finite(workdir, step):
  _, _, state = train_lib.restore_params(workdir, step)
  return all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(state["params"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A good 30-step run, checkpoints 10, 20, 30; its losses are the ground truth."""
  workdir = str(tmp_path_factory.mktemp("faults") / "reference")
  summary = train_lib.train(_config(), workdir)
  assert summary["final_step"] == STEPS and summary["skipped_steps"] == 0
  assert _steps_on_disk(workdir) == [10, 20, 30]
  return dict(workdir=workdir, train=_losses(workdir), eval=_losses(workdir, "eval"),
              summary=summary)


def _copy(reference, tmp_path, name="run"):
  target = str(tmp_path / name)
  shutil.copytree(reference["workdir"], target)
  return target


# --- 1. divergence ----------------------------------------------------------------------------


def test_divergence_stops_naming_the_step_and_keeps_every_finite_checkpoint(reference, tmp_path):
  """The issue's case: a good run resumed with lr=1e3 ran on in NaN, exited 0, and keep-last
  rotation (keep_last=3) replaced every finite checkpoint with a NaN one. (A fresh run that
  diverges before its first checkpoint: tests/test_cli.py, exit code 3.)"""
  workdir = _copy(reference, tmp_path)
  config = _config("train.lr=1e3")
  config.train.steps = 70
  with pytest.raises(train_lib.DivergenceError) as info:
    train_lib.train(config, workdir)
  message, step = str(info.value), info.value.step
  assert f"diverged at step {step}:" in message and 30 < step <= 70
  assert "layer_00=" in message and "layer_01=" in message and "embed=" in message
  assert "checkpoint step 30 (finite) is the newest and was kept" in message
  assert _steps_on_disk(workdir) == [10, 20, 30]
  assert _params_finite(workdir, 30)
  assert max(r["step"] for r in _records(workdir, "train")) < step  # logged up to the last good
  assert [r["step"] for r in _records(workdir, "events") if "diverged" in r] == [step]


def test_skip_policy_drops_non_finite_updates_and_counts_them(tmp_path):
  workdir = str(tmp_path / "skipped")
  summary = train_lib.train(_config("train.lr=1e3,train.on_divergence=skip"), workdir)
  assert summary["final_step"] == STEPS
  skipped = [r for r in _records(workdir, "events") if r.get("skipped")]
  assert summary["skipped_steps"] == len(skipped) > 0
  assert [r["skipped_total"] for r in skipped] == list(range(1, len(skipped) + 1))
  assert all(not np.isfinite(r["loss"]) or not np.isfinite(r["grad_norm"]) for r in skipped)
  for step in _steps_on_disk(workdir):
    assert _params_finite(workdir, step)


def test_give_up_ends_a_run_whose_loss_stays_above_its_start(tmp_path, reference):
  """train.give_up_steps: lr=1e3 (updates skipped or loss far above the start) ends the run
  after that many consecutive steps above its first loss, with an eval and a summary; a good
  run never gives up."""
  workdir = str(tmp_path / "gave_up")
  summary = train_lib.train(_config("train.lr=1e3,train.on_divergence=skip,"
                                    "train.give_up_steps=3"), workdir)
  losses = {r["step"]: r["loss"] for r in _records(workdir, "train")}
  first = losses[min(losses)]
  step = summary["gave_up_step"]
  assert step is not None and step < STEPS and summary["final_step"] in (step, step + 1)
  above = [not np.isfinite(losses[t]) or losses[t] > first for t in range(step - 2, step + 1)]
  assert all(above)  # the three steps up to the give-up step were all above the start
  assert [r["step"] for r in _records(workdir, "events") if r.get("gave_up")] == \
      [summary["final_step"]]
  assert np.isfinite(summary["final_eval_loss"])
  assert reference["summary"]["gave_up_step"] is None


def test_skip_keeps_params_and_optimizer_state_bit_for_bit():
  """Inside the jitted step: a non-finite loss leaves params and opt_state exactly as they
  were, and the step counter advances (so the data stays in step)."""
  config = _config("train.on_divergence=skip")
  setup = train_lib.make_setup(config, jax.devices()[:1])
  state = train_lib.init_state(setup)
  # A poisoned embedding makes the loss non-finite for every batch.
  poison = lambda path, leaf: leaf * jnp.nan if "embed" in paths.path_to_string(path) else leaf
  state = dict(state, params=jax.tree_util.tree_map_with_path(poison, state["params"]))
  before = jax.device_get(state)
  tokens = train_lib.global_batch(setup, next(data_lib.make_train_iterator(config)))
  after, step_metrics = train_lib.make_train_step(setup)(state, tokens)
  assert float(step_metrics["nonfinite"]) == 1.0
  assert int(after["step"]) == 1
  after = jax.device_get(after)
  for old, new in zip(jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"]),
                      jax.tree.leaves(after["params"]) + jax.tree.leaves(after["opt_state"])):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


# --- 2. corrupt checkpoints -------------------------------------------------------------------


def _corrupt(workdir, kind, step=30):
  step_dir = os.path.join(workdir, "checkpoints", str(step))
  if kind == "truncated_array_file":
    data_dir = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
    largest = max(os.listdir(data_dir), key=lambda n: os.path.getsize(os.path.join(data_dir, n)))
    os.truncate(os.path.join(data_dir, largest), 100)
  elif kind == "garbage_state_metadata":
    with open(os.path.join(step_dir, "state", "_METADATA"), "w") as f:
      f.write("garbage")
  elif kind == "truncated_data_metadata":
    os.truncate(os.path.join(step_dir, "data", "metadata"), 5)
  elif kind == "empty_step_dir":
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)


@pytest.mark.parametrize("kind", ["truncated_array_file", "garbage_state_metadata",
                                  "truncated_data_metadata", "empty_step_dir"])
def test_unreadable_latest_checkpoint_is_set_aside_and_the_previous_one_used(
    reference, tmp_path, kind):
  workdir = _copy(reference, tmp_path)
  _corrupt(workdir, kind)
  config = _config()
  setup = train_lib.make_setup(config)
  with checkpoint_lib.Checkpointer(workdir, config.checkpoint,
                                   checkpoint_lib.config_fingerprint(config)) as ckpt:
    state, _ = train_lib.restore_state(ckpt, None, setup)
    assert int(state["step"]) == 20
    assert len(ckpt.set_aside) == 1 and "step 30" in ckpt.set_aside[0]
  assert _steps_on_disk(workdir) == [10, 20]
  set_aside = os.listdir(os.path.join(workdir, checkpoint_lib.SET_ASIDE_SUBDIR))
  assert len(set_aside) == 1 and set_aside[0].startswith("30.")  # moved, not deleted


def test_training_resumes_past_a_corrupt_checkpoint_bit_identically(reference, tmp_path):
  workdir = _copy(reference, tmp_path)
  _corrupt(workdir, "truncated_array_file")
  summary = train_lib.train(_config(), workdir)
  assert summary["final_step"] == STEPS and "already_finished" not in summary
  assert _losses(workdir) == reference["train"]
  assert _losses(workdir, "eval") == reference["eval"]


def test_eval_reads_params_only_falls_back_and_writes_nothing(reference, tmp_path):
  workdir = _copy(reference, tmp_path)
  _corrupt(workdir, "truncated_data_metadata", step=30)  # eval never reads the data state
  result = train_lib.evaluate(None, workdir)
  assert result["step"] == 30
  assert result["eval_loss"] == pytest.approx(reference["eval"][30], rel=1e-6)
  _corrupt(workdir, "garbage_state_metadata", step=30)
  before = _snapshot(workdir)
  assert train_lib.evaluate(None, workdir)["step"] == 20  # falls back; read-only: not moved
  assert _snapshot(workdir) == before


def test_explicit_step_that_cannot_be_read_names_step_and_reason(reference, tmp_path):
  workdir = _copy(reference, tmp_path)
  _corrupt(workdir, "garbage_state_metadata", step=20)
  with pytest.raises(checkpoint_lib.NoValidCheckpointError, match=r"checkpoints/20 cannot be read"):
    train_lib.evaluate(None, workdir, step=20)
  with pytest.raises(checkpoint_lib.NoValidCheckpointError, match=r"no checkpoint step 25"):
    train_lib.evaluate(None, workdir, step=25)


def test_eval_on_a_mistyped_workdir_creates_nothing(tmp_path):
  typo = tmp_path / "typo"
  with pytest.raises(FileNotFoundError):
    train_lib.evaluate(_config(), str(typo))
  assert not typo.exists()


def test_train_step_flag_resumes_from_an_older_checkpoint(reference, tmp_path):
  workdir = _copy(reference, tmp_path)
  summary = train_lib.train(_config(), workdir, step=10)
  assert summary["final_step"] == STEPS
  assert _losses(workdir) == reference["train"]
  moved = sorted(os.listdir(os.path.join(workdir, checkpoint_lib.SET_ASIDE_SUBDIR)))
  assert [name.split(".")[0] for name in moved] == ["20", "30"]
  assert _steps_on_disk(workdir) == [10, 20, 30]  # saved again by the new continuation


# --- 3. failed saves ---------------------------------------------------------------------------


def test_failed_save_is_reported_and_the_rerun_logs_no_step_twice(reference, tmp_path):
  workdir = str(tmp_path / "full_disk")
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  # A file-size limit: the checkpoint's array file is refused, metrics (small lines) are not.
  resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, hard))
  try:
    with pytest.raises(checkpoint_lib.CheckpointSaveError, match="saving checkpoint step 10"):
      train_lib.train(_config(), workdir)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  assert not [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
  summary = train_lib.train(_config(), workdir)
  assert summary["final_step"] == STEPS
  assert _losses(workdir) == reference["train"]  # no duplicates, the same numbers


# --- 4. one trainer per workdir ----------------------------------------------------------------


def test_a_second_trainer_meets_the_lock_and_writes_nothing(reference, tmp_path):
  workdir = _copy(reference, tmp_path)
  config = _config()
  config.train.steps = 40
  with checkpoint_lib.WorkdirLock(workdir):
    before = _snapshot(workdir)
    with pytest.raises(checkpoint_lib.WorkdirBusyError, match=f"pid {os.getpid()}"):
      train_lib.train(config, workdir)
    assert _snapshot(workdir) == before
  assert not os.path.exists(os.path.join(workdir, checkpoint_lib.LOCK_FILENAME))


def test_a_killed_trainer_leaves_no_stuck_lock(tmp_path):
  workdir = str(tmp_path / "run")
  holder = subprocess.Popen(
      [sys.executable, "-c",
       "import sys, time; from geonorm_jax.training import checkpoint as c; "
       "lock = c.WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)",
       workdir], stdout=subprocess.PIPE, text=True,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(checkpoint_lib.WorkdirBusyError, match=f"pid {holder.pid}"):
      checkpoint_lib.WorkdirLock(workdir).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  finally:
    holder.kill()
    holder.wait()
  assert os.path.exists(os.path.join(workdir, checkpoint_lib.LOCK_FILENAME))  # file stays
  with checkpoint_lib.WorkdirLock(workdir):  # the lock does not
    pass


# --- 5. fingerprint -----------------------------------------------------------------------------


def test_a_key_absent_from_an_old_checkpoint_counts_as_its_default():
  current = checkpoint_lib.config_fingerprint(config_lib.get_base_config())
  old = {k: v for k, v in current.items() if k != "model.geo_radius"}
  assert checkpoint_lib.differing_fields(old, current) == []
  changed = config_lib.get_base_config()
  changed.model.geo_radius = "embedding"
  assert checkpoint_lib.differing_fields(old, checkpoint_lib.config_fingerprint(changed)) == [
      "model.geo_radius: checkpoint='sqrt_d', current='embedding'"]


def test_a_rewritten_data_file_changes_the_fingerprint(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("hello world " * 100)
  config = _config(f"data.source=text,data.path={path}")
  first = checkpoint_lib.config_fingerprint(config, with_data_content=True)
  path.write_text("HELLO WORLD " * 100)  # same size, same name
  second = checkpoint_lib.config_fingerprint(config, with_data_content=True)
  assert checkpoint_lib.differing_fields(first, second)[0].startswith("data.content:")
  assert "data.content" not in checkpoint_lib.config_fingerprint(config)


def test_eval_reads_other_data(reference, tmp_path):
  other = tmp_path / "other.txt"
  other.write_text("".join(chr(32 + i % 90) for i in range(5000)))
  config = _config(f"data.source=text,data.path={other}")
  result = train_lib.evaluate(config, reference["workdir"])
  assert result["step"] == STEPS and np.isfinite(result["eval_loss"])
  assert result["eval_loss"] != pytest.approx(reference["eval"][STEPS])


# --- 6. a finished run rerun ------------------------------------------------------------------


def test_rerunning_a_finished_run_says_so_and_leaves_its_files_alone(reference, capsys):
  before = _snapshot(reference["workdir"])
  summary = train_lib.train(_config(), reference["workdir"])
  assert summary["already_finished"] is True
  assert summary["final_step"] == STEPS
  assert summary["tokens_per_s"] == reference["summary"]["tokens_per_s"]
  assert "already finished at step 30" in capsys.readouterr().err
  assert _snapshot(reference["workdir"]) == before


# --- 7/8. nonsense values refused before compilation, naming the field -------------------------


@pytest.mark.parametrize("override,field", [
    ("train.lr=-1", "train.lr"), ("train.lr=0", "train.lr"), ("train.steps=0", "train.steps"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
    ("checkpoint.every=-5", "checkpoint.every"),
    ("checkpoint.keep_every=-1", "checkpoint.keep_every"),
    ("train.clip_norm=-1", "train.clip_norm"), ("train.b1=1.5", "train.b1"),
    ("train.b2=-1", "train.b2"), ("train.weight_decay=-1", "train.weight_decay"),
    ("model.geo_alpha=-1", "model.geo_alpha"),
    ("model.ngpt_alpha_init=-1", "model.ngpt_alpha_init"),
    ("train.hessian_every=-1", "train.hessian_every"), ("model.rope_theta=0", "model.rope_theta"),
    ("train.min_lr_ratio=-3", "train.min_lr_ratio"),
    ("mesh.distributed=maybe", "mesh.distributed"),
    ("train.on_divergence=ignore", "train.on_divergence"),
    ("train.spike_zscore=-1", "train.spike_zscore"),
    ("train.spike_warmup=1", "train.spike_warmup"),
    ("train.spike_warmup=500", "train.spike_warmup"),
    ("train.wandb=maybe", "train.wandb"),
    ("train.wandb=online,train.wandb_project=", "train.wandb_project"),
    ("train.wandb=offline,train.wandb_project=team/study", "train.wandb_project"),
    ("train.wandb=offline,train.wandb_id=run:1", "train.wandb_id"),
    ("model.z_loss=-1", "model.z_loss"),
])
def test_invalid_values_are_refused_naming_the_field(override, field):
  with pytest.raises(ValueError) as info:
    train_lib.validate(_config(override))
  assert str(info.value).startswith(field + "=")
  assert "\n" not in str(info.value)


def test_garbage_and_unreadable_data_files_are_named(tmp_path):
  garbage = tmp_path / "garbage.array_record"
  garbage.write_bytes(os.urandom(4096))
  with pytest.raises(ValueError, match="garbage.array_record"):
    train_lib.validate(_config(f"data.source=array_record,data.path={garbage}"))
  directory = tmp_path / "a_directory.txt"
  directory.mkdir()
  with pytest.raises((ValueError, FileNotFoundError), match="a_directory.txt"):
    train_lib.validate(_config(f"data.source=text,data.path={directory}"))


# --- 9. writes stay inside the workdir --------------------------------------------------------


def test_summary_and_config_writes_replace_symlinks_instead_of_following_them(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("precious")
  workdir = tmp_path / "run"
  workdir.mkdir()
  for name in ("summary.json", "config.json"):
    os.symlink(outside, workdir / name)
  checkpoint_lib.save_config_json(workdir, _config())
  checkpoint_lib.write_text_atomic(workdir / "summary.json", json.dumps({"a": 1}))
  assert outside.read_text() == "precious"
  assert not os.path.islink(workdir / "summary.json")
  assert json.loads((workdir / "summary.json").read_text()) == {"a": 1}

