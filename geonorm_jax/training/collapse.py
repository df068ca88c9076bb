"""Representation-collapse diagnostics, and the monitor that warns when a run collapses.

A collapsed model maps every input to the same output: the hidden states that feed the head
all point the same way, so the logits stop depending on the input and the loss sits at the
unigram entropy. Three numbers show it directly (each on one batch, float32):
  token_cosine    mean cosine between the head inputs of different tokens (1.0 = collapse),
  logit_spread    std over tokens of each logit, averaged over the vocabulary (0.0 = collapse),
  tanh_saturated  DyT only: fraction of units with |tanh(alpha x)| > 0.99, where the
                  gradient through tanh has all but vanished.
"""
import dataclasses
from typing import Optional

import jax.numpy as jnp

SATURATED_TANH = 0.99


def token_cosine(h_BxLxD):
  """Mean cosine similarity over all pairs of different tokens (batch and positions pooled).

  With unit vectors u_i, sum_{i != j} <u_i, u_j> = |sum_i u_i|^2 - N, so no N x N matrix.
  """
  h = jnp.asarray(h_BxLxD, jnp.float32).reshape(-1, h_BxLxD.shape[-1])
  count = h.shape[0]
  norm = jnp.sqrt(jnp.sum(h * h, axis=-1, keepdims=True))
  u = h / jnp.where(norm > 0, norm, 1.0)
  total = jnp.sum(u, axis=0)
  # A Python float: count * (count - 1) overflows int32 past 46341 tokens (a 0.5M-token batch).
  return (jnp.sum(total * total) - jnp.sum(u * u)) / (float(count) * (count - 1))


def logit_spread(logits_BxLxV):
  """Std over tokens of each logit, averaged over the vocabulary: 0 when the input is ignored."""
  logits = jnp.asarray(logits_BxLxV, jnp.float32).reshape(-1, logits_BxLxV.shape[-1])
  return jnp.mean(jnp.std(logits, axis=0))


def tanh_saturated(x, alpha):
  """Fraction of entries with |tanh(alpha x)| above SATURATED_TANH."""
  y = jnp.tanh(jnp.asarray(alpha, jnp.float32) * jnp.asarray(x, jnp.float32))
  return jnp.mean((jnp.abs(y) > SATURATED_TANH).astype(jnp.float32))


@dataclasses.dataclass
class CollapseMonitor:
  """Warns once when token_cosine stays above `threshold` for `patience` checks in a row."""
  threshold: float = 0.95
  patience: int = 3
  streak: int = 0
  first_step: Optional[int] = None  # first step of the streak that triggered the warning
  warned_at: Optional[int] = None
  _streak_start: Optional[int] = None

  def update(self, step, cosine):
    """Feed one check; returns the warning text the first time the streak is long enough."""
    if not cosine > self.threshold:  # NaN counts as no evidence of collapse
      self.streak, self._streak_start = 0, None
      return None
    self.streak += 1
    if self._streak_start is None:
      self._streak_start = step
    if self.streak < self.patience or self.warned_at is not None:
      return None
    self.first_step, self.warned_at = self._streak_start, step
    return (f"warning: representation collapse at step {step}: the head inputs of different "
            f"tokens have had mean cosine > {self.threshold} since step {self.first_step} "
            f"({self.streak} checks; now {cosine:.3f}); the output no longer depends on the "
            "input. See docs/placements.md (tied embeddings) and the collapse/ metrics.")
