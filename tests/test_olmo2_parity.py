"""`reordered` with OLMo 2's QK-norm is Hugging Face's OLMo 2 (`Olmo2ForCausalLM`).

A second, independent check of the placement beside tests/torch_reference.py: transformers'
OLMo 2 (the released models' own definition, written from OLMo-core's reordered-norm block)
is random-initialised from a small config (no download), every parameter nudged with noise,
and its weights are loaded into our `reordered` llama model with
`qk_norm=true,qk_norm_scope=full,norm_eps=1e-6`, one HF tensor per parameter of ours. The
mapping lives here, in the test: we do not import OLMo checkpoints.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # a test extra: `pip install -e ".[test]"`
import transformers
from flax import nnx

from geonorm_jax.nn import model as model_lib, paths
from geonorm_jax.training import config as config_lib

pytestmark = pytest.mark.slow  # imports torch and transformers

TOLERANCE = 1e-4  # max abs logit difference, float32 on both sides (as tests/test_hf_parity.py)
BATCH, LENGTH = 2, 24
OURS = ("tiny,backbone=llama,placement=reordered,qk_norm=true,qk_norm_scope=full,"
        "norm_eps=1e-6,tie_embeddings=false,num_layers=2,d_model=64,num_heads=4,num_kv_heads=2,"
        "d_ff=96,vocab_size=128,max_seq_len=64,rope_theta=500000")

# Our dotted name -> HF's key; "kernel" entries are torch Linear weights, stored transposed.
_BLOCK_NAMES = {
    r"attn\.(q|k|v|o)\.kernel": r"self_attn.\1_proj.weight",
    r"attn\.(q|k)_norm\.gain": r"self_attn.\1_norm.weight",
    r"attn_out_norm\.gain": "post_attention_layernorm.weight",
    r"mlp\.(gate|up|down)\.kernel": r"mlp.\1_proj.weight",
    r"mlp_out_norm\.gain": "post_feedforward_layernorm.weight",
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm.gain": "model.norm.weight",
              "head": "lm_head.weight"}


def _hf_key(name):
  if name in _TOP_NAMES:
    return _TOP_NAMES[name]
  block = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
  for ours, theirs in _BLOCK_NAMES.items():
    if block and re.fullmatch(ours, block.group(2)):
      return f"model.layers.{block.group(1)}." + re.sub(ours, theirs, block.group(2))
  raise KeyError(f"no OLMo 2 tensor for our parameter {name}")


def _olmo2(seed=0):
  torch.manual_seed(seed)
  hf_config = transformers.Olmo2Config(
      num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=96, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
      rope_parameters=dict(rope_type="default", rope_theta=500000.0), attention_dropout=0.0,
      tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
  hf_config._attn_implementation = "eager"
  hf_model = transformers.Olmo2ForCausalLM(hf_config).float().eval()
  with torch.no_grad():
    for param in hf_model.parameters():  # gains not 1: a norm on the wrong side would show
      param.add_(0.05 * torch.randn_like(param))
  return hf_model


def _ours_from(hf_model):
  """Our reordered model holding the HF model's weights; every HF tensor used exactly once."""
  hf_state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
  graphdef, state = nnx.split(model_lib.build(config_lib.get_config(OURS).model))
  names = paths.leaf_paths(state)
  leaves = []
  for name, leaf in zip(names, jax.tree.leaves(state)):
    array = hf_state[_hf_key(name)]
    array = array.T if name.endswith("kernel") or name == "head" else array
    assert array.shape == leaf.shape, (name, array.shape, leaf.shape)
    leaves.append(jnp.asarray(array, leaf.dtype))
  unused = set(hf_state) - {_hf_key(name) for name in names}
  assert not unused, f"HF tensors with no place in our model: {sorted(unused)}"
  return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), leaves))


def test_reordered_with_olmo2_qk_norm_is_hf_olmo2():
  hf_model = _olmo2()
  model = _ours_from(hf_model)
  tokens_BxL = np.random.default_rng(0).integers(0, 128, (BATCH, LENGTH))
  with torch.no_grad():
    hf_logits = hf_model(torch.from_numpy(tokens_BxL)).logits.numpy()
  logits = np.asarray(model(jnp.asarray(tokens_BxL, jnp.int32)))
  assert logits.dtype == np.float32 and logits.shape == hf_logits.shape
  assert np.std(hf_logits) > 0.05  # not a trivially small comparison
  assert float(np.max(np.abs(logits - hf_logits))) < TOLERANCE
