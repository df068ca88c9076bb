"""Sampling: greedy decoding is the argmax of the full model, one compile, seeded (through the
default, cached path; test_kv_cache.py compares it with the uncached one)."""
from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import sample
from geonorm_jax.training import config as config_lib


def _tiny_model(backbone="gpt2", max_seq_len=8):
  config = config_lib.get_config(
      f"num_layers=1,d_model=32,num_heads=2,max_seq_len={max_seq_len},backbone={backbone}")
  return model_lib.build(config.model, seed=3)


def _greedy_by_full_forward(model, prompt, num_tokens):
  """The reference: rerun the whole model on the last max_seq_len tokens each time."""
  next_token = nnx.jit(lambda m, context_1xL: jnp.argmax(m(context_1xL)[0, -1]))
  tokens = list(prompt)
  window = model.spec.max_seq_len
  for _ in range(num_tokens):
    tokens.append(int(next_token(model, jnp.asarray([tokens[-window:]], jnp.int32))))
  return tokens[len(prompt):]


@pytest.mark.parametrize("backbone", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_greedy_matches_argmax_of_full_logits_through_the_sliding_window(backbone):
  model = _tiny_model(backbone)
  prompt = [5, 17, 200]
  # 12 new tokens with max_seq_len 8: the buffer fills and then slides.
  got = sample.generate(model, prompt, 12, temperature=0.0)
  assert got.dtype == np.int32 and got.shape == (12,)
  assert got.tolist() == _greedy_by_full_forward(model, prompt, 12)


def test_prompt_longer_than_the_context_keeps_its_tail():
  model = _tiny_model()
  prompt = list(range(1, 20))
  got = sample.generate(model, prompt, 4, temperature=0.0)
  assert got.tolist() == _greedy_by_full_forward(model, prompt[-8:], 4)


def test_the_uncached_step_compiles_once_for_all_tokens():
  # (The cached path's steps: tests/test_kv_cache.py.)
  model = _tiny_model(max_seq_len=16)
  before = sample.step_trace_count
  sample.generate(model, [1, 2], 20, temperature=1.0, top_k=7, seed=1, use_cache=False)
  assert sample.step_trace_count - before == 1
  # A new prompt length, seed or temperature reuses the same compiled step.
  sample.generate(model, [3, 4, 5, 6], 5, temperature=0.5, top_k=7, seed=2, use_cache=False)
  assert sample.step_trace_count - before == 1


def test_sampling_is_deterministic_per_seed_and_respects_top_k():
  model = _tiny_model()
  first = sample.generate(model, [1, 2, 3], 16, temperature=1.0, seed=7)
  again = sample.generate(model, [1, 2, 3], 16, temperature=1.0, seed=7)
  other = sample.generate(model, [1, 2, 3], 16, temperature=1.0, seed=8)
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)
  # top_k=1 leaves only the argmax, whatever the temperature.
  top_one = sample.generate(model, [1, 2, 3], 10, temperature=2.0, top_k=1, seed=9)
  np.testing.assert_array_equal(top_one, sample.generate(model, [1, 2, 3], 10, temperature=0.0))


def test_bad_arguments_name_the_problem():
  model = _tiny_model()
  with pytest.raises(ValueError, match="prompt is empty"):
    sample.generate(model, [], 3)
  with pytest.raises(ValueError, match="vocab_size"):
    sample.generate(model, [300], 3)
  with pytest.raises(ValueError, match="context_len"):
    sample.generate(model, [1], 3, context_len=9)
