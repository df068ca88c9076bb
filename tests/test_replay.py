"""`replay` (training/replay.py): a stretch of a run rerun on its own batches reproduces its
numbers bit for bit; a branch writes its own folder and differs; the run's files stay
byte-identical; bad steps, names and overrides are one clear error before anything runs."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics
from geonorm_jax.training import replay as replay_lib
from geonorm_jax.training import train as train_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The devices and compiler flags of this process (conftest), so the command's mesh and sums
# are the run's own.
_EIGHT_DEVICES = dict(os.environ, JAX_PLATFORMS="cpu",
                      XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8")
STEPS = 30
# Checkpoints at 10, 20, 30; per-layer statistics every 5 steps only (a replay has them at
# every step); spikes judged with a low threshold so that the stretch holds some.
TINY = ("tiny,num_layers=1,d_model=32,num_heads=2,seq_len=16,max_seq_len=16,batch_size=8,"
        "train.warmup_steps=3,train.log_every=1,train.eval_every=10,train.eval_batches=1,"
        "train.layer_stats_every=5,train.progress_bar=false,checkpoint.every=10,"
        f"train.steps={STEPS},train.spike_zscore=0.5,train.spike_warmup=5")


def _records(workdir, split):
  return {r["step"]: r for r in metrics.read_metrics(workdir) if r["split"] == split}


def _file_digests(workdir):
  """relative path -> sha256 of every file of the run, outside replays/."""
  digests = {}
  for root, dirs, files in os.walk(workdir):
    dirs[:] = [d for d in dirs if os.path.join(root, d) != os.path.join(workdir, "replays")]
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        digests[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
  return digests


def _replays(workdir):
  directory = os.path.join(workdir, "replays")
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("replay") / "run")
  train_lib.train(config_lib.get_config(TINY), workdir)
  return dict(workdir=workdir, train=_records(workdir, "train"),
              spikes=_records(workdir, "spikes"), eval=_records(workdir, "eval"))


def _numbers(record):
  """What a step computed (not its wall-clock throughput)."""
  return {k: v for k, v in record.items() if k not in ("tokens_per_s", "mfu")}


def test_a_replay_without_overrides_reproduces_the_run_bit_for_bit(run):
  before = _file_digests(run["workdir"])
  summary = replay_lib.replay(run["workdir"], from_step=15, to_step=25)
  out = os.path.join(run["workdir"], "replays", "from15_to25")
  assert summary["replay_dir"] == out and summary["restored_step"] == 10
  assert summary["overrides"] == {} and summary["final_step"] == 25
  train = _records(out, "train")
  assert sorted(train) == list(range(11, 26))
  for step, record in train.items():
    assert _numbers(record) == _numbers(run["train"][step]), step
  spikes = _records(out, "spikes")
  assert spikes == {s: r for s, r in run["spikes"].items() if 11 <= s <= 25} and spikes
  assert _records(out, "eval")[20] == run["eval"][20]
  assert sorted(_records(out, "layers")) == list(range(10, 25))  # every step, not every 5th
  for name in ("config.json", "summary.json", "metrics.jsonl", "tensorboard"):
    assert os.path.exists(os.path.join(out, name)), name
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["train"]["layer_stats_every"] == 1
  assert not os.path.exists(os.path.join(out, "checkpoints"))
  assert _file_digests(run["workdir"]) == before
  with pytest.raises(ValueError, match="from15_to25 exists"):  # and a second one refuses
    replay_lib.replay(run["workdir"], from_step=15, to_step=25)


def test_a_replay_before_the_first_checkpoint_starts_from_the_initial_state(run):
  summary = replay_lib.replay(run["workdir"], from_step=4, to_step=8, name="early")
  assert summary["restored_step"] == 0
  train = _records(summary["replay_dir"], "train")
  assert sorted(train) == list(range(1, 9))
  for step, record in train.items():
    assert _numbers(record) == _numbers(run["train"][step]), step


@pytest.mark.slow  # a subprocess: the command as a user types it
def test_a_branch_with_a_lower_lr_writes_its_own_folder_and_leaves_the_run_alone(run):
  before = _file_digests(run["workdir"])
  result = subprocess.run(
      [sys.executable, "-m", "geonorm_jax", "replay", f"--workdir={run['workdir']}",
       "--from_step=20", "--to_step=26", "--config.train.lr=1e-4"],
      cwd=REPO_ROOT, env=_EIGHT_DEVICES, capture_output=True,
      text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  out = os.path.join(run["workdir"], "replays", "from20_to26_train.lr=0.0001")
  summary = metrics.read_summary(out)
  assert summary["overrides"] == {"train.lr": 1e-4} and summary["restored_step"] == 20
  assert summary["replay_dir"] == out and f'"replay_dir": "{out}"' in result.stdout
  train = _records(out, "train")
  assert sorted(train) == list(range(21, 27))
  # Step 21 starts from the restored parameters on the same batch; the lower LR moves
  # every later step.
  assert train[21]["loss"] == run["train"][21]["loss"]
  assert all(train[s]["loss"] != run["train"][s]["loss"] for s in range(22, 27))
  assert all(train[s]["lr"] == pytest.approx(run["train"][s]["lr"] / 10) for s in train)
  assert _file_digests(run["workdir"]) == before


def test_a_branch_that_skips_spikes_drops_them_and_counts_them(run):
  config = config_lib.get_config(TINY + ",train.skip_spikes=true")
  summary = replay_lib.replay(run["workdir"], from_step=10, to_step=30, config=config)
  out = summary["replay_dir"]
  assert os.path.basename(out) == "from10_to30_train.skip_spikes=True"
  spikes = _records(out, "spikes")
  assert spikes and all(r["skipped"] == 1.0 for r in spikes.values())
  # The run's own counts up to step 10 come from the checkpoint; it skipped none.
  before = sum(1 for s in run["spikes"] if s <= 10)
  assert summary["skipped_spikes"] == len(spikes)
  assert summary["loss_spikes"] == before + len(spikes)
  # Identical to the run up to its first spike after step 10, which the branch skips.
  first = min(s for s in run["spikes"] if s > 10)
  assert min(spikes) == first
  train = _records(out, "train")
  for step in range(11, first + 1):
    assert train[step]["loss"] == run["train"][step]["loss"], step
  assert train[first + 1]["loss"] != run["train"][first + 1]["loss"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(from_step=20, to_step=20), "--to_step=20 must be after --from_step=20"),
    (dict(from_step=-1, to_step=5), "--from_step=-1 must be >= 0"),
    (dict(from_step=20, to_step=31), "--to_step=31 is past train.steps=30"),
    (dict(from_step=10, to_step=20, name="a/b"), "--name='a/b' must be one folder name"),
    (dict(from_step=10, to_step=20, overrides="model.d_model=64"),
     "--config.model.d_model: changes the shapes"),
    (dict(from_step=10, to_step=20, overrides="model.num_layers=2,train.lr=1e-4"),
     "--config.model.num_layers: changes the shapes"),
    (dict(from_step=10, to_step=20, overrides="data.seed=3"),
     "--config.data.seed=3: a replay reruns the batches"),
    (dict(from_step=10, to_step=20, overrides="train.lr=-1"), "train.lr=-1.0 must be positive"),
])
def test_bad_steps_names_and_overrides_are_one_clear_error(run, kwargs, message):
  before = _file_digests(run["workdir"]), _replays(run["workdir"])
  overrides = kwargs.pop("overrides", "")
  config = config_lib.get_config(TINY + (f",{overrides}" if overrides else ""))
  with pytest.raises(ValueError) as info:
    replay_lib.replay(run["workdir"], config=config, **kwargs)
  assert message in str(info.value) and "\n" not in str(info.value)
  assert (_file_digests(run["workdir"]), _replays(run["workdir"])) == before


def test_a_folder_without_a_run_or_without_checkpoints_is_named(run, tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    replay_lib.replay(str(tmp_path), from_step=0, to_step=5)
  assert os.listdir(tmp_path) == []
  # A replay's own folder has a config.json but no checkpoints to start from.
  replay_dir = str(tmp_path / "a_replay")
  os.makedirs(replay_dir)
  shutil.copy(os.path.join(run["workdir"], "config.json"), replay_dir)
  with pytest.raises(FileNotFoundError, match="a_replay/checkpoints does not exist"):
    replay_lib.replay(replay_dir, from_step=10, to_step=20)
  assert os.listdir(replay_dir) == ["config.json"]


@pytest.mark.slow  # a subprocess
def test_a_shape_override_on_the_command_line_is_one_line(run):
  result = subprocess.run(
      [sys.executable, "-m", "geonorm_jax", "replay", f"--workdir={run['workdir']}",
       "--from_step=10", "--to_step=20", "--config.model.d_model=64"],
      cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=300, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [result.stderr.strip()]
  assert "--config.model.d_model: changes the shapes" in result.stderr


def test_another_seed_is_refused_naming_the_field(run):
  """seed draws the initial parameters: a replay from the initial state with another seed
  would be another run, and from a checkpoint it would change nothing."""
  before = _file_digests(run["workdir"]), _replays(run["workdir"])
  config = config_lib.get_config(TINY)
  config.seed = 3
  for from_step in (5, 15):  # before the first checkpoint (the initial state), after it
    with pytest.raises(ValueError, match=r"^--config\.seed=3: a replay continues ") as info:
      replay_lib.replay(run["workdir"], from_step=from_step, to_step=20, config=config)
    assert "\n" not in str(info.value)
  assert (_file_digests(run["workdir"]), _replays(run["workdir"])) == before
