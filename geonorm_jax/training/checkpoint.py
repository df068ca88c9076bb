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

Failures are made survivable: a checkpoint that cannot be read is set aside (moved to
`workdir/checkpoints_set_aside/`, never deleted) and the newest readable one is used; a save
that fails in the background is reported at the next step, not one interval later; a
`WorkdirLock` keeps a second trainer out of a workdir.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_SUBDIR = "checkpoints"
SET_ASIDE_SUBDIR = "checkpoints_set_aside"
CONFIG_FILENAME = "config.json"
LOCK_FILENAME = ".lock"

# Execution-only model keys (changing them between runs gives the same math on the same
# parameters) and z_loss, a term of the objective like train.*: the parameters fit either
# way, so resuming (or branching a run) across them is allowed.
_MODEL_KEYS_NOT_IN_FINGERPRINT = ("remat", "loss_chunks", "z_loss")
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


# Files up to this size are hashed whole; larger ones by size plus evenly spaced blocks, so a
# multi-GB corpus costs milliseconds at startup yet a rewritten file is still noticed.
_HASH_WHOLE_BYTES = 64 << 20
_HASH_BLOCKS, _HASH_BLOCK_BYTES = 64, 64 << 10


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written by a different model (or, for training, a different stream)."""


class CheckpointSaveError(RuntimeError):
  """A save failed (disk full, permissions, ...): reported at once, the run stops."""


class NoValidCheckpointError(FileNotFoundError):
  """No checkpoint at all, or none that could be read."""


class WorkdirBusyError(RuntimeError):
  """Another live trainer holds the workdir's lock."""


