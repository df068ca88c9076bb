"""Runs `train.train` in a fresh process, for tests that kill, preempt or multi-process it.

  python tests/run_training.py --devices 8 CONFIG WORKDIR [--step_delay S] [--cache_dir D]

CONFIG is a `get_config` string. With mesh.num_processes > 1 in CONFIG, the CPU collectives
are switched to gloo so that the processes (started by the caller, one per process_id) can
all-reduce across each other; train.train then calls jax.distributed.initialize itself.
Prints the summary as one JSON line prefixed with SUMMARY, and whether the run started from
fresh parameters (INIT_STATE), so a test can tell a resumed run from one that restarted.
"""
import argparse
import json
import sys
import time


def _parse_args(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("config")
  parser.add_argument("workdir")
  parser.add_argument("--devices", type=int, default=8)
  # Seconds to sleep before each batch, so a test polling metrics.jsonl can reliably
  # signal the run mid-way instead of racing a loop that takes milliseconds a step.
  parser.add_argument("--step_delay", type=float, default=0.0)
  # A persistent compilation cache shared by a test's runs: later processes skip compiling.
  parser.add_argument("--cache_dir", default="")
  return parser.parse_args(argv)


class _SlowIterator:
  """Delays every batch of a train iterator; get_state/set_state pass through."""

  def __init__(self, inner, delay):
    self._inner, self._delay = inner, delay

  def __iter__(self):
    return self

  def __next__(self):
    time.sleep(self._delay)
    return next(self._inner)

  def get_state(self):
    return self._inner.get_state()

  def set_state(self, state):
    self._inner.set_state(state)


def main(argv):
  args = _parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top

  # Before any JAX op: the device count can't change once the backend is up.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices)
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

  from geonorm_jax.data import windows as data_lib  # pylint: disable=g-import-not-at-top
  from geonorm_jax.hessian import callback as hessian_callback  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train as train_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.get_config(args.config)
  if config.mesh.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

  if args.step_delay > 0:
    make_iterator = data_lib.make_train_iterator
    data_lib.make_train_iterator = lambda *a, **k: _SlowIterator(make_iterator(*a, **k),
                                                                 args.step_delay)

  init_state = train_lib.init_state

  def logged_init_state(*a, **k):
    print("INIT_STATE", flush=True)
    return init_state(*a, **k)
  train_lib.init_state = logged_init_state

  summary = train_lib.train(config, args.workdir, loggers=hessian_callback.step_loggers(config))
  print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
