"""The judge scale: the recipe every claim experiment runs by default, where the models have learned.

    python -m geonorm_jax train --config=configs/judge.py --workdir=/tmp/judge
    python -m geonorm_jax train --config=configs/judge.py:placement=geonorm,lr=1e-3 \\
        --workdir=/tmp/judge_geo
    python experiments/norm_zoo.py            # every claim placement at its own tuned LR

The tiny model (4 blocks x 128, 4 heads, untied head, GPT-2 backbone) on character-level
tinyshakespeare (data/tinyshakespeare.txt; the last 10% is validation): 2000 steps x 16 x 128
characters (4.1M, about 2.7 passes over the training text), a 100-step warmup, cosine to a
tenth of the peak LR. Beside the public yardsticks for this file (nanoGPT's CPU recipe ~1.88,
its GPU recipe with a 10.7M model 1.47), Pre-LN ends at validation loss 1.646 +- 0.006 here
(its tuned lr 4e-3, 3 fresh seeds: results/norm_zoo/table.md); the claims no longer run
150-500 steps, which measured how fast each placement leaves the unigram phase (3.35), not
where it ends.
ARG is a geonorm_jax.training.config preset string, e.g. "placement=peri,lr=3e-3". The peak LR here is
only a default: claim experiments tune it per placement (claims.run_tuned).
Runtime: about 8 minutes a run with two runs sharing the 2-core machine (Pre-LN: 241 ms a step,
results/norm_zoo/table.md), so a sweep costs about 4 minutes a run.
"""
from geonorm_jax.training import config as config_lib

_RECIPE = ("tiny,data.source=text,data.path=data/tinyshakespeare.txt,data.tokenizer=byte,"
           "data.seq_len=128,data.batch_size=16,train.steps=2000,train.lr=2e-3,"
           "train.warmup_steps=100,train.min_lr_ratio=0.1,train.eval_every=250,"
           "train.eval_batches=32,checkpoint.every=250")


def get_config(arg=None):
  return config_lib.get_config(",".join(filter(None, [_RECIPE, arg])))
