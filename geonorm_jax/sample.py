"""Autoregressive sampling from a trained Transformer, without a KV cache.

Every step runs the full model over a fixed-size token buffer and reads the logits at the
last filled slot. The buffer never changes shape and the number of filled slots is a traced
argument, so one compiled step serves every token of every call with the same model, buffer
length and top_k. Once the buffer is full it slides: the oldest token drops out, like
nanoGPT's `idx[:, -block_size:]`.

This is O(context) work per token, which is fine for the small models this codebase trains
on a CPU and for spot-checking bigger ones; it is not a serving path.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from geonorm_jax import data_sources

# How many times `_sample_step` has been traced, for tests that check we never recompile
# per token.
step_trace_count = 0


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k"))
def _sample_step(graphdef, params, buffer_1xC, num_filled, key, temperature, *, top_k):
  """Samples the token after the `num_filled` tokens in the buffer and appends it."""
  global step_trace_count
  step_trace_count += 1
  model = nnx.merge(graphdef, params)
  # Causal attention: slots after num_filled hold padding that cannot reach this position.
  logits_1xCxV = model(buffer_1xC)
  logits_V = jax.lax.dynamic_index_in_dim(logits_1xCxV[0], num_filled - 1, keepdims=False)
  logits_V = logits_V.astype(jnp.float32)
  if top_k > 0:
    kth_largest = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth_largest, -jnp.inf, logits_V)
  greedy_token = jnp.argmax(logits_V)
  # The max keeps the division finite on the greedy branch, whose sample is discarded.
  scaled_logits_V = logits_V / jnp.maximum(temperature, 1e-6)
  sampled_token = jax.random.categorical(key, scaled_logits_V)
  token = jnp.where(temperature > 0, sampled_token, greedy_token).astype(buffer_1xC.dtype)

  capacity = buffer_1xC.shape[1]
  is_full = num_filled >= capacity
  # A full buffer drops its oldest token, so the new one always lands in the last slot.
  shifted_1xC = jnp.where(is_full, jnp.roll(buffer_1xC, -1, axis=1), buffer_1xC)
  write_at = jnp.minimum(num_filled, capacity - 1)
  new_buffer_1xC = jax.lax.dynamic_update_index_in_dim(shifted_1xC, token[None], write_at, axis=1)
  return new_buffer_1xC, jnp.minimum(num_filled + 1, capacity), token


def generate(model, prompt_tokens, num_tokens, *, temperature=0.8, top_k=0, seed=0,
             context_len=None):
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
  # Tokens stay on the device until the end, so steps are dispatched without waiting.
  tokens = []
  for index in range(num_tokens):
    key = jax.random.fold_in(base_key, index)
    buffer_1xC, num_filled, token = _sample_step(graphdef, params, buffer_1xC, num_filled, key,
                                                 temperature, top_k=int(top_k))
    tokens.append(token)
  if not tokens:
    return np.zeros((0,), np.int32)
  return np.asarray(jnp.stack(tokens), dtype=np.int32)


def generate_text(model, config, prompt, num_tokens, **sampling):
  """Text in, text out: `prompt` encoded with the run's tokenizer, continued, decoded.

  The buffer is the trained window (config.data.seq_len): positions beyond it never saw a
  gradient. `sampling` takes generate's temperature, top_k and seed.
  """
  prompt_tokens = data_sources.encode_text(prompt, config.data.tokenizer)
  tokens = generate(model, prompt_tokens, num_tokens, context_len=config.data.seq_len,
                    **sampling)
  return data_sources.decode(tokens, config.data)
