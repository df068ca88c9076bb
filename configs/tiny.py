"""The tiny model (4 layers, d_model 128, byte tokens) on the built-in corpus: a 2-core CPU run.

    python -m geonorm_jax train --config=configs/tiny.py --workdir=/tmp/tiny
    python -m geonorm_jax train --config=configs/tiny.py:placement=geonorm --workdir=/tmp/tiny_geo
    python -m geonorm_jax sample --workdir=/tmp/tiny --prompt="The "

ARG is a geonorm_jax.training.config preset string on top of `tiny`, e.g. "placement=peri,dt=0.1".
200 steps of batch 16 x 128 bytes of CPython's documentation (`pydoc_data.topics`), untied
head (see results/placement_sweep/ for why the comparison recipes untie it).
Runtime: about a minute of training on a quiet 2-core x86_64 CPU.
Expected result: the main job (`make run`) trains this config for 250 steps; it reached eval
loss 2.2324 (pre) and 2.2992 (geonorm, harmonic) in results/main/summary.csv.
"""
from geonorm_jax.training import config as config_lib


def get_config(arg=None):
  return config_lib.get_config(",".join(filter(None, ["tiny", arg])))
