"""Replay: rerun steps of a run on its own batches, with every step's per-layer statistics,
as it was or branched with changed settings.

  python -m geonorm_jax replay --workdir=RUN --from_step=S --to_step=E [--name=NAME]
      [--config.train.lr=3e-4 ...]

Restores RUN's newest checkpoint at or before S (none: the initial state, a function of the
seed) with its data-iterator state, and trains from there to E through the training loop
itself (`train.run_loop`), so the steps see the batches RUN saw. The per-layer statistics
(`layers`) and the train record are written at every step; RUN's schedule (train.steps) is
kept. Everything goes to RUN/replays/NAME/ (config.json, metrics.jsonl, tensorboard/,
summary.json); RUN's checkpoints are opened read-only and nothing else in RUN is written, not
even a checkpoint of the replay. Without overrides the losses equal RUN's bit for bit (when
RUN logged per-layer statistics: turning them on adds outputs to the compiled step).

An override may change anything that keeps the shapes of the train state and the batches:
train.* (lr, skip_spikes, ...), the placement's options, mesh.*. One that changes the model's
or the optimizer state's shapes, or the data that chooses the batches, is refused naming the
field, before anything is compiled or written.
"""
import os
import re

import jax

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import sharding as sharding_lib
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train as train_lib

REPLAYS_SUBDIR = "replays"
# What a replay changes in the run's config: statistics and the train record at every step.
_REPLAY_SETTINGS = {"layer_stats_every": 1, "log_every": 1}


class _NoCheckpoints:
  """The loop's checkpointer in a replay: saves nothing and installs no signal handler, so
  Ctrl-C stops a replay at once (there is nothing to save)."""
  durable_step = None
  preempted = interrupted = False

  def install_sigterm_handler(self):
    pass

  def poll(self):
    return None

  def any_process_preempted(self):
    return False

  def should_save(self, step):
    del step
    return False

  def save(self, *args, **kwargs):
    del args, kwargs
    return False

  def wait(self):
    pass

  def close(self):
    pass


def _flat(config):
  """{'train.lr': 1e-3, 'seed': 0, ...} of a config."""
  flat = {}
  for section, values in config.to_dict().items():
    if isinstance(values, dict):
      flat.update({f"{section}.{key}": value for key, value in values.items()})
    else:
      flat[section] = values
  return flat


def overrides_of(run_config, config):
  """{dotted field: value} of every field `config` sets differently from the run's."""
  before = _flat(run_config)
  return {key: value for key, value in _flat(config).items() if before.get(key) != value}


def default_name(from_step, to_step, overrides):
  """from40_to60, then each override as field=value: one folder name per branch."""
  parts = [f"from{from_step}_to{to_step}"]
  parts += [f"{key}={value}" for key, value in sorted(overrides.items())]
  return re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(parts))


def _check_steps(from_step, to_step, config):
  if from_step < 0:
    raise ValueError(f"--from_step={from_step} must be >= 0")
  if to_step <= from_step:
    raise ValueError(f"--to_step={to_step} must be after --from_step={from_step}")
  if to_step > config.train.steps:
    raise ValueError(f"--to_step={to_step} is past train.steps={config.train.steps}, where the "
                     "run's schedule ends")


def _check_name(name, workdir):
  if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
    raise ValueError(f"--name={name!r} must be one folder name (replays go to "
                     f"{os.path.join(workdir, REPLAYS_SUBDIR)}/NAME)")


def _state_shapes(setup):
  """(path, shape, dtype) of every array of the train state: what must match to restore."""
  leaves = jax.tree_util.tree_leaves_with_path(setup.abstract_state)
  return [(jax.tree_util.keystr(path), leaf.shape, leaf.dtype) for path, leaf in leaves]


