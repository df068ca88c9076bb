"""GPT-2 (124M / 350M / 774M / 1.5B) on OpenWebText in nanoGPT's .bin format.

    python -m geonorm_jax train --config=configs/gpt2.py:124m --workdir=runs/gpt2_124m_pre \\
        --config.data.path=owt/train.bin --config.data.val_path=owt/val.bin
    python -m geonorm_jax train --config=configs/gpt2.py:124m,placement=geonorm \\
        --workdir=runs/gpt2_124m_geonorm --config.data.path=owt/train.bin \\
        --config.data.val_path=owt/val.bin

ARG is SIZE[,key=value,...] with SIZE one of 124m, 350m, 774m, 1.5b; the other items are
geonorm_jax.training.config presets (placement=peri, lr=3e-4, ...) and win over the recipe below.
Data: nanoGPT's `data/openwebtext/prepare.py` output (GPT-2 BPE, uint16, no header).
Recipe: nanoGPT's GPT-2 reproduction (AdamW 0.9/0.95, lr 6e-4 cosine to 6e-5, 2000 warmup
steps, wd 0.1, clip 1.0, ~0.5M tokens per step = 480 x 1024, 600k steps). Use
--config.train.grad_accum=K when the batch does not fit; on accelerators set
--config.model.dtype=bfloat16.
Runtime: an accelerator job (a 2-core CPU cannot train it).
Expected result: nanoGPT reaches about 2.85 validation loss on OpenWebText at 124M (its README;
not measured here).
"""
from geonorm_jax.training import config as config_lib

SIZES = ("124m", "350m", "774m", "1.5b")
_RECIPE = ("data.source=nanogpt_bin,data.tokenizer=gpt2,data.seq_len=1024,data.batch_size=480,"
           "train.steps=600000,train.lr=6e-4,train.min_lr_ratio=0.1,train.warmup_steps=2000,"
           "train.schedule=cosine,train.b1=0.9,train.b2=0.95,train.weight_decay=0.1,"
           "train.clip_norm=1.0,train.eval_every=1000,train.eval_batches=200,"
           "checkpoint.every=5000")


def get_config(arg=None):
  size, _, rest = (arg or "124m").partition(",")
  if size not in SIZES:
    raise ValueError(f"configs/gpt2.py: size {size!r} is unknown; valid: {', '.join(SIZES)}")
  return config_lib.get_config(",".join(filter(None, [f"gpt2_{size}", _RECIPE, rest])))
