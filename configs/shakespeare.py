"""Character-level tinyshakespeare: the tiny model, 500 steps x batch 16 x 128 characters.

    python -m geonorm_jax train --config=configs/shakespeare.py --workdir=/tmp/shakespeare
    python -m geonorm_jax train --config=configs/shakespeare.py:placement=geonorm \\
        --workdir=/tmp/shakespeare_geo
    python -m geonorm_jax sample --workdir=/tmp/shakespeare --prompt="ROMEO:"

Run from the repository root: data.path is relative to it (the text is ASCII, so byte tokens
are characters). Point --config.data.path at your own copy of the file elsewhere.
ARG is a geonorm_jax.config preset string, e.g. "placement=peri".
The recipe is experiments/shakespeare.py's (lr 3e-3, 50 warmup steps, 16 eval batches), which
records the final losses of this run in results/shakespeare/<placement>.json.
Expected result: see README/results.
"""
from geonorm_jax import config as config_lib

_RUN = ("tiny,data.source=text,data.path=data/tinyshakespeare.txt,"
        "data.tokenizer=byte,data.seq_len=128,data.batch_size=16,train.steps=500,"
        "train.lr=3e-3,train.warmup_steps=50,train.eval_every=100,train.eval_batches=16,"
        "checkpoint.every=500")


def get_config(arg=None):
  return config_lib.get_config(",".join(filter(None, [_RUN, arg])))
