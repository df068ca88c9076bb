"""nanoGPT's CPU recipe on character-level tinyshakespeare: the trainer's calibration.

    python -m geonorm_jax train --config=configs/nanogpt_cpu.py --workdir=/tmp/nanogpt_cpu
    python experiments/calibration.py          # 3 seeds, writes results/calibration/

nanoGPT's README trains `config/train_shakespeare_char.py` on a CPU with
`--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0` and reports a validation loss of about 1.88. The same
recipe here: 4 blocks x 4 heads x 128, context 64, batch 12, 2000 steps (1.5M characters),
peak lr 1e-3 after a 100-step warmup, cosine to 1e-4, AdamW betas (0.9, 0.99), weight decay
0.1 on every matrix (nanoGPT decays all 2-D parameters, its tied embedding and its position
table included), gradient clipping at 1.0, tied head, no dropout (we have none). Byte tokens
are characters on this ASCII file (nanoGPT's 65-symbol vocabulary; the 191 bytes the text never
uses only take probability away until the model learns they never occur); the last 10% of the
file is validation, as in nanoGPT's prepare.py. What differs: our GPT-2 backbone keeps its
linear and LayerNorm biases (nanoGPT's `bias=False`), and we evaluate on 64 batches of 12 x 64
instead of nanoGPT's 20, which only makes the reading less noisy.
Runtime: about 2.5 minutes of training on a quiet 2-core x86_64 CPU.
Expected result (results/calibration/table.md): validation loss at most 1.90, mean of 3 seeds.
ARG is a geonorm_jax.training.config preset string, e.g. "placement=peri".
"""
from geonorm_jax.training import config as config_lib

_RECIPE = ("tiny,tie_embeddings=true,data.source=text,data.path=data/tinyshakespeare.txt,"
           "data.tokenizer=byte,data.seq_len=64,data.batch_size=12,max_seq_len=64,"
           "train.steps=2000,train.lr=1e-3,train.warmup_steps=100,train.min_lr_ratio=0.1,"
           "train.b2=0.99,train.weight_decay=0.1,train.decay_embeddings=true,train.clip_norm=1.0,"
           "train.eval_every=250,train.eval_batches=64,checkpoint.every=500")


def get_config(arg=None):
  return config_lib.get_config(",".join(filter(None, [_RECIPE, arg])))
