"""model.loss_chunks: the head + cross-entropy in sequence slices gives the same loss and
gradients as the whole logits at once (against a closed form in float64 and against the
unchunked model), keeps the B x L x V logits out of the compiled program's memory, and a
count that does not divide the sequence is refused before compilation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import losses, model as model_lib
from geonorm_jax.training import config as config_lib, train


def test_chunked_cross_entropy_and_gradients_match_the_closed_form():
  """Logits x W: loss = mean NLL, d/dlogits = (softmax - onehot) / N, chained to x and W."""
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(2, 8, 5)), rng.normal(size=(5, 11))
  targets = rng.integers(0, 11, (2, 8))
  logits = x @ w
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  onehot = np.eye(11)[targets]
  expected = -np.sum(log_probs * onehot) / targets.size
  dlogits = (np.exp(log_probs) - onehot) / targets.size
  with jax.enable_x64(True):
    loss_of = lambda x, w: losses.chunked_loss_terms(lambda h: h @ w, x, targets,
                                                     chunks=4).cross_entropy
    loss = loss_of(jnp.float64(x), jnp.float64(w))
    grad_x, grad_w = jax.grad(loss_of, argnums=(0, 1))(jnp.float64(x), jnp.float64(w))
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(grad_x, dlogits @ w.T, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(grad_w, np.einsum("bld,blv->dv", x, dlogits), rtol=1e-5, atol=1e-8)


def _config(extra):
  return config_lib.get_config("tiny,num_layers=2,d_model=32,num_heads=4,seq_len=16,"
                               "max_seq_len=16,batch_size=2," + extra)


# pre: tied head and a final LayerNorm; ngpt: its logits scaled by s_z; simplenorm: no final
# norm of its own kind. Every parameter's gradient, the head's and the embedding's included.
@pytest.mark.parametrize("placement", ["pre", "ngpt", "simplenorm"])
def test_lm_loss_in_chunks_equals_the_whole_logits(placement):
  tokens_BxL1 = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
  results = []
  for chunks in (1, 4):
    config = _config(f"placement={placement},loss_chunks={chunks}")
    graphdef, state = nnx.split(model_lib.build(config.model, seed=3))
    results.append(jax.value_and_grad(losses.params_loss(graphdef))(state, tokens_BxL1))
  (loss, grads), (chunked_loss, chunked_grads) = results
  np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               chunked_grads, grads)


def _temporary_bytes(chunks):
  config = config_lib.get_config("tiny,num_layers=1,d_model=32,num_heads=4,vocab_size=8192,"
                                 f"seq_len=256,max_seq_len=256,loss_chunks={chunks}")
  graphdef, abstract = model_lib.abstract_params(config.model)
  tokens = jax.ShapeDtypeStruct((4, 257), jnp.int32)
  compiled = jax.jit(jax.grad(losses.params_loss(graphdef))).lower(abstract, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_keep_the_logits_out_of_memory():
  logits_bytes = 4 * 256 * 8192 * 4  # B x L x V float32
  whole, chunked = _temporary_bytes(1), _temporary_bytes(16)
  assert whole > 2 * logits_bytes, whole  # the logits and their gradient live at once
  assert chunked < logits_bytes / 2, (whole, chunked)  # not even half of them do


def test_a_count_that_does_not_divide_the_sequence_is_refused():
  with pytest.raises(ValueError, match=r"model.loss_chunks=3 does not divide data.seq_len=16"):
    train.validate(_config("loss_chunks=3"))
  with pytest.raises(ValueError, match=r"model.loss_chunks=0 must be positive"):
    train.validate(_config("loss_chunks=0"))
