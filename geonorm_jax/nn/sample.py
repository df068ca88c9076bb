"""Autoregressive sampling from a trained Transformer, with a K/V cache (the default) or
without one.

Cached: the prompt, padded into a buffer of C = context_len slots, is run once (the model's
`prefill`), which leaves every layer's keys and values; then each new token runs alone at its
absolute position, reading those caches and writing its own into them (`decode`). Uncached
(`use_cache=False`): every token re-runs the full model over the buffer and reads the logits
at the last filled slot. Either way the shapes never change and positions are traced, so one
compiled program per kind of step (prefill, one-token step, full-window step) serves every
token of every call with the same model, buffer length and top_k.

When the window is full, the uncached path slides: the oldest token drops out (nanoGPT's
`idx[:, -block_size:]`) and every other token moves one position down. A cache cannot slide
the same way: its keys and values were computed at their old absolute positions (learned
positions or RoPE) and, past the first layer, from a context that still held the dropped
token. So once the C slots are full, the cached path re-runs the last window in full for each
further token, exactly as the uncached path does: the two give the same tokens throughout,
and the cache's speed-up covers the tokens generated while the window has room. Pass a
context_len of at least prompt + num_tokens to keep it for the whole call.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from geonorm_jax.data import sources as data_sources

# How many times each step has been traced, for tests that check we never recompile per
# token: the full-window step, the cached path's prefill and its one-token step.
step_trace_count = 0
prefill_trace_count = 0
decode_trace_count = 0


def _choose(logits_V, base_key, index, temperature, top_k):
  """Token `index` of the call: argmax at temperature 0, else a sample among the top_k (0: all)
  with the key folded from the seed's and the index, the same on both paths."""
  key = jax.random.fold_in(base_key, index)
  logits_V = logits_V.astype(jnp.float32)
  if top_k > 0:
    kth_largest = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth_largest, -jnp.inf, logits_V)
  greedy_token = jnp.argmax(logits_V)
  # The max keeps the division finite on the greedy branch, whose sample is discarded.
  scaled_logits_V = logits_V / jnp.maximum(temperature, 1e-6)
  sampled_token = jax.random.categorical(key, scaled_logits_V)
  return jnp.where(temperature > 0, sampled_token, greedy_token).astype(jnp.int32)


def _append(buffer_1xC, num_filled, token):
  """(buffer, num_filled) with `token` after the filled slots; a full buffer drops its oldest
  token first, so the new one lands in the last slot."""
  capacity = buffer_1xC.shape[1]
  is_full = num_filled >= capacity
  shifted_1xC = jnp.where(is_full, jnp.roll(buffer_1xC, -1, axis=1), buffer_1xC)
  write_at = jnp.minimum(num_filled, capacity - 1)
  new_buffer_1xC = jax.lax.dynamic_update_index_in_dim(
      shifted_1xC, token.astype(buffer_1xC.dtype)[None], write_at, axis=1)
  return new_buffer_1xC, jnp.minimum(num_filled + 1, capacity)


_append_jit = jax.jit(_append)


def _sample_step(graphdef, params, buffer_1xC, num_filled, base_key, index, temperature, *,
                 top_k):
  """Samples the token after the `num_filled` tokens in the buffer and appends it."""
  global step_trace_count
  step_trace_count += 1
  model = nnx.merge(graphdef, params)
  # Causal attention: slots after num_filled hold padding that cannot reach this position.
  logits_1xCxV = model(buffer_1xC)
  logits_V = jax.lax.dynamic_index_in_dim(logits_1xCxV[0], num_filled - 1, keepdims=False)
  token = _choose(logits_V, base_key, index, temperature, top_k)
  return (*_append(buffer_1xC, num_filled, token), token)


def _prefill_step(graphdef, params, buffer_1xC, num_filled, base_key, temperature, *, top_k):
  """The window's caches and the token after its `num_filled` tokens (the same forward pass
  as _sample_step's: the padding slots' keys and values are overwritten before any read)."""
  global prefill_trace_count
  prefill_trace_count += 1
  model = nnx.merge(graphdef, params)
  logits_1xCxV, caches = model.prefill(buffer_1xC)
  logits_V = jax.lax.dynamic_index_in_dim(logits_1xCxV[0], num_filled - 1, keepdims=False)
  return caches, _choose(logits_V, base_key, 0, temperature, top_k)


def _decode_step(graphdef, params, caches, buffer_1xC, token, position, base_key, index,
                 temperature, *, top_k):
  """`token` enters at `position` (< C): into the buffer, and as keys and values into the
  caches. Returns both, the token after it (the call's token `index`) and position + 1."""
  global decode_trace_count
  decode_trace_count += 1
  model = nnx.merge(graphdef, params)
  logits_1x1xV, caches = model.decode(token.reshape(1, 1), caches, position)
  buffer_1xC = jax.lax.dynamic_update_index_in_dim(
      buffer_1xC, token.astype(buffer_1xC.dtype)[None], position, axis=1)
  token = _choose(logits_1x1xV[0, 0], base_key, index, temperature, top_k)
  return caches, buffer_1xC, token, position + 1


