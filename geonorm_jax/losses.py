"""Next-token cross-entropy in float32, with an optional mask."""
import jax
import jax.numpy as jnp
from flax import nnx


def cross_entropy(logits_BxLxV, targets_BxL, mask_BxL=None):
  """Mean negative log-likelihood over unmasked tokens; returns (loss, token count)."""
  logits = logits_BxLxV.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  nll_BxL = log_z - target_logit
  if mask_BxL is None:
    mask_BxL = jnp.ones_like(nll_BxL)
  mask_BxL = mask_BxL.astype(jnp.float32)
  count = jnp.sum(mask_BxL)
  return jnp.sum(nll_BxL * mask_BxL) / jnp.maximum(count, 1.0), count


def lm_loss(model, tokens_BxL1, perturb=None):
  """Loss of a model on windows of seq_len+1 tokens: inputs [:-1], targets [1:]."""
  logits = model(tokens_BxL1[:, :-1], perturb=perturb)
  loss, _ = cross_entropy(logits, tokens_BxL1[:, 1:])
  return loss


def params_loss(graphdef):
  """(params, tokens_BxL1) -> lm_loss: the loss as a function of a split model's parameters."""
  return lambda params, tokens_BxL1: lm_loss(nnx.merge(graphdef, params), tokens_BxL1)