def _check_branch(run_config, config, overrides, workdir):
  """Refuses, naming the fields, overrides that change the batches or the state's shapes."""
  if "seed" in overrides:
    # seed draws the initial parameters: from the initial state a replay with another seed
    # is another run, and from a checkpoint the seed changes nothing.
    raise ValueError(f"--config.seed={config.seed}: a replay continues {workdir} from its own "
                     f"parameters (seed={run_config.seed}); train a new run for another seed")
  run_data = checkpoint_lib.config_fingerprint(run_config)
  branch_data = checkpoint_lib.config_fingerprint(config)
  for key in sorted(k for k in branch_data if k.startswith("data.")):
    if branch_data[key] != run_data[key]:
      raise ValueError(f"--config.{key}={branch_data[key]!r}: a replay reruns the batches of "
                       f"{workdir}, which data.{key.split('.', 1)[1]} chooses; it cannot change")
  setup = train_lib.make_setup(config)
  # The run's shapes on this replay's mesh: the mesh the run trained on may not exist here.
  run_here = config_lib.from_dict({**run_config.to_dict(), "mesh": config.mesh.to_dict()})
  if _state_shapes(setup) != _state_shapes(train_lib.make_setup(run_here)):
    fields = [k for k in overrides if k.startswith("model.")] or list(overrides)
    raise ValueError(f"{', '.join('--config.' + k for k in fields)}: changes the shapes of the "
                     f"model or optimizer state, so the checkpoints of {workdir} would not "
                     "restore; a replay may change settings that keep them (train.*, a "
                     "placement's options, mesh.*)")
  return setup


def _restore(workdir, run_config, from_step, setup):
  """(state, data_state, meta) of the newest checkpoint <= from_step, else the initial state
  (the run started from it: init_state is a function of the seed)."""
  fingerprint = checkpoint_lib.config_fingerprint(run_config, with_data_content=True)
  ckpt = checkpoint_lib.Checkpointer(workdir, run_config.checkpoint, fingerprint,
                                     read_only=True)
  try:
    steps = [s for s in ckpt.all_steps() if s <= from_step]
    if not steps:
      return train_lib.init_state(setup), None, {}
    state, data_state = train_lib.restore_state(ckpt, max(steps), setup)
    return state, data_state, ckpt.restored_meta
  finally:
    ckpt.close()


def replay(workdir, from_step, to_step, config=None, name=None, loggers=()):
  """Reruns steps (restored step, to_step] of the run in `workdir` into
  workdir/replays/<name>/ and returns the loop's summary with the replay's own fields.

  `config`: the run's config with the overrides (None: the run's own, config.json); `name`:
  the folder (default from the steps and the overrides); `loggers`: StepLoggers, as for
  train.train. Raises ValueError naming the field or flag for a bad step range, name or
  override, and FileNotFoundError for a folder without a run; all before compiling.
  """
  workdir = os.fspath(workdir)
  run_config = train_lib.config_from_workdir(workdir)
  config = run_config if config is None else config
  overrides = overrides_of(run_config, config)
  _check_steps(from_step, to_step, config)
  name = default_name(from_step, to_step, overrides) if name is None else name
  _check_name(name, workdir)
  out_dir = os.path.join(workdir, REPLAYS_SUBDIR, name)
  if os.path.exists(out_dir):
    raise ValueError(f"{out_dir} exists (an earlier replay): pass another --name, or remove it")
  train_lib.validate(config)
  replay_config = config_lib.from_dict(config.to_dict())
  for key, value in _REPLAY_SETTINGS.items():
    replay_config.train[key] = value
  setup = _check_branch(run_config, replay_config, overrides, workdir)
  state, data_state, meta = _restore(workdir, run_config, from_step, setup)
  restored_step = int(state["step"])

  if jax.process_index() == 0:
    os.makedirs(out_dir)  # raises if another replay took the name meanwhile
  writer = train_lib.open_writer(out_dir, replay_config)
  dp = sharding_lib.data_parallel_size(setup.mesh.shape, setup.rules)
  train_iter = data_lib.make_train_iterator(replay_config, data_parallel_size=dp)
  if data_state is not None:
    train_iter.set_state(data_state)
  summary = train_lib.run_loop(setup, state, train_iter, writer, _NoCheckpoints(), loggers,
                               last_step=to_step, restored_meta=meta)
  # The folders as the caller named them: summary.json names no folder of this machine
  # that the caller did not write.
  summary.update(replay_of=workdir, replay_dir=out_dir,
                 restored_step=restored_step, from_step=from_step, to_step=to_step,
                 overrides=overrides)
  train_lib.write_summary(out_dir, summary)
  return summary
