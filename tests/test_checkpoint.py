"""Tests for geonorm_jax.training.checkpoint on 8 fake CPU devices (see conftest.py)."""
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from geonorm_jax.training import checkpoint
from geonorm_jax.training.config import get_base_config


def _checkpoint_config(keep_last=3, keep_every=0, every=1, async_save=True):
  config = get_base_config().checkpoint
  config.update(
      dict(keep_last=keep_last, keep_every=keep_every, every=every, async_save=async_save)
  )
  return config


def _fingerprint(**model_overrides):
  config = get_base_config()
  config.model.update(model_overrides)
  return checkpoint.config_fingerprint(config)


def _sharded_state():
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=(16, 4)).astype(np.float32)
  scale = jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16)
  return {
      "params": {
          "kernel": jax.device_put(kernel, NamedSharding(mesh, P("data"))),
          "scale": jax.device_put(scale, NamedSharding(mesh, P())),
      },
      "step": jnp.int32(7),
  }


def _new_checkpointer(workdir, **config_overrides):
  config = _checkpoint_config(**config_overrides)
  return checkpoint.Checkpointer(workdir, config, fingerprint=_fingerprint())


def test_sharded_round_trip_into_target_sharding(tmp_path):
  state = _sharded_state()
  with _new_checkpointer(tmp_path) as saver:
    assert saver.save(1, state, {"epoch": 0})
  # A fresh Checkpointer, as in a resumed process, restoring into a different
  # layout: the kernel goes from row-sharded to column-sharded.
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  target_shardings = {
      "params": {"kernel": NamedSharding(mesh, P(None, "b")), "scale": NamedSharding(mesh, P("a"))},
      "step": NamedSharding(mesh, P()),
  }
  abstract = jax.tree.map(
      lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      state,
      target_shardings,
  )
  with _new_checkpointer(tmp_path) as loader:
    assert loader.latest_step() == 1
    restored, data_state = loader.restore(1, abstract, _fingerprint())
  assert data_state == {"epoch": 0}
  leaves = zip(jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(target_shardings))
  for original, new, sharding in leaves:
    assert new.dtype == original.dtype
    np.testing.assert_array_equal(np.asarray(new), np.asarray(original))  # bit-exact, bf16 included
    assert new.sharding == sharding


@pytest.mark.parametrize(
    "data_state", [b"\x00\xffgrain-state{}", {"next_index": 12, "rng": [np.int64(3)]}, None]
)
def test_data_state_round_trip(tmp_path, data_state):
  state = {"x": jnp.arange(4.0)}
  with _new_checkpointer(tmp_path, async_save=False) as saver:
    saver.save(2, state, data_state)
    _, restored = saver.restore(None, state)
  if isinstance(data_state, dict):
    assert restored == {"next_index": 12, "rng": [3]}
  else:
    assert restored == data_state and type(restored) is type(data_state)


def test_keep_last_and_keep_every(tmp_path):
  state = {"x": jnp.zeros(2)}
  with _new_checkpointer(tmp_path, keep_last=2, keep_every=4, every=2) as saver:
    saved = [step for step in range(1, 11) if saver.save(step, state, None)]
    assert saved == [2, 4, 6, 8, 10]  # only every `every`-th step, even the first
    assert saver.save(10, state, None, force=True) is False  # already on disk
    assert saver.save(11, state, None, force=True)
    saver.wait()
    # Last two (10, 11) plus every 4th forever (4, 8); 2 and 6 were deleted.
    assert saver.all_steps() == [4, 8, 10, 11]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "11", "4", "8"]


def test_incompatible_fingerprint_names_field_and_deletes_nothing(tmp_path):
  state = {"x": jnp.ones(3)}
  with _new_checkpointer(tmp_path) as saver:
    saver.save(5, state, None)
  files_before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

  other_config = get_base_config()
  other_config.model.placement = "post"
  other_fingerprint = checkpoint.config_fingerprint(other_config)
  with checkpoint.Checkpointer(tmp_path, _checkpoint_config(), other_fingerprint) as loader:
    with pytest.raises(ValueError) as error:
      loader.restore(None, state)
  message = str(error.value)
  assert "model.placement: checkpoint='pre', current='post'" in message
  assert str(tmp_path / "checkpoints" / "5") in message
  assert "model.d_model" not in message  # only the fields that differ
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == files_before