@functools.lru_cache(maxsize=16)
def _compiled_steps(graphdef, top_k):
  """(full-window, prefill, decode) steps, jitted for one model structure and top_k.

  Built once per structure and reused by every call: hashing a graphdef takes milliseconds,
  which passing it as a static jit argument would pay on every token.
  """
  def bind(step, **jit_options):
    return jax.jit(functools.partial(step, graphdef, top_k=top_k), **jit_options)
  # The decode step updates the caches and the buffer (arguments 1 and 2) in place.
  return bind(_sample_step), bind(_prefill_step), bind(_decode_step, donate_argnums=(1, 2))


def generate(model, prompt_tokens, num_tokens, *, temperature=0.8, top_k=0, seed=0,
             context_len=None, use_cache=True):
  """Continues `prompt_tokens` by `num_tokens` tokens; returns only the new ones (int32).

  Args:
    model: a `model.Transformer` (any placement or backbone).
    prompt_tokens: 1-D token ids, at least one. Only the last `context_len` are read.
    num_tokens: how many tokens to generate.
    temperature: softmax temperature; 0 means greedy (argmax), with no randomness.
    top_k: sample only among the k most likely tokens; 0 means the whole vocabulary.
    seed: the same seed, model and prompt give the same tokens.
    context_len: the buffer length; defaults to the model's max_seq_len. A model trained on
      shorter windows than max_seq_len may do better with the training length here.
    use_cache: decode with a K/V cache (same tokens, far less work per token while the
      window has room; see the module docstring for a full window).
  """
  spec = model.spec
  capacity = spec.max_seq_len if context_len is None else int(context_len)
  if not 0 < capacity <= spec.max_seq_len:
    raise ValueError(f"context_len={capacity} must lie in [1, model.max_seq_len="
                     f"{spec.max_seq_len}]")
  if not 0 <= top_k <= spec.vocab_size:
    raise ValueError(f"top_k={top_k} must lie in [0, vocab_size={spec.vocab_size}]")
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
  prompt = np.asarray(prompt_tokens, dtype=np.int32).reshape(-1)
  if prompt.size == 0:
    raise ValueError("the prompt is empty; give at least one token to condition on")
  if prompt.min() < 0 or prompt.max() >= spec.vocab_size:
    raise ValueError(f"prompt token ids must lie in [0, vocab_size={spec.vocab_size})")

  prompt = prompt[-capacity:]
  buffer_1xC = np.zeros((1, capacity), np.int32)
  buffer_1xC[0, :prompt.size] = prompt
  buffer_1xC = jnp.asarray(buffer_1xC)
  num_filled = jnp.asarray(prompt.size, jnp.int32)
  temperature = jnp.asarray(temperature, jnp.float32)
  graphdef, params = nnx.split(model)
  base_key = jax.random.key(seed)
  if num_tokens <= 0:
    return np.zeros((0,), np.int32)
  sample_step, prefill_step, decode_step = _compiled_steps(graphdef, int(top_k))
  # Tokens stay on the device until the end, so steps are dispatched without waiting.
  if use_cache:
    caches, token = prefill_step(params, buffer_1xC, num_filled, base_key, temperature)
    room = capacity - prompt.size  # decode steps before the window is full
    position = num_filled  # where `token` goes
  else:
    buffer_1xC, num_filled, token = sample_step(params, buffer_1xC, num_filled, base_key,
                                                np.int32(0), temperature)
  tokens = [token]
  for index in range(1, num_tokens):
    if use_cache and room > 0:
      caches, buffer_1xC, token, position = decode_step(
          params, caches, buffer_1xC, token, position, base_key, np.int32(index), temperature)
      room -= 1
    else:
      if use_cache:
        # The window is full: from here on, the uncached path's sliding steps (see above).
        buffer_1xC, num_filled = _append_jit(buffer_1xC, position, token)
        use_cache, caches = False, None
      buffer_1xC, num_filled, token = sample_step(params, buffer_1xC, num_filled, base_key,
                                                  np.int32(index), temperature)
    tokens.append(token)
  return np.asarray(jax.device_get(tokens), dtype=np.int32)


def generate_text(model, config, prompt, num_tokens, **sampling):
  """Text in, text out: `prompt` encoded with the run's tokenizer, continued, decoded.

  The buffer is the trained window (config.data.seq_len): positions beyond it never saw a
  gradient. `sampling` takes generate's temperature, top_k and seed.
  """
  prompt_tokens = data_sources.encode_text(prompt, config.data.tokenizer)
  tokens = generate(model, prompt_tokens, num_tokens, context_len=config.data.seq_len,
                    **sampling)
  return data_sources.decode(tokens, config.data)
