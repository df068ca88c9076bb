"""Next-token cross-entropy in float32, with an optional mask, and PaLM's z-loss.

The training objective is cross-entropy + `model.z_loss` * mean(log(Z)^2), Z the softmax's
partition function at each token (Chowdhery et al. 2022, PaLM, section 5; Wortsman et al.
2023 find it keeps the output logits from diverging): it pulls log Z towards 0 without
changing which token is likely. The validation loss is the plain cross-entropy.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class LossTerms(NamedTuple):
  """The two terms of the training objective, each a float32 scalar."""
  cross_entropy: Any  # mean -log p(target) over the tokens
  z_loss: Any  # model.z_loss * mean(log(Z)^2) over the same tokens; 0 when off

  @property
  def total(self):
    return self.cross_entropy + self.z_loss


def _token_nll_and_log_z(logits_BxLxV, targets_BxL):
  """(-log p(target), log Z) of every token, in float32."""
  logits = logits_BxLxV.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  return log_z - target_logit, log_z


def _masked_mean(values_BxL, mask_BxL=None):
  """(mean over the unmasked entries, their count)."""
  if mask_BxL is None:
    mask_BxL = jnp.ones_like(values_BxL)
  mask_BxL = mask_BxL.astype(jnp.float32)
  count = jnp.sum(mask_BxL)
  return jnp.sum(values_BxL * mask_BxL) / jnp.maximum(count, 1.0), count


def cross_entropy(logits_BxLxV, targets_BxL, mask_BxL=None):
  """Mean negative log-likelihood over unmasked tokens; returns (loss, token count)."""
  return _masked_mean(_token_nll_and_log_z(logits_BxLxV, targets_BxL)[0], mask_BxL)


def loss_terms(logits_BxLxV, targets_BxL, z_loss=0.0):
  """LossTerms of the whole logits: mean NLL, z_loss * mean(log(Z)^2)."""
  nll_BxL, log_z_BxL = _token_nll_and_log_z(logits_BxLxV, targets_BxL)
  # Static: without z-loss the program is the plain cross-entropy's (and an infinite log Z
  # cannot turn into 0 * inf = NaN in the gradient).
  z_term = (z_loss * _masked_mean(jnp.square(log_z_BxL))[0] if z_loss
            else jnp.zeros((), jnp.float32))
  return LossTerms(_masked_mean(nll_BxL)[0], z_term)


def chunked_loss_terms(logits_fn, x_BxLxD, targets_BxL, chunks, z_loss=0.0):
  """loss_terms(logits_fn(x), targets, z_loss), the logits made for L/chunks positions at a
  time.

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
  def chunk_sums(x_BxCxD, targets_BxC):
    """[sum of NLL (, sum of log(Z)^2 with z-loss)] over one slice."""
    nll_BxC, log_z_BxC = _token_nll_and_log_z(logits_fn(x_BxCxD), targets_BxC)
    sums = [jnp.sum(nll_BxC)] + ([jnp.sum(jnp.square(log_z_BxC))] if z_loss else [])
    return jnp.stack(sums)

  def add_chunk(total, chunk):
    return total + chunk_sums(*chunk), None

  totals = jnp.zeros((2 if z_loss else 1,), jnp.float32)
  totals, _ = jax.lax.scan(add_chunk, totals, (x_NxBxCxD, targets_NxBxC))
  means = totals / (batch * length)
  return LossTerms(means[0], z_loss * means[1] if z_loss else jnp.zeros((), jnp.float32))


def lm_loss_terms(model, tokens_BxL1, perturb=None):
  """LossTerms of a model on windows of seq_len+1 tokens: inputs [:-1], targets [1:]."""
  inputs_BxL, targets_BxL = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  spec = model.spec
  if spec.loss_chunks > 1:
    return chunked_loss_terms(model.logits, model.hidden(inputs_BxL, perturb=perturb),
                              targets_BxL, spec.loss_chunks, spec.z_loss)
  return loss_terms(model(inputs_BxL, perturb=perturb), targets_BxL, spec.z_loss)


def lm_loss(model, tokens_BxL1, perturb=None):
  """The training objective of a model on windows of seq_len+1 tokens (lm_loss_terms' total:
  the cross-entropy, plus the z term when model.z_loss > 0)."""
  return lm_loss_terms(model, tokens_BxL1, perturb).total


def params_loss(graphdef, with_terms=False):
  """(params, tokens_BxL1) -> lm_loss: the training objective as a function of a split model's
  parameters; with_terms: -> (lm_loss, LossTerms), for jax.value_and_grad(has_aux=True)."""
  def loss(params, tokens_BxL1):
    terms = lm_loss_terms(nnx.merge(graphdef, params), tokens_BxL1)
    return (terms.total, terms) if with_terms else terms.total
  return loss


def params_cross_entropy(graphdef):
  """(params, tokens_BxL1) -> the plain cross-entropy, without the z term: the validation
  loss, comparable between runs with and without z-loss."""
  return lambda params, tokens_BxL1: lm_loss_terms(nnx.merge(graphdef, params),
                                                   tokens_BxL1).cross_entropy
