"""Converted Hugging Face GPT-2 and LLaMA give the same logits as the originals.

The HF models are random-initialised from small configs (no download). Every parameter is
then nudged with noise, so that norms' gains are not all 1 and biases not all 0: a swapped
gain and bias, or a transposed square matrix, would otherwise go unnoticed.
"""
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # a test extra: `pip install -e ".[test]"`
import transformers
from flax import nnx

from geonorm_jax.interop import convert
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn.spec import resolve

pytestmark = pytest.mark.slow  # imports torch and transformers

TOLERANCE = 1e-4  # max abs logit difference, float32 on both sides
BATCH, LENGTH = 2, 24


def _perturb_(hf_model, scale=0.05):
  with torch.no_grad():
    for param in hf_model.parameters():  # deduplicated: a tied head is nudged once
      param.add_(scale * torch.randn_like(param))
  return hf_model


def _hf_model(model_class, hf_config, seed=0):
  torch.manual_seed(seed)
  hf_config._attn_implementation = "eager"
  return _perturb_(model_class(hf_config).float().eval())


def _gpt2(**overrides):
  fields = dict(n_layer=2, n_embd=64, n_head=4, n_inner=96, vocab_size=160, n_positions=32,
                layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                bos_token_id=0, eos_token_id=0)
  fields.update(overrides)
  return _hf_model(transformers.GPT2LMHeadModel, transformers.GPT2Config(**fields))


def _llama(**overrides):
  fields = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=96, vocab_size=192, max_position_embeddings=64,
                rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False)
  fields.update(overrides)
  return _hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**fields))


def _max_logit_difference(hf_model, our_model, vocab_size):
  tokens = np.random.default_rng(0).integers(0, vocab_size, (BATCH, LENGTH))
  with torch.no_grad():
    hf_logits = hf_model(torch.from_numpy(tokens)).logits.numpy()
  our_logits = np.asarray(our_model(jnp.asarray(tokens, jnp.int32)))
  assert our_logits.dtype == np.float32
  assert our_logits.shape == hf_logits.shape
  return float(np.max(np.abs(our_logits - hf_logits)))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_logits_match(tied):
  hf_model = _gpt2(tie_word_embeddings=tied, layer_norm_epsilon=1e-3)
  config, model = convert.from_hf_gpt2(convert.to_numpy(hf_model.state_dict()), hf_model.config)
  assert config.model.placement == "pre" and (model.head is None) == tied
  assert config.model.norm_eps == 1e-3
  assert _max_logit_difference(hf_model, model, config.model.vocab_size) < TOLERANCE


@pytest.mark.parametrize("overrides", [
    dict(num_key_value_heads=2),  # grouped-query attention, untied head
    dict(tie_word_embeddings=True),
    dict(num_key_value_heads=1, rope_parameters=dict(rope_type="default", rope_theta=100.0)),
], ids=["gqa_untied", "tied", "mqa_rope_theta_100"])
def test_llama_logits_match(overrides):
  hf_model = _llama(**overrides)
  config, model = convert.from_hf_llama(convert.to_numpy(hf_model.state_dict()), hf_model.config)
  assert resolve(config.model).tie_embeddings == hf_model.config.tie_word_embeddings
  assert config.model.num_kv_heads == hf_model.config.num_key_value_heads
  assert _max_logit_difference(hf_model, model, config.model.vocab_size) < TOLERANCE


def test_llama_rope_theta_is_read():
  hf_config = transformers.LlamaConfig(
      num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
      rope_parameters=dict(rope_type="default", rope_theta=100.0))
  config = convert.llama_config(hf_config)
  assert config.model.rope_theta == 100.0


def test_gpt2_parameter_count_matches():
  hf_model = _gpt2()
  _, model = convert.from_hf_gpt2(convert.to_numpy(hf_model.state_dict()), hf_model.config)
  hf_count = sum(p.numel() for p in hf_model.parameters())
  assert model_lib.count_params(nnx.state(model, nnx.Param)) == hf_count


def test_bare_model_and_bfloat16_state_dicts_load():
  hf_model = _gpt2()
  bare = {k.removeprefix("transformer."): v.to(torch.bfloat16)
          for k, v in hf_model.state_dict().items()}
  state_dict = convert.to_numpy(bare)
  assert state_dict["wte.weight"].dtype == np.float32
  _, model = convert.from_hf_gpt2(state_dict, hf_model.config)
  np.testing.assert_array_equal(np.asarray(model.embed[...]), state_dict["wte.weight"])


def test_wrong_shape_names_the_key():
  hf_model = _gpt2()
  state_dict = convert.to_numpy(hf_model.state_dict())
  key = "transformer.h.1.mlp.c_fc.weight"
  state_dict[key] = np.zeros((64, 100), np.float32)
  with pytest.raises(ValueError, match=r"h\.1\.mlp\.c_fc\.weight.*\(64, 100\).*\(64, 96\)"):
    convert.from_hf_gpt2(state_dict, hf_model.config)


def test_leftover_tensor_is_refused():
  hf_model = _llama()
  state_dict = convert.to_numpy(hf_model.state_dict())
  state_dict["model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
  with pytest.raises(ValueError, match=r"q_proj\.bias"):
    convert.from_hf_llama(state_dict, hf_model.config)


@pytest.mark.parametrize("family, fields, message", [
    ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)), "RoPE"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("gpt2", dict(activation_function="gelu"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_options_raise(family, fields, message):
  if family == "llama":
    hf_config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64,
                                         num_attention_heads=4, **fields)
    to_ours = convert.llama_config
  else:
    hf_config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, **fields)
    to_ours = convert.gpt2_config
  with pytest.raises(ValueError, match=message):
    to_ours(hf_config)