def _file_digest(path: str) -> str:
  size = os.path.getsize(path)
  digest = hashlib.sha256(str(size).encode())
  with open(path, "rb") as f:
    if size <= _HASH_WHOLE_BYTES:
      for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    else:
      for index in range(_HASH_BLOCKS):
        f.seek((size - _HASH_BLOCK_BYTES) * index // (_HASH_BLOCKS - 1))
        digest.update(f.read(_HASH_BLOCK_BYTES))
  return digest.hexdigest()[:16]


def data_content_signature(data_config) -> str:
  """'sha256:...' of the training corpus (sizes + contents, sampled for big files).

  The path alone is fingerprinted too, but a file rewritten in place under the same name
  would otherwise resume silently with an iterator state that means something else.
  """
  import glob  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  if data_config.source == "builtin":
    from geonorm_jax.data import sources as data_sources  # pylint: disable=g-import-not-at-top
    digest.update(data_sources.builtin_text().encode("utf-8"))
  else:
    pattern = data_config.path
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    for path in paths:
      digest.update(os.path.basename(path).encode())
      digest.update(_file_digest(path).encode() if os.path.isfile(path) else b"<missing>")
  return "sha256:" + digest.hexdigest()[:16]


def model_fingerprint(config) -> dict[str, Any]:
  """The model section minus execution-only keys: what decides whether parameters fit."""
  as_dict = config.to_dict()
  fingerprint = {
      f"model.{key}": value
      for key, value in as_dict["model"].items()
      if key not in _MODEL_KEYS_NOT_IN_FINGERPRINT
  }
  # Round trip through json so that what we compare in memory is exactly what
  # comes back from disk (tuples become lists, keys are sorted).
  return json.loads(json.dumps(fingerprint, sort_keys=True))


def config_fingerprint(config, with_data_content: bool = False) -> dict[str, Any]:
  """Flat JSON-able dict {"model.d_model": 64, ...} of what a checkpoint depends on.

  The whole model section (shapes, placement, vocab, ...) plus the data keys
  that define the training stream, and with `with_data_content` a signature of the
  corpus itself (what the trainer stores). Two configs with equal fingerprints can
  resume each other's checkpoints.
  """
  as_dict = config.to_dict()
  fingerprint = model_fingerprint(config)
  for key in _DATA_KEYS_IN_FINGERPRINT:
    fingerprint[f"data.{key}"] = as_dict["data"][key]
  if with_data_content:
    fingerprint["data.content"] = data_content_signature(config.data)
  return json.loads(json.dumps(fingerprint, sort_keys=True))


def _default_fingerprint() -> dict[str, Any]:
  from geonorm_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_fingerprint(config_lib.get_base_config())


_ABSENT = "<absent>"
# check_for_errors also waits on orbax's small metadata writes: at most once a second, so a
# failed save is reported within about a second and a fast loop is not slowed.
_POLL_INTERVAL_S = 1.0


def differing_fields(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
  """'field: checkpoint=A, current=B' for every field of `expected` that differs.

  A config key that a checkpoint lacks was added to the code after it was written, so the
  checkpoint was made with that key's default: it is compared as the default (every new
  placement option adds one). Keys with no default (data.content of old checkpoints) and
  keys only the checkpoint has cannot be compared and are not.
  """
  defaults = _default_fingerprint()
  lines = []
  for key in sorted(expected):
    stored_value = stored.get(key, defaults.get(key, _ABSENT))
    if stored_value == _ABSENT:
      continue
    if stored_value != expected[key]:
      lines.append(f"{key}: checkpoint={stored_value!r}, current={expected[key]!r}")
  return lines


def _layout_hint(differences) -> str:
  """model.scan_layers is a different parameter layout, not a different model: say how to
  move between them."""
  if not any(line.startswith("model.scan_layers:") for line in differences):
    return ""
  return ("\nmodel.scan_layers stacks the blocks' parameters along one `layers` axis, so the "
          "two layouts cannot restore each other; geonorm_jax.interop.convert.stack_layers / "
          "unstack_layers convert parameters between them.")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes via a temporary file and a rename: never half a file, and a symlink at `path`
  is replaced by the file rather than followed out of the workdir."""
  path = os.fspath(path)
  tmp_path = f"{path}.tmp.{os.getpid()}"
  with open(tmp_path, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp_path, path)


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
  os.makedirs(workdir, exist_ok=True)
  write_text_atomic(os.path.join(workdir, CONFIG_FILENAME),
                    config.to_json_best_effort(indent=2, sort_keys=True))


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


def _one_line(err: BaseException, limit: int = 300) -> str:
  """The first line of an exception, without tensorstore's multi-page spec dump."""
  lines = [line.strip() for line in str(err).splitlines() if line.strip()]
  first = lines[0].split(" See full TensorStore details")[0] if lines else ""
  text = f"{type(err).__name__}: {first}"
  return text if len(text) <= limit else text[:limit] + "..."


class Checkpointer:
  """Saves and restores (train state, data iterator state) under `workdir/checkpoints`.

  Args:
    workdir: the run directory; checked writable right away (unless read_only).
    checkpoint_config: `config.checkpoint` (every, keep_last, keep_every, async_save).
    fingerprint: `config_fingerprint(config)` of the current run; stored with
      every checkpoint and, by default, required to match on restore.
    read_only: for eval, sample and hessian: nothing is created or written, the
      workdir may be a read-only mount, and a missing checkpoints folder is an error
      (not created, so a mistyped --workdir leaves no trace).
  """

  def __init__(
      self,
      workdir: str | os.PathLike,
      checkpoint_config,
      fingerprint: Mapping[str, Any] | None = None,
      read_only: bool = False,
  ):
    # orbax needs an absolute path; users type relative ones (make run uses runs/main).
    self.workdir = epath.Path(os.path.abspath(workdir))
    self.directory = self.workdir / CHECKPOINT_SUBDIR
    self.read_only = read_only
    if read_only:
      if not self.directory.is_dir():
        raise NoValidCheckpointError(f"No checkpoint to restore: {os.fspath(self.directory)}"
                                     " does not exist")
    else:
      check_writable(workdir)
    self.every = int(checkpoint_config.every)
    self.fingerprint = None if fingerprint is None else dict(fingerprint)
    self._async = bool(checkpoint_config.async_save) and not read_only
    # Read-only managers get no rotation settings: orbax would drop them with a warning each.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else int(checkpoint_config.keep_last) or None,
        keep_period=None if read_only else int(checkpoint_config.keep_every) or None,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=self._async,
        read_only=read_only,
        create=not read_only,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self.preempted = False
    self.interrupted = False  # SIGINT (Ctrl-C): saved and stopped like a preemption
    self._signals_installed = False
    self._previous_handlers = {}
    self._unconfirmed_step = None  # dispatched, not yet known to be on disk
    self.durable_step = None  # newest step known to be fully written
    self._last_poll = -math.inf
    self.set_aside = []  # one line per checkpoint that failed to restore
    self.restored_meta = {}  # the meta item of the last restored checkpoint

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
      extra_meta: Mapping[str, Any] | None = None,
  ) -> bool:
    """Saves at `step` if it is a checkpoint step (or `force`); returns whether it did.

    With async saving this returns once the arrays are copied off the devices,
    so the next train step may donate them; the write finishes in the
    background (`poll` reports its failure, `wait()` blocks on it). A step already
    on disk is skipped, so a final or preemption save right after a periodic one
    is harmless. `extra_meta` (JSON) is stored next to the fingerprint.
    """
    if not (force or self.should_save(step)):
      return False
    if self.fingerprint is None:
      raise ValueError(
          "Checkpointer needs fingerprint=config_fingerprint(config) to save checkpoints."
      )
    if step in self._manager.all_steps():
      return False
    self.wait()  # one save in flight at a time, each one confirmed before the next
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(_encode_data_state(data_state)),
        meta=ocp.args.JsonSave({"fingerprint": self.fingerprint, **(extra_meta or {})}),
    )
    # Our own `should_save` decides; orbax's would also save the very first
    # step it sees, whatever the interval.
    try:
      saved = self._manager.save(step, args=args, force=True)
    except Exception as err:  # pylint: disable=broad-except
      raise self._save_error(step, err) from err
    if saved:
      self._unconfirmed_step = step
      if not self._async:
        self._confirm()  # a synchronous save is on disk already
    return saved

  def _save_error(self, step, err):
    return CheckpointSaveError(
        f"saving checkpoint step {step} to {os.fspath(self.directory)} failed "
        f"({_one_line(err)}); the newest saved step is {self.durable_step or self._latest_on_disk()}."
        " Free space or fix permissions, then rerun the same command to resume from it.")

  def _latest_on_disk(self):
    self._manager.reload()
    return self._manager.latest_step() or "none"

  def poll(self) -> int | None:
    """Non-blocking: if the save in flight has finished, raise CheckpointSaveError when it
    failed (at once, not at the next save one interval later). Returns the durable step."""
    now = time.monotonic()
    if self._unconfirmed_step is not None and now - self._last_poll >= _POLL_INTERVAL_S:
      self._last_poll = now
      try:
        # Raises the background thread's error as soon as it has one; is_saving_in_progress
        # stays true after a failed write until the next save waits on it.
        self._manager.check_for_errors()
      except Exception as err:  # pylint: disable=broad-except
        step, self._unconfirmed_step = self._unconfirmed_step, None
        raise self._save_error(step, err) from err
      if not self._manager.is_saving_in_progress():
        self._confirm()
    return self.durable_step

  def _confirm(self):
    step, self._unconfirmed_step = self._unconfirmed_step, None
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as err:  # pylint: disable=broad-except
      raise self._save_error(step, err) from err
    # orbax logs (rather than raises) some failures of its finalize step; the renamed
    # step directory is the proof that the write completed.
    if not (self.directory / str(step)).is_dir():
      raise self._save_error(step, RuntimeError("the step directory was not finalized"))
    self.durable_step = step

  # --- restoring ---------------------------------------------------------------

  def latest_step(self) -> int | None:
    """Newest finished checkpoint step (unfinished tmp dirs are ignored), or None."""
    self._manager.reload()  # another process (or a previous run) may have written since
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def stored_meta(self, step: int) -> dict[str, Any]:
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(meta["meta"])

  def stored_fingerprint(self, step: int) -> dict[str, Any]:
    return self.stored_meta(step)["fingerprint"]

  def check_compatible(self, step: int, expected_fingerprint: Mapping[str, Any],
                       stored: Mapping[str, Any] | None = None) -> None:
    """Raises IncompatibleCheckpointError, naming the fields and the directory, if the
    configs differ.

    Only reads: nothing on disk is changed or deleted, so the old run stays
    resumable with its own config.
    """
    stored = self.stored_fingerprint(step) if stored is None else stored
    differences = differing_fields(stored, expected_fingerprint)
    if differences:
      step_dir = os.fspath(self.directory / str(step))
      old_config = os.fspath(self.workdir / CONFIG_FILENAME)
      raise IncompatibleCheckpointError(
          f"Checkpoint {step_dir} was written with a different config; these fields differ:\n  "
          + "\n  ".join(differences)
          + _layout_hint(differences)
          + f"\nUse a fresh workdir, or rerun with the old config ({old_config})."
          " Nothing was deleted."
      )

  def _read(self, step, abstract_state, expected, params_only):
    """(state, data_state, meta) of one step; raises IncompatibleCheckpointError or any
    read error."""
    meta = self.stored_meta(step)
    if expected is not None:
      self.check_compatible(step, expected, meta["fingerprint"])
    abstract_state = jax.tree.map(_as_abstract, abstract_state)
    if params_only:
      # The optimizer state (2x the parameters with Adam) and the iterator state are
      # never read: eval, sample and hessian need the parameters only.
      abstract = {"params": abstract_state["params"], "step": abstract_state["step"]}
      restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=True)))
      return restored["state"], None, meta
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        ),
    )
    return restored["state"], _decode_data_state(restored["data"]), meta

  def restore(
      self, step: int | None, abstract_state, expected_fingerprint: Mapping[str, Any] | None = None,
      params_only: bool = False,
  ) -> tuple[Any, bytes | dict[str, Any] | None]:
    """Returns (state, data_state) of checkpoint `step` (None: the newest readable one).

    `abstract_state` is a pytree of jax.ShapeDtypeStruct (or arrays) whose
    `.sharding` says where each restored array goes; arrays are read directly
    into those shardings, never gathered on one device. The stored config
    fingerprint must equal `expected_fingerprint` (default: this
    Checkpointer's own); pass neither to skip the check. With `params_only`, the
    state holds `step` and `params` only and data_state is None.

    An explicit `step` that cannot be read raises naming the step and the reason. With
    step=None, a checkpoint that cannot be read is reported (`self.set_aside`), moved
    to `workdir/checkpoints_set_aside/` unless read-only, and the next older one is
    tried. A config mismatch is never skipped over: it raises.
    """
    expected = self.fingerprint if expected_fingerprint is None else expected_fingerprint
    if step is not None:
      if step not in self.all_steps():
        raise NoValidCheckpointError(
            f"no checkpoint step {step} in {os.fspath(self.directory)}; saved steps: "
            f"{self.all_steps() or 'none'}")
      try:
        state, data_state, self.restored_meta = self._read(step, abstract_state, expected,
                                                           params_only)
      except IncompatibleCheckpointError:
        raise
      except Exception as err:  # pylint: disable=broad-except
        raise NoValidCheckpointError(
            f"checkpoint {os.fspath(self.directory / str(step))} cannot be read: "
            f"{_one_line(err)}") from err
      return state, data_state
    steps = self.all_steps()
    if not steps:
      raise NoValidCheckpointError(f"No checkpoint to restore in {os.fspath(self.directory)}")
    for candidate in reversed(steps):
      try:
        state, data_state, self.restored_meta = self._read(candidate, abstract_state, expected,
                                                           params_only)
        return state, data_state
      except IncompatibleCheckpointError:
        raise
      except Exception as err:  # pylint: disable=broad-except
        self._set_aside(candidate, err)
    raise NoValidCheckpointError(
        f"no checkpoint in {os.fspath(self.directory)} could be read:\n  "
        + "\n  ".join(self.set_aside))

  def _set_aside(self, step, err):
    """Reports an unreadable checkpoint on stderr and moves it out of the way (not deleted)."""
    source = self.directory / str(step)
    line = f"checkpoint step {step} ({os.fspath(source)}) cannot be restored: {_one_line(err)}"
    if not self.read_only and jax.process_index() == 0:
      target_dir = self.workdir / SET_ASIDE_SUBDIR
      target_dir.mkdir(parents=True, exist_ok=True)
      target = target_dir / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
      os.replace(os.fspath(source), os.fspath(target))
      line += f"; moved to {os.fspath(target)}"
      self._manager.reload()
    self.set_aside.append(line)
    print(f"WARNING: {line}; trying the previous checkpoint", file=sys.stderr, flush=True)

  # --- preemption --------------------------------------------------------------

  def install_sigterm_handler(self) -> None:
    """On SIGTERM (preemption notice) or a first SIGINT (Ctrl-C), set `self.preempted`
    instead of dying.

    The train loop polls the flag, saves and exits cleanly; a second SIGINT interrupts
    at once. Must be called from the main thread (a Python rule for signal handlers).
    """
    if not self._signals_installed:
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
      self._signals_installed = True

  def _on_signal(self, signum, frame):
    del frame
    if signum == signal.SIGINT:
      if self.interrupted:  # asked twice: stop now, without the save
        raise KeyboardInterrupt
      self.interrupted = True
    # Only set the flag: logging from a signal handler can deadlock on the
    # logging lock if the main thread held it when the signal arrived.
    self.preempted = True

  def uninstall_sigterm_handler(self) -> None:
    """Puts back whatever handlers were there before `install_sigterm_handler`."""
    if self._signals_installed:
      for signum, previous in self._previous_handlers.items():
        # None means the old handler was not set from Python; the default is the
        # closest we can put back.
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
      self._signals_installed = False
      self._previous_handlers = {}

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
    """Blocks until any background save has been written; raises CheckpointSaveError if it
    failed."""
    if self._unconfirmed_step is not None:
      self._confirm()
    else:
      self._manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()
      self.uninstall_sigterm_handler()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


