"""The K/V cache: decoding one token at a time against the cache gives the full forward's
logits, the cached sampler gives the uncached one's tokens (also once the window is full),
and each kind of step compiles once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import sample
from geonorm_jax.training import config as config_lib

# Learned positions (gpt2), RoPE + grouped-query attention (llama, 4 heads on 2 KV heads),
# the placements whose attention differs (nGPT's unit q/k, SimpleNorm's norms on q/k/v,
# QK-norm), GeoNorm's depth schedule, and the scanned layout. Every other part of a block
# acts token by token, the same with or without a cache.
CASES = [
    "backbone=gpt2,placement=pre",
    "backbone=llama,placement=geonorm,geo_schedule=harmonic",
    "backbone=llama,placement=ngpt,scan_layers=true",
    "backbone=gpt2,placement=simplenorm,qk_norm=true,scan_layers=true",
]


def _model(arg, max_seq_len=16, seed=3):
  # init_std 0.3 spreads the logits, so a greedy choice is never a near tie.
  config = config_lib.get_config(
      f"tiny,num_layers=2,d_model=32,num_heads=4,num_kv_heads=2,max_seq_len={max_seq_len},"
      f"init_std=0.3,{arg}")
  return model_lib.build(config.model, seed=seed)


@pytest.mark.parametrize("arg", CASES)
def test_decoding_against_the_cache_gives_the_full_forward_logits(arg):
  model = _model(arg)
  tokens_1x12 = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
  prompt_length, capacity = 5, 16

  @nnx.jit
  def run(model, tokens_1x12):
    full_1x12xV = model(tokens_1x12)
    # The prompt padded into the window: prefill writes every slot, padding included.
    window_1xC = jnp.zeros((1, capacity), jnp.int32).at[:, :prompt_length].set(
        tokens_1x12[:, :prompt_length])
    prefill_1xCxV, caches = model.prefill(window_1xC)
    decoded = []
    for position in range(prompt_length, 12):
      logits_1x1xV, caches = model.decode(tokens_1x12[:, position:position + 1], caches,
                                          jnp.asarray(position))
      decoded.append(logits_1x1xV[:, 0])
    return full_1x12xV, prefill_1xCxV, jnp.stack(decoded, axis=1)

  full, prefill, decoded = run(model, tokens_1x12)
  np.testing.assert_allclose(prefill[:, :prompt_length], full[:, :prompt_length], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(decoded, full[:, prompt_length:], rtol=1e-4, atol=1e-4)
  # The positions matter: the same token decoded at another position gives other logits.
  assert float(jnp.abs(full[0, 6] - full[0, 7]).max()) > 1e-2


@pytest.mark.parametrize("arg", CASES[:3])
def test_cached_greedy_tokens_equal_the_uncached_ones_before_and_after_the_window_fills(arg):
  model = _model(arg, max_seq_len=12)
  prompt = [5, 17, 200, 3]
  # 4 + 20 > 12: 8 tokens from the cache, then the full window slides for the other 12.
  cached = sample.generate(model, prompt, 20, temperature=0.0)
  uncached = sample.generate(model, prompt, 20, temperature=0.0, use_cache=False)
  assert cached.tolist() == uncached.tolist()
  assert len(set(cached.tolist())) > 3  # not one token repeated


def test_each_step_compiles_once_and_a_full_window_uses_the_full_step():
  model = _model("backbone=gpt2,placement=pre", max_seq_len=32)
  before = (sample.prefill_trace_count, sample.decode_trace_count, sample.step_trace_count)

  def traces():
    now = (sample.prefill_trace_count, sample.decode_trace_count, sample.step_trace_count)
    return tuple(a - b for a, b in zip(now, before))

  sample.generate(model, [1, 2], 20, temperature=1.0, top_k=7, seed=1)
  assert traces() == (1, 1, 0)  # 19 tokens from one compiled decode step, no full re-run
  # Another prompt length, seed or temperature reuses both programs.
  sample.generate(model, [3, 4, 5, 6], 10, temperature=0.5, top_k=7, seed=2)
  assert traces() == (1, 1, 0)
  # Past the window (context_len 8): the sliding full-window step takes over, compiled once.
  sample.generate(model, [1, 2, 3], 12, temperature=0.0, top_k=7, context_len=8)
  assert traces()[2] == 1


def test_sampling_with_the_cache_is_seeded_like_the_uncached_path():
  model = _model("backbone=llama,placement=geonorm", max_seq_len=16)
  cached = sample.generate(model, [1, 2, 3], 10, temperature=1.0, seed=7)
  uncached = sample.generate(model, [1, 2, 3], 10, temperature=1.0, seed=7, use_cache=False)
  assert cached.tolist() == uncached.tolist()
  assert not np.array_equal(cached, sample.generate(model, [1, 2, 3], 10, temperature=1.0,
                                                    seed=8))
