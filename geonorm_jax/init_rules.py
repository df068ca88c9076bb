"""Per-placement initialisation: the standard deviation of each weight, and nGPT's projection.

Roles: embed, positions, head, and per block q, k, v, o (attention) and up, gate, down (MLP).
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from geonorm_jax import norms

RESIDUAL_OUTPUTS = ("o", "down")


def init_std(spec, role, layer=None):
  """Standard deviation of the normal init of one weight, per the placement's paper or code."""
  base = spec.init_std
  if spec.placement == "simplenorm":
    # Ocram7/SimpleGPT: embedding N(0,1), head d^-1/2, the matrices that write into the
    # stream (W_o, W_2) and W_3 (SwiGLU's up) scaled by 1/sqrt(2l).
    if role == "embed" and not spec.tie_embeddings:
      return 1.0
    if role == "head":
      return spec.d_model ** -0.5
    if role in ("o", "down", "up") and layer is not None:
      return base / math.sqrt(2 * layer)
    return base
  if role in ("embed", "positions", "head", "q", "k"):
    return base
  std = base
  if role in RESIDUAL_OUTPUTS:
    std = base / math.sqrt(2 * spec.num_layers)  # GPT-2: residual writers scaled by depth
  if spec.placement == "deepnorm":
    # DeepNet: W_v, W_o and the MLP weights scaled by beta = (8T)^(-1/4); q, k untouched.
    std = base * norms.deepnorm_beta(spec.num_layers)
  return std


def _embed_axis(variable):
  axes = variable.get_metadata().get("logical_axes") or ()
  return axes.index("embed") if "embed" in axes and len(axes) == 2 else None


def normalize_ngpt_weights(state):
  """nGPT's post-step projection: every matrix has unit-norm vectors along its `embed` axis.

  The embedding rows, the head columns, W_q/W_k/W_v/W_up/W_gate columns and W_o/W_down rows
  all end up on the unit sphere of the model width. Call after each optimizer update.
  """
  def project(variable):
    axis = _embed_axis(variable)
    if axis is None:
      return variable
    w = variable[...]
    return variable.replace(w * jax.lax.rsqrt(jnp.sum(w * w, axis=axis, keepdims=True) + 1e-12))
  return jax.tree.map(project, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