class WorkdirLock:
  """An exclusive lock on `workdir/.lock`, held by one trainer (process 0) for its lifetime.

  The kernel's flock is released when its process dies, however it dies (SIGKILL, OOM, a
  lost node), so a crashed trainer never leaves a stale lock: the file may remain, the lock
  does not. A clean exit removes the file. The file's text (pid, host, start time) only
  serves the error message.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.path = os.path.join(os.fspath(workdir), LOCK_FILENAME)
    self._file = None

  def acquire(self) -> "WorkdirLock":
    if jax.process_index() != 0:
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    while True:
      lock_file = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
      try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as err:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "unknown process"
        lock_file.close()
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          # A filesystem without flock (some network mounts): run unlocked, not not at all.
          print(f"WARNING: cannot lock {self.path} ({err}); make sure no other trainer uses "
                "this workdir", file=sys.stderr, flush=True)
          return self
        raise WorkdirBusyError(
            f"workdir {os.path.dirname(self.path)} is in use by another trainer ({holder}); "
            "wait for it to finish, stop it, or choose another --workdir") from None
      # The holder we waited on may have unlinked the file on release; a lock on that
      # orphaned inode would guard nothing, so lock the file now at the path instead.
      try:
        same_file = os.stat(self.path).st_ino == os.fstat(lock_file.fileno()).st_ino
      except FileNotFoundError:
        same_file = False
      if same_file:
        break
      lock_file.close()
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock_file.flush()
    self._file = lock_file
    return self

  def release(self) -> None:
    """Removes the file (while still holding the lock) and unlocks: a run that was refused
    or had nothing to do leaves the workdir as it found it."""
    if self._file is not None:
      try:
        os.unlink(self.path)
      except FileNotFoundError:
        pass
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc_info):
    self.release()