def test_fingerprint_covers_shapes_and_stream_but_not_remat_or_loss_chunks():
  base = get_base_config()
  changed = get_base_config()
  changed.model.remat = True
  changed.model.loss_chunks = 4  # how the loss is computed, not what the parameters are
  assert checkpoint.config_fingerprint(changed) == checkpoint.config_fingerprint(base)
  changes = [("model", "vocab_size", 512), ("data", "seq_len", 64), ("model", "backbone", "llama")]
  for section, key, value in changes:
    changed = get_base_config()
    changed[section][key] = value
    differences = checkpoint.differing_fields(
        checkpoint.config_fingerprint(base), checkpoint.config_fingerprint(changed)
    )
    assert differences == [f"{section}.{key}: checkpoint={base[section][key]!r}, current={value!r}"]
  json.dumps(checkpoint.config_fingerprint(base))  # stored as JSON


def test_leftover_tmp_dir_does_not_break_restore_latest(tmp_path):
  state = {"x": jnp.arange(3.0)}
  with _new_checkpointer(tmp_path) as saver:
    saver.save(3, state, None)
  # What a save killed mid-write leaves behind: an unfinished tmp directory of
  # a later step, with garbage in it.
  leftover = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
  (leftover / "state").mkdir(parents=True)
  (leftover / "state" / "garbage").write_bytes(b"\x00" * 10)
  with _new_checkpointer(tmp_path) as loader:
    assert loader.latest_step() == 3
    restored, _ = loader.restore(None, state)
    np.testing.assert_array_equal(restored["x"], state["x"])
    # The resumed run reaches step 4 again and can save it.
    assert loader.save(4, {"x": state["x"] + 1}, None)
    loader.wait()
    assert loader.latest_step() == 4


def test_sigterm_sets_preempted_flag(tmp_path):
  previous = signal.getsignal(signal.SIGTERM)
  saver = _new_checkpointer(tmp_path)
  try:
    saver.install_sigterm_handler()
    assert not saver.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    # Python runs the handler at the next bytecode boundary after os.kill.
    assert saver.preempted
    assert saver.any_process_preempted()
  finally:
    saver.close()
  assert signal.getsignal(signal.SIGTERM) == previous


def test_unwritable_workdir_error_names_directory(tmp_path):
  # A path below a regular file can't be created even by root (chmod tricks
  # do not stop root, which CI containers often are).
  (tmp_path / "a_file").write_text("")
  workdir = tmp_path / "a_file" / "run"
  with pytest.raises(OSError, match="a_file/run"):
    checkpoint.check_writable(workdir)
  with pytest.raises(OSError, match="not writable"):
    _new_checkpointer(workdir)
  checkpoint.check_writable(tmp_path / "fresh" / "run")  # creates it, leaves no probe behind
  assert os.listdir(tmp_path / "fresh" / "run") == []


def test_save_config_json_round_trips(tmp_path):
  config = get_base_config()
  checkpoint.save_config_json(tmp_path, config)
  with open(tmp_path / checkpoint.CONFIG_FILENAME) as f:
    assert json.load(f) == json.loads(config.to_json())


def test_relative_workdir_saves_and_restores(tmp_path, monkeypatch):
  """`make run` passes runs/main: orbax itself refuses relative checkpoint paths."""
  monkeypatch.chdir(tmp_path)
  state = {"x": jnp.arange(3.0)}
  with _new_checkpointer("relative/run", async_save=False) as saver:
    assert saver.save(1, state, None, force=True)
    restored, _ = saver.restore(None, state)
  np.testing.assert_array_equal(restored["x"], state["x"])
  assert (tmp_path / "relative" / "run" / "checkpoints" / "1").is_dir()
