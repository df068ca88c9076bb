"""LLaMA-2 1B-class / 7B and LLaMA-3 8B architectures on pre-tokenized data.

    python -m geonorm_jax train --config=configs/llama.py:llama2_1b --workdir=runs/llama2_1b \\
        --config.data.path='tokens/train_*.bin' --config.data.val_path=tokens/val.bin
    python -m geonorm_jax train --config=configs/llama.py:llama2_7b,placement=simplenorm \\
        --workdir=runs/llama2_7b_simplenorm --config.data.path=...

ARG is SIZE[,key=value,...] with SIZE one of llama2_1b, llama2_7b, llama3_8b; the other items
are geonorm_jax.training.config presets and win over the recipe below.
Data: token ids from the model's own tokenizer (this codebase ships none for LLaMA).
LLaMA-2's 32000-token vocabulary fits uint16, so the default source is nanogpt_bin; LLaMA-3's
128256 tokens do not, so llama3_8b reads array_record (int32 tokens per record).
Recipe: the LLaMA-2 paper's (AdamW 0.9/0.95, eps 1e-5, lr 3e-4 cosine to 3e-5, 2000 warmup
steps, wd 0.1, clip 1.0, 4M tokens per step = 1024 x 4096); the number of steps is yours to
choose (--config.train.steps). Set --config.train.grad_accum, --config.mesh.fsdp and
--config.model.dtype=bfloat16 for the hardware.
Runtime: an accelerator job (a 2-core CPU cannot train it).
Expected result: not measured here (needs an accelerator pod); SimpleGPT reports 2.208
(SimpleNorm) vs 2.290 (LLaMA2 + QK-norm) training loss at 7B, 60K steps.
"""
from geonorm_jax.training import config as config_lib

_SOURCES = {"llama2_1b": "nanogpt_bin", "llama2_7b": "nanogpt_bin", "llama3_8b": "array_record"}
_RECIPE = ("data.batch_size=1024,train.steps=100000,train.lr=3e-4,"
           "train.min_lr_ratio=0.1,train.warmup_steps=2000,train.schedule=cosine,train.b1=0.9,"
           "train.b2=0.95,train.eps=1e-5,train.weight_decay=0.1,train.clip_norm=1.0,"
           "train.eval_every=1000,train.eval_batches=50,checkpoint.every=2000")


def get_config(arg=None):
  size, _, rest = (arg or "llama2_1b").partition(",")
  if size not in _SOURCES:
    raise ValueError(f"configs/llama.py: size {size!r} is unknown; valid: {', '.join(_SOURCES)}")
  seq_len = 8192 if size == "llama3_8b" else 4096
  recipe = f"{_RECIPE},data.source={_SOURCES[size]},data.seq_len={seq_len}"
  return config_lib.get_config(",".join(filter(None, [size, recipe, rest])))
