"""A run's saved config as an ml_collections config file: `--config=<this file>:RUN` is
RUN/config.json laid over the base config.

`python -m geonorm_jax replay` passes it itself when no --config is given, so that
--config.X=... overrides apply to the run's own config (config_flags defines override flags
only for a config file it has loaded).
"""
from geonorm_jax.training import train


def get_config(workdir):
  return train.config_from_workdir(workdir)
