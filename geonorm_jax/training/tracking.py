"""Weights & Biases tracking (`train.wandb=off|online|offline`), an optional extra.

The W&B run mirrors the run folder: the resolved config, every scalar that MetricsWriter writes
(under the same `split/name` as in tensorboard, at the same step) and summary.json at the end.
Its id comes from the workdir, so rerunning the same `train` command (a resume) continues the
same W&B run; its files (offline runs, W&B's own logs of the run) go into `WORKDIR/wandb/`.
Only process 0 tracks. `wandb` is imported here only, and only when tracking is on, so the core
install neither needs nor imports it (`pip install -e ".[wandb]"` adds it).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

import jax

INSTALL_HINT = 'pip install -e ".[wandb]"'
# W&B drops a row logged below the newest step it was sent, and the loop writes step t-1's
# train metrics after step t's StepLoggers (it reads a step's numbers one step late). So a
# step's row stays open here, merging later writes of every split, until a write more than
# this many steps newer arrives (tests/test_wandb.py loses rows without it).
_LATE_STEPS = 1
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_ID_NAME_CHARS = 48


def is_on(train_config) -> bool:
  return str(train_config.wandb).lower() != "off"


def check_installed(train_config):
  """Raises the missing-package error before anything is compiled (process 0 tracks)."""
  if is_on(train_config) and jax.process_index() == 0:
    import_wandb(train_config)


def import_wandb(train_config):
  """The wandb module; a ValueError naming train.wandb and the extra when it is missing."""
  try:
    return importlib.import_module("wandb")
  except ImportError:
    raise ValueError(f"train.wandb={train_config.wandb!r} needs the wandb package, which is "
                     f"not installed: {INSTALL_HINT}") from None


def run_id(workdir: str | os.PathLike) -> str:
  """The W&B run id of a workdir: its folder name (made safe) and a hash of its real path.

  The same workdir always gives the same id, so a resumed run continues its W&B run. The
  folder name alone would not do: a sweep's run folders repeat leaf names (`pre/seed1`,
  `post/seed1`), and W&B ids are unique only within a project. A run folder moved elsewhere
  gets a new id unless train.wandb_id names the old one.
  """
  path = os.path.realpath(os.fspath(workdir))
  name = _UNSAFE_ID_CHARS.sub("_", os.path.basename(path)).strip("_") or "run"
  digest = hashlib.sha256(path.encode("utf-8")).hexdigest()[:8]
  return f"{name[:_ID_NAME_CHARS]}-{digest}"


class WandbTracker:
  """One W&B run: rows of scalars by step (merged across splits), the summary, the finish."""

  def __init__(self, run):
    self.run = run
    self._rows: dict[int, dict[str, float]] = {}

  def log(self, step: int, split: str, values: Mapping[str, float]):
    row = self._rows.setdefault(int(step), {})
    row.update({f"{split}/{name}": float(value) for name, value in values.items()})
    newest = max(self._rows)
    for open_step in sorted(self._rows):
      if open_step >= newest - _LATE_STEPS:
        break
      self.run.log(self._rows.pop(open_step), step=open_step)

  def flush(self):
    for open_step in sorted(self._rows):
      self.run.log(self._rows.pop(open_step), step=open_step)

  def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0):
    """Sends the open rows and `summary` (summary.json's contents), then ends the run;
    exit_code 1 marks it failed in W&B (a raised error)."""
    self.flush()
    if summary:
      self.run.summary.update(dict(summary))
    self.run.finish(exit_code=exit_code)


def start(config, workdir: str | os.PathLike) -> WandbTracker | None:
  """A WandbTracker for this run (train.wandb online or offline, process 0), else None."""
  train = config.train
  if not is_on(train) or jax.process_index() != 0:
    return None
  wandb = import_wandb(train)
  workdir = os.fspath(workdir)
  mode = str(train.wandb).lower()
  try:
    run = wandb.init(
        project=train.wandb_project,
        entity=train.wandb_entity or None,
        group=train.wandb_group or None,
        name=train.wandb_name or os.path.basename(os.path.realpath(workdir)),
        id=train.wandb_id or run_id(workdir),
        resume="allow",
        mode=mode,
        dir=workdir,  # W&B writes into dir/wandb/
        config=config.to_dict(),
        # A resume may raise train.steps (or change any train.* key): not a conflict.
        allow_val_change=True,
        # Our own run beside any the caller has open, never one of theirs returned.
        reinit="create_new",
        # The loop prints a progress bar, and the code is in git: capturing either only
        # costs time and space.
        settings=wandb.Settings(console="off", save_code=False),
    )
  except Exception as e:  # pylint: disable=broad-except
    # W&B's errors (no API key, no network, a refused project) span lines and name neither
    # our field nor what to change.
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise RuntimeError(f"train.wandb={mode}: W&B could not start the run: {first_line} "
                       "(train.wandb=offline needs no network; `wandb sync` uploads later)"
                       ) from e
  return WandbTracker(run)
