"""GeoNorm's own setting: GPT-NeoX-style 125M or 1.3B models with the authors' optimizer.

    python -m geonorm_jax train --config=configs/geonorm_paper.py:125m --workdir=runs/geo_125m \\
        --config.data.path='fineweb10B/fineweb_train_*.bin' \\
        --config.data.val_path='fineweb10B/fineweb_val_*.bin'
    python -m geonorm_jax train --config=configs/geonorm_paper.py:125m,placement=pre \\
        --workdir=runs/pre_125m --config.data.path=...

ARG is SIZE[,key=value,...] with SIZE 125m or 1.3b; the rest are geonorm_jax.training.config presets
(placement=pre for the baseline, geo_schedule=sqrt, ...) and win over the recipe below.
Model (paper / authors' code): RoPE, untied head, placement geonorm with the harmonic
schedule (the update as implemented: docs/placements.md). Optimizer (the authors' recipe,
Zheng et al., 2026, GeoNorm): Adam(0.9, 0.95), lr 6e-4 cosine to 6e-5, 1% warmup, weight
decay 0.1, clip 1.0. The warmup follows train.steps, also when it is overridden on the
command line.
Not from the paper (open): the data (its Arxiv/Books3 sets are not public; the default is
GPT-2-tokenized FineWeb shards in llm.c format), seq_len 2048, ~0.5M tokens per step
(256 x 2048) and 20k steps.
Runtime: an accelerator job (a 2-core CPU cannot train it).
Expected result: not measured here (needs an accelerator pod); the GeoNorm paper reports 1.8792
(Arxiv) and 3.4040 (Books3) validation loss at 125M, 3.1759 vs Pre-Norm 3.2067 at 1.3B, on data
this recipe does not have.
"""
from geonorm_jax.training import config as config_lib

SIZES = ("125m", "1.3b")
_RECIPE = ("geo_schedule=harmonic,data.source=fineweb_bin,data.tokenizer=gpt2,"
           "data.seq_len=2048,data.batch_size=256,train.steps=20000,train.lr=6e-4,"
           "train.min_lr_ratio=0.1,train.schedule=cosine,train.b1=0.9,train.b2=0.95,"
           "train.weight_decay=0.1,train.clip_norm=1.0,train.eval_every=1000,"
           "train.eval_batches=50,checkpoint.every=2000")


def get_config(arg=None):
  size, _, rest = (arg or "125m").partition(",")
  if size not in SIZES:
    raise ValueError(f"configs/geonorm_paper.py: size {size!r} is unknown; valid: "
                     f"{', '.join(SIZES)}")
  config = config_lib.get_config(",".join(filter(None, [f"geonorm_{size}", _RECIPE, rest])))
  if "warmup_steps=" not in (rest or ""):
    # A reference, so --config.train.steps=N on the command line moves the warmup with it.
    config.train.warmup_steps = config.train.get_ref("steps") // 100
  return config
