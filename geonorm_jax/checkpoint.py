"""Checkpointing: orbax CheckpointManager with a config guard, data state and preemption.

Each step directory `workdir/checkpoints/<step>/` holds three items:

* `state`: the train state pytree (params, optimizer state, ...), saved sharded
  and restored straight into the target shardings, so a run can resume on a
  different mesh.
* `data`: the data iterator state, so a resumed run sees the batches it would
  have seen had it not stopped.
* `meta`: the config fingerprint. Restoring a checkpoint into a different
  model (e.g. a pre-LN checkpoint into a post-LN model, which has exactly the
  same parameter shapes) would otherwise succeed silently.
"""
from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Mapping
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_SUBDIR = "checkpoints"
CONFIG_FILENAME = "config.json"

# Execution-only model keys: changing them between runs gives the same math on
# the same parameters, so resuming across them is allowed.
_MODEL_KEYS_NOT_IN_FINGERPRINT = ("remat",)
# Data keys that decide which token stream training sees, and therefore what the
# stored iterator state means. num_workers and val_path are left out: they do
# not change the training stream.
_DATA_KEYS_IN_FINGERPRINT = (
    "source",
    "path",
    "tokenizer",
    "seq_len",
    "batch_size",
    "sampling",
    "val_fraction",
    "seed",
)


def config_fingerprint(config) -> dict[str, Any]:
  """Flat JSON-able dict {"model.d_model": 64, ...} of what a checkpoint depends on.

  The whole model section (shapes, placement, vocab, ...) plus the data keys
  that define the training stream. Two configs with equal fingerprints can
  resume each other's checkpoints.
  """
  as_dict = config.to_dict()
  fingerprint = {
      f"model.{key}": value
      for key, value in as_dict["model"].items()
      if key not in _MODEL_KEYS_NOT_IN_FINGERPRINT
  }
  for key in _DATA_KEYS_IN_FINGERPRINT:
    fingerprint[f"data.{key}"] = as_dict["data"][key]
  # Round trip through json so that what we compare in memory is exactly what
  # comes back from disk (tuples become lists, keys are sorted).
  return json.loads(json.dumps(fingerprint, sort_keys=True))


