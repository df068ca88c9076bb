"""model.qk_norm_scope: `head` (RMSNorm over each head's head_dim) and `full` (RMSNorm over the
whole projected q and k, before the split into heads and before RoPE), each checked against
an independent numpy float64 forward pass of a one-block Pre-LN model on both backbones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import paths
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import checkpoint
from geonorm_jax.training import config as config_lib

EPS = 1e-5
VOCAB = 64


def _config(backbone, scope, extra=""):
  return config_lib.get_config(
      f"tiny,backbone={backbone},d_model=32,num_heads=2,num_layers=1,vocab_size={VOCAB},"
      f"qk_norm=true,qk_norm_scope={scope}{extra}")


def _named(state):
  return dict(zip(paths.leaf_paths(state), map(np.asarray, jax.tree.leaves(state))))


def _perturbed(state, qk_gains_one=False):
  """Every parameter moved off its init (gains off 1, biases off 0), seeded by its path, so
  the same path gets the same numbers in two models; qk_gains_one keeps q/k norm gains at 1."""
  names = paths.leaf_paths(state)
  leaves, treedef = jax.tree.flatten(state)
  out = []
  for name, leaf in zip(names, leaves):
    if qk_gains_one and "_norm.gain" in name and ".attn." in name:
      out.append(jnp.ones_like(leaf))
      continue
    rng = np.random.default_rng(sum(map(ord, name)))
    out.append(leaf + jnp.asarray(0.2 * rng.standard_normal(leaf.shape), leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def _rms(x, gain):
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
  return y if gain is None else y * gain


def _layer_norm(x, gain, bias):
  x = x - x.mean(-1, keepdims=True)
  return _rms(x, gain) + bias


def _rope(x_BxLxHxK, theta):
  hd = x_BxLxHxK.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
  angles = np.arange(x_BxLxHxK.shape[1], dtype=np.float64)[:, None] * inv_freq[None]
  angles = np.concatenate([angles, angles], -1)[None, :, None, :]
  half = hd // 2
  rotated = np.concatenate([-x_BxLxHxK[..., half:], x_BxLxHxK[..., :half]], -1)
  return x_BxLxHxK * np.cos(angles) + rotated * np.sin(angles)


def _reference_logits(p, spec, tokens_BxL):
  """The one-block Pre-LN decoder, written out in float64 from the formulas."""
  p = {k: v.astype(np.float64) for k, v in p.items()}
  llama = spec.backbone == "llama"
  lin = lambda x, name: x @ p[f"{name}.kernel"] + (0.0 if llama else p[f"{name}.bias"])
  if llama:
    norm = lambda x, name: _rms(x, p[f"{name}.gain"])
  else:
    norm = lambda x, name: _layer_norm(x, p[f"{name}.gain"], p[f"{name}.bias"])
  batch, length = tokens_BxL.shape
  heads, kv_heads, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
  x = p["embed"][tokens_BxL]
  if not llama:
    x = x + p["positions"][:length]

  h = norm(x, "blocks.0.attn_in_norm")
  q, k, v = (lin(h, f"blocks.0.attn.{r}") for r in "qkv")
  if spec.qk_norm_scope == "full":  # the whole projected width, before the head split
    q, k = _rms(q, p["blocks.0.attn.q_norm.gain"]), _rms(k, p["blocks.0.attn.k_norm.gain"])
  q = q.reshape(batch, length, heads, hd)
  k = k.reshape(batch, length, kv_heads, hd)
  v = v.reshape(batch, length, kv_heads, hd)
  if spec.qk_norm_scope == "head":
    q = _rms(q, p["blocks.0.attn.q_head_norm.gain"])
    k = _rms(k, p["blocks.0.attn.k_head_norm.gain"])
  if llama:
    q, k = _rope(q, spec.rope_theta), _rope(k, spec.rope_theta)
  group = heads // kv_heads
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # head h reads KV h // group
  scores = np.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(hd)
  scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  attn = np.einsum("bhlm,bmhk->blhk", probs, v).reshape(batch, length, heads * hd)
  x = x + lin(attn, "blocks.0.attn.o")

  h = norm(x, "blocks.0.mlp_in_norm")
  if llama:
    gate = lin(h, "blocks.0.mlp.gate")
    hidden = gate / (1 + np.exp(-gate)) * lin(h, "blocks.0.mlp.up")
  else:
    u = lin(h, "blocks.0.mlp.up")
    hidden = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
  x = x + lin(hidden, "blocks.0.mlp.down")
  return norm(x, "final_norm") @ p["head"]


def _model(backbone, scope, extra="", qk_gains_one=False):
  config = _config(backbone, scope, extra)
  graphdef, state = nnx.split(model_lib.build(config.model, seed=3))
  state = _perturbed(state, qk_gains_one)
  return nnx.merge(graphdef, state), _named(state), spec_lib.resolve(config.model)


_TOKENS = np.random.default_rng(7).integers(0, VOCAB, (2, 11))
_CASES = [("llama", ""), ("llama", ",num_kv_heads=1"), ("gpt2", "")]


@pytest.mark.parametrize("backbone,extra", _CASES)
@pytest.mark.parametrize("scope", ["head", "full"])
def test_logits_match_the_float64_formula(backbone, extra, scope):
  model, params, spec = _model(backbone, scope, extra)
  attn = model.blocks[0].attn
  if scope == "full":
    assert attn.q_head_norm is None and attn.k_head_norm is None
    assert attn.q_norm.gain.shape == (32,)
    assert attn.k_norm.gain.shape == (spec.num_kv_heads * spec.head_dim,)
  else:
    assert attn.q_norm is None and attn.k_norm is None
    assert attn.q_head_norm.gain.shape == (16,)
  ours = np.asarray(model(jnp.asarray(_TOKENS, jnp.int32)))
  np.testing.assert_allclose(ours, _reference_logits(params, spec, _TOKENS), rtol=1e-5,
                             atol=2e-5)


@pytest.mark.parametrize("backbone,extra", _CASES)
def test_the_two_scopes_differ_on_the_same_params(backbone, extra):
  head, head_params, _ = _model(backbone, "head", extra, qk_gains_one=True)
  full, full_params, _ = _model(backbone, "full", extra, qk_gains_one=True)
  shared = head_params.keys() & full_params.keys()
  assert shared == {k for k in head_params if "head_norm" not in k}
  for name in shared:
    np.testing.assert_array_equal(head_params[name], full_params[name])
  tokens = jnp.asarray(_TOKENS, jnp.int32)
  assert np.max(np.abs(np.asarray(head(tokens)) - np.asarray(full(tokens)))) > 1e-2


def test_full_scope_gain_follows_norm_gain():
  model = model_lib.build(_config("llama", "full", ",norm_gain=false").model)
  assert model.blocks[0].attn.q_norm.gain is None


def test_a_bad_scope_names_the_field():
  with pytest.raises(ValueError, match=r"model\.qk_norm_scope"):
    spec_lib.resolve(_config("llama", "per_token").model)


def test_head_is_the_default_and_old_checkpoints_compare_equal():
  config = config_lib.get_config("tiny,qk_norm=true")
  assert config.model.qk_norm_scope == "head"
  assert spec_lib.resolve(config.model).qk_norm_scope == "head"
  current = checkpoint.config_fingerprint(config)
  written_before_the_key = {k: v for k, v in current.items() if k != "model.qk_norm_scope"}
  assert checkpoint.differing_fields(written_before_the_key, current) == []
  full = checkpoint.config_fingerprint(
      config_lib.get_config("tiny,qk_norm=true,qk_norm_scope=full"))
  assert checkpoint.differing_fields(written_before_the_key, full) == [
      "model.qk_norm_scope: checkpoint='head', current='full'"]
