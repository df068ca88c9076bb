"""scaled_pre, the placement added through the registry alone: x' = x + dt s F(N(x)), one
learnable scalar s per sublayer, initialised to model.scaled_pre_init."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import losses
from geonorm_jax.nn import model as model_lib
from geonorm_jax.training import config as config_lib

SMALL = "tiny,num_layers=2,d_model=32,num_heads=4"


def _build(arg):
  return model_lib.build(config_lib.get_config(f"{SMALL},{arg}").model, seed=3)


def test_its_config_field_and_parameters_come_from_the_registry():
  assert config_lib.get_base_config().model.scaled_pre_init == 1.0
  model = _build("placement=scaled_pre,scaled_pre_init=0.5")
  for block in model.blocks:
    assert float(block.attn_scale[...]) == 0.5 and float(block.mlp_scale[...]) == 0.5
  with pytest.raises(ValueError, match="model.scaled_pre_init"):
    _build("placement=scaled_pre,scaled_pre_init=-1")


def test_the_update_is_pre_ln_scaled_by_s():
  tokens = jnp.arange(16)[None]
  pre = _build("placement=pre")
  scaled = _build("placement=scaled_pre,scaled_pre_init=1.0")
  # s = 1: the same weights (a constant init draws no random numbers) give Pre-LN's logits.
  np.testing.assert_allclose(scaled(tokens), pre(tokens), rtol=1e-6, atol=1e-6)
  # s = 0: every block is the identity, so the stream never changes.
  zero = _build("placement=scaled_pre,scaled_pre_init=0.0")
  _, streams = zero(tokens, return_streams=True)
  for stream in streams[1:]:
    np.testing.assert_array_equal(stream, streams[0])
  # s = 0.3 on block 0's attention alone: its update is 0.3 times Pre-LN's.
  half = _build("placement=scaled_pre")
  half.blocks[0].attn_scale[...] = jnp.float32(0.3)
  block, x = half.blocks[0], streams[0]
  expected = x + 0.3 * pre.blocks[0].attn(pre.blocks[0].attn_in_norm(x))
  got = x + block.attn_scale[...] * block.attn(block.attn_in_norm(x))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_scale_is_trained():
  model = _build("placement=scaled_pre")
  graphdef, state = nnx.split(model)
  tokens = jnp.arange(17)[None] % 256
  grads = jax.grad(lambda s: losses.lm_loss(nnx.merge(graphdef, s), tokens))(state)
  assert abs(float(grads["blocks"][1]["mlp_scale"][...])) > 0
