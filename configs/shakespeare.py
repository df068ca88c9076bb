"""Character-level tinyshakespeare: the tiny model, 500 steps x batch 16 x 128 characters.

    python -m geonorm_jax train --config=configs/shakespeare.py --workdir=/tmp/shakespeare
    python -m geonorm_jax train --config=configs/shakespeare.py:placement=geonorm \\
        --workdir=/tmp/shakespeare_geo
    python -m geonorm_jax sample --workdir=/tmp/shakespeare --prompt="ROMEO:"

Run from the repository root: data.path is relative to it (the text is ASCII, so byte tokens
are characters). Point --config.data.path at your own copy of the file elsewhere.
ARG is a geonorm_jax.training.config preset string, e.g. "placement=peri".
The head is untied (a tied one makes Post-LN, DeepNorm, Mix-LN and most GeoNorm schedules
collapse at this size: results/placement_sweep/table.md). Every experiment on tinyshakespeare
reads this recipe (experiments/shakespeare.py, placement_sweep.py, stream_probe.py).
Runtime: ~90 s of training on a quiet 2-core x86_64 CPU (the dyt run of results/shakespeare/
results.csv ran at 11,640 tokens/s; the others shared the machine with other jobs).
Expected result (results/shakespeare/table.md): validation loss 2.183 +- 0.023 for pre (3
seeds); every placement below 2.5 except DyT (3.348) and, at this lr, GeoNorm harmonic,
constant and sqrt in 1, 2 and 1 of 3 seeds (collapsed at ~3.35; they learn at lr 1e-3:
results/shakespeare_lr1e-3/).
"""
from geonorm_jax.training import config as config_lib

_RUN = ("tiny,data.source=text,data.path=data/tinyshakespeare.txt,"
        "data.tokenizer=byte,data.seq_len=128,data.batch_size=16,train.steps=500,"
        "train.lr=3e-3,train.warmup_steps=50,train.eval_every=100,train.eval_batches=16,"
        "checkpoint.every=500")


def get_config(arg=None):
  return config_lib.get_config(",".join(filter(None, [_RUN, arg])))
