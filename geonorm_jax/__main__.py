"""`python -m geonorm_jax <command> ...`: see geonorm_jax/cli.py."""
from absl import flags

from geonorm_jax import cli

# absl's --help prints __main__'s docstring and __main__'s flags; both live in cli.py.
__doc__ = cli.__doc__  # pylint: disable=redefined-builtin
flags.adopt_module_key_flags(cli)

if __name__ == "__main__":
  cli.run()
