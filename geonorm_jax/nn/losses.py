"""Next-token cross-entropy in float32, with an optional mask."""
import jax
import jax.numpy as jnp
from flax import nnx


def _token_nll(logits_BxLxV, targets_BxL):
  """-log p(target) of every token, in float32."""
  logits = logits_BxLxV.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  return log_z - jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]


def cross_entropy(logits_BxLxV, targets_BxL, mask_BxL=None):
  """Mean negative log-likelihood over unmasked tokens; returns (loss, token count)."""
  nll_BxL = _token_nll(logits_BxLxV, targets_BxL)
  if mask_BxL is None:
    mask_BxL = jnp.ones_like(nll_BxL)
  mask_BxL = mask_BxL.astype(jnp.float32)
  count = jnp.sum(mask_BxL)
  return jnp.sum(nll_BxL * mask_BxL) / jnp.maximum(count, 1.0), count


def chunked_cross_entropy(logits_fn, x_BxLxD, targets_BxL, chunks):
  """cross_entropy(logits_fn(x), targets)[0], the logits made for L/chunks positions at a time.

  A lax.scan over sequence slices, each rematerialised in the backward pass: the B x L x V
  float32 logits (and their gradient) never exist at once, at the price of making each
  slice's logits twice (MaxText's vocabulary tiling). Slicing the sequence, not the batch,
  keeps the batch axis's sharding. `chunks` must divide L.
  """
  batch, length, width = x_BxLxD.shape
  size = length // chunks
  x_NxBxCxD = x_BxLxD.reshape(batch, chunks, size, width).transpose(1, 0, 2, 3)
  targets_NxBxC = targets_BxL.reshape(batch, chunks, size).transpose(1, 0, 2)

  @jax.checkpoint
  def nll_sum(x_BxCxD, targets_BxC):
    return jnp.sum(_token_nll(logits_fn(x_BxCxD), targets_BxC))

  def add_chunk(total, chunk):
    return total + nll_sum(*chunk), None

  total, _ = jax.lax.scan(add_chunk, jnp.zeros((), jnp.float32), (x_NxBxCxD, targets_NxBxC))
  return total / (batch * length)


def lm_loss(model, tokens_BxL1, perturb=None):
  """Loss of a model on windows of seq_len+1 tokens: inputs [:-1], targets [1:]."""
  inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  if model.spec.loss_chunks > 1:
    return chunked_cross_entropy(model.logits, model.hidden(inputs_BxL, perturb=perturb),
                                 targets_BxL, model.spec.loss_chunks)
  loss, _ = cross_entropy(model(inputs_BxL, perturb=perturb), targets_BxL)
  return loss


def params_loss(graphdef):
  """(params, tokens_BxL1) -> lm_loss: the loss as a function of a split model's parameters."""
  return lambda params, tokens_BxL1: lm_loss(nnx.merge(graphdef, params), tokens_BxL1)
