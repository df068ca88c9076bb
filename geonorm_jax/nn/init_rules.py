"""Per-placement initialisation: the standard deviation of each weight, and nGPT's projection.

Roles: embed, positions, head, and per block q, k, v, o (attention) and up, gate, down (MLP).
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from geonorm_jax.nn import norms

RESIDUAL_OUTPUTS = ("o", "down")
BLOCK_MATRICES = ("q", "k", "v", "o", "up", "gate", "down")


def matrix_shape(spec, role):
  """(fan_in, fan_out) of a block matrix."""
  d, f = spec.d_model, spec.d_ff
  q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
  return {"q": (d, q_width), "k": (d, kv_width), "v": (d, kv_width), "o": (q_width, d),
          "up": (d, f), "gate": (d, f), "down": (f, d)}[role]


def xavier_normal_std(spec, role, gain):
  fan_in, fan_out = matrix_shape(spec, role)
  return gain * math.sqrt(2.0 / (fan_in + fan_out))


def default_std(spec, role, layer=None):
  """GPT-2's rule: init_std everywhere, the residual writers (W_o, W_down) / sqrt(2T)."""
  del layer
  if role in RESIDUAL_OUTPUTS:
    return spec.init_std / math.sqrt(2 * spec.num_layers)
  return spec.init_std


def deepnorm_std(spec, role, layer=None):
  """DeepNet (Wang et al. 2022, Fig. 2 pseudocode): Xavier-normal with gain beta = (8T)^(-1/4)
  for W_v, W_o and the FFN matrices, gain 1 for W_q and W_k. (microsoft/torchscale uses a
  Xavier-uniform variant of the same scaling.) Embeddings and head: the default rule."""
  if role not in BLOCK_MATRICES:
    return default_std(spec, role, layer)
  gain = 1.0 if role in ("q", "k") else norms.deepnorm_beta(spec.num_layers)
  return xavier_normal_std(spec, role, gain)


def simplenorm_std(spec, role, layer=None):
  """Ocram7/SimpleGPT: embedding N(0,1) when untied, head d^-1/2, and std/sqrt(2l) for the
  matrices W_o, W_2 (down) and, in SwiGLU, W_3 (up: the factor multiplied by silu(W_1 h)).
  A GELU MLP's first matrix is SwiGLU's W_1 and keeps the plain std."""
  base = spec.init_std
  if role == "embed" and not spec.tie_embeddings:
    return 1.0
  if role == "head":
    return spec.d_model ** -0.5
  depth_scaled = ("o", "down", "up") if spec.gated_mlp else ("o", "down")
  if role in depth_scaled and layer is not None:
    return base / math.sqrt(2 * layer)
  return base


def _embed_axis(variable):
  """The `embed` axis of a matrix (stacked along a leading `layers` axis or not), else None."""
  axes = tuple(variable.get_metadata().get("logical_axes") or ())
  stacked = axes[:1] == ("layers",)
  matrix_axes = axes[1:] if stacked else axes
  if "embed" not in matrix_axes or len(matrix_axes) != 2:
    return None
  return matrix_axes.index("embed") + int(stacked)


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