def differing_fields(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
  """'field: checkpoint=A, current=B' for every field whose value differs."""
  missing = "<absent>"
  lines = []
  for key in sorted(set(stored) | set(expected)):
    stored_value, expected_value = stored.get(key, missing), expected.get(key, missing)
    if stored_value != expected_value:
      lines.append(f"{key}: checkpoint={stored_value!r}, current={expected_value!r}")
  return lines


def check_writable(workdir: str | os.PathLike) -> None:
  """Raises OSError naming `workdir` unless we can create it and write into it.

  Called before training so that a typo or a read-only mount fails in the
  first second, not at the first checkpoint hours later.
  """
  path = epath.Path(workdir)
  probe = path / f".write_test.{os.getpid()}.{jax.process_index()}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()
  except OSError as err:
    raise OSError(
        f"workdir {os.fspath(path)!r} is not writable ({err}). Choose another"
        " --workdir or fix its permissions."
    ) from err


def save_config_json(workdir: str | os.PathLike, config) -> None:
  """Writes the resolved config to `workdir/config.json` (process 0 only)."""
  if jax.process_index() != 0:
    return
  path = epath.Path(workdir)
  path.mkdir(parents=True, exist_ok=True)
  (path / CONFIG_FILENAME).write_text(config.to_json_best_effort(indent=2, sort_keys=True))


# Grain's DataLoader iterator state is bytes, a DatasetIterator's is a dict.
# JSON holds both once bytes are base64-encoded; the tag says which came in.
def _encode_data_state(data_state: bytes | Mapping[str, Any] | None) -> dict[str, Any]:
  if data_state is None:
    return {"kind": "none"}
  if isinstance(data_state, (bytes, bytearray)):
    return {"kind": "bytes", "base64": base64.b64encode(bytes(data_state)).decode("ascii")}
  if isinstance(data_state, Mapping):
    # numpy scalars (a common leaf of iterator states) are not JSON; make them Python.
    as_json = json.dumps(dict(data_state), default=_numpy_to_python)
    return {"kind": "json", "value": json.loads(as_json)}
  raise TypeError(f"data_state must be bytes, a dict or None, got {type(data_state).__name__}")


def _numpy_to_python(value):
  if isinstance(value, (np.generic, np.ndarray)):
    return value.tolist()
  raise TypeError(f"{type(value).__name__} in data_state is not JSON-serializable")


def _decode_data_state(encoded: Mapping[str, Any]) -> bytes | dict[str, Any] | None:
  kind = encoded["kind"]
  if kind == "none":
    return None
  if kind == "bytes":
    return base64.b64decode(encoded["base64"])
  if kind == "json":
    return encoded["value"]
  raise ValueError(f"unknown data_state kind {kind!r} in checkpoint")


def _as_abstract(leaf):
  # A concrete array stands for its own shape, dtype and sharding, so callers
  # may restore "into" an already initialized state.
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


class Checkpointer:
  """Saves and restores (train state, data iterator state) under `workdir/checkpoints`.

  Args:
    workdir: the run directory; checked writable right away.
    checkpoint_config: `config.checkpoint` (every, keep_last, keep_every, async_save).
    fingerprint: `config_fingerprint(config)` of the current run; stored with
      every checkpoint and, by default, required to match on restore.
  """

  def __init__(
      self,
      workdir: str | os.PathLike,
      checkpoint_config,
      fingerprint: Mapping[str, Any] | None = None,
  ):
    check_writable(workdir)
    # orbax needs an absolute path; users type relative ones (make run uses runs/main).
    self.workdir = epath.Path(os.path.abspath(workdir))
    self.directory = self.workdir / CHECKPOINT_SUBDIR
    self.every = int(checkpoint_config.every)
    self.fingerprint = None if fingerprint is None else dict(fingerprint)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(checkpoint_config.keep_last) or None,
        keep_period=int(checkpoint_config.keep_every) or None,
        enable_async_checkpointing=bool(checkpoint_config.async_save),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self.preempted = False
    self._sigterm_installed = False
    self._previous_sigterm_handler = None

  # --- saving ------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """True on every `checkpoint.every`-th step (never if every is 0)."""
    return self.every > 0 and step % self.every == 0

  def save(
      self,
      step: int,
      state,
      data_state: bytes | Mapping[str, Any] | None,
      force: bool = False,
  ) -> bool:
    """Saves at `step` if it is a checkpoint step (or `force`); returns whether it did.

    With async saving this returns once the arrays are copied off the devices,
    so the next train step may donate them; the write finishes in the
    background (`wait()` blocks on it). A step already on disk is skipped, so
    a final or preemption save right after a periodic one is harmless.
    """
    if not (force or self.should_save(step)):
      return False
    if self.fingerprint is None:
      raise ValueError(
          "Checkpointer needs fingerprint=config_fingerprint(config) to save checkpoints."
      )
    if step in self._manager.all_steps():
      return False
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(_encode_data_state(data_state)),
        meta=ocp.args.JsonSave({"fingerprint": self.fingerprint}),
    )
    # Our own `should_save` decides; orbax's would also save the very first
    # step it sees, whatever the interval.
    return self._manager.save(step, args=args, force=True)

  # --- restoring ---------------------------------------------------------------

  def latest_step(self) -> int | None:
    """Newest finished checkpoint step (unfinished tmp dirs are ignored), or None."""
    self._manager.reload()  # another process (or a previous run) may have written since
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def stored_fingerprint(self, step: int) -> dict[str, Any]:
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return meta["fingerprint"]

  def check_compatible(self, step: int, expected_fingerprint: Mapping[str, Any]) -> None:
    """Raises ValueError, naming the fields and the directory, if the configs differ.

    Only reads: nothing on disk is changed or deleted, so the old run stays
    resumable with its own config.
    """
    differences = differing_fields(self.stored_fingerprint(step), expected_fingerprint)
    if differences:
      step_dir = os.fspath(self.directory / str(step))
      old_config = os.fspath(self.workdir / CONFIG_FILENAME)
      raise ValueError(
          f"Checkpoint {step_dir} was written with a different config; these fields differ:\n  "
          + "\n  ".join(differences)
          + f"\nUse a fresh workdir, or rerun with the old config ({old_config})."
          " Nothing was deleted."
      )

  def restore(
      self, step: int | None, abstract_state, expected_fingerprint: Mapping[str, Any] | None = None
  ) -> tuple[Any, bytes | dict[str, Any] | None]:
    """Returns (state, data_state) of checkpoint `step` (None: the latest).

    `abstract_state` is a pytree of jax.ShapeDtypeStruct (or arrays) whose
    `.sharding` says where each restored array goes; arrays are read directly
    into those shardings, never gathered on one device. The stored config
    fingerprint must equal `expected_fingerprint` (default: this
    Checkpointer's own); pass neither to skip the check.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No checkpoint to restore in {os.fspath(self.directory)}")
    expected = self.fingerprint if expected_fingerprint is None else expected_fingerprint
    if expected is not None:
      self.check_compatible(step, expected)
    abstract_state = jax.tree.map(_as_abstract, abstract_state)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        ),
    )
    return restored["state"], _decode_data_state(restored["data"])

  # --- preemption --------------------------------------------------------------

  def install_sigterm_handler(self) -> None:
    """On SIGTERM (preemption notice), set `self.preempted` instead of dying.

    The train loop polls the flag, saves and exits cleanly. Must be called from
    the main thread (a Python rule for signal handlers).
    """
    if not self._sigterm_installed:
      self._previous_sigterm_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._sigterm_installed = True

  def _on_sigterm(self, signum, frame):
    del signum, frame
    # Only set the flag: logging from a signal handler can deadlock on the
    # logging lock if the main thread held it when the signal arrived.
    self.preempted = True

  def uninstall_sigterm_handler(self) -> None:
    """Puts back whatever SIGTERM handler was there before `install_sigterm_handler`."""
    if self._sigterm_installed:
      # None means the old handler was not set from Python; the default is the
      # closest we can put back.
      previous = self._previous_sigterm_handler
      signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
      self._sigterm_installed = False
      self._previous_sigterm_handler = None

  def any_process_preempted(self) -> bool:
    """`preempted` agreed over all processes.

    Hosts get SIGTERM at slightly different steps; the save is collective, so
    every host must decide to save at the same step or the run hangs. Costs an
    all-gather, so poll it every few steps, not every step.
    """
    if jax.process_count() == 1:
      return self.preempted
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    flags = multihost_utils.process_allgather(np.array(self.preempted))
    return bool(np.any(flags))

  # --- lifecycle ---------------------------------------------------------------

  def wait(self) -> None:
    """Blocks until any background save has been written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self._manager.close()
    self.uninstall_sigterm_handler()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
