"""Norms and sphere geometry as pure functions of arrays (no Flax).

Every statistic is computed in float32 whatever the input dtype, and the result is cast
back to the input dtype: bfloat16 means of squares lose too many bits to be trusted.
The last axis is the feature axis throughout.
"""
import math

import jax
import jax.numpy as jnp

SCHEDULES = ("constant", "harmonic", "sqrt", "linear", "linear_paper")

# Below this squared angle the geodesic coefficients switch to their Taylor series, so that
# neither the value nor the gradient ever sees 0/0 (g parallel to x, or g == 0).
_SMALL_ANGLE_SQ = 1e-12


def _f32(x):
  """At least float32 (float64 stays float64, which the finite-difference tests use)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_norm(x, gain=None, eps=1e-5):
  """x / sqrt(mean(x^2) + eps) * gain."""
  x32 = _f32(x)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if gain is not None:
    y = y * _f32(gain)
  return y.astype(x.dtype)


def layer_norm(x, gain=None, bias=None, eps=1e-5):
  """(x - mean) / sqrt(var + eps) * gain + bias, biased variance as in PyTorch."""
  x32 = _f32(x)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  centered = x32 - mean
  var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  y = centered * jax.lax.rsqrt(var + eps)
  if gain is not None:
    y = y * _f32(gain)
  if bias is not None:
    y = y + _f32(bias)
  return y.astype(x.dtype)


def l2_normalize(x, eps=1e-12):
  """x / |x| along the last axis (nGPT's normalization), float32 statistics."""
  x32 = _f32(x)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def dyt(x, alpha, gain=None, bias=None):
  """Dynamic Tanh: gain * tanh(alpha * x) + bias, a norm-free stand-in for a norm."""
  y = jnp.tanh(_f32(alpha) * _f32(x))
  if gain is not None:
    y = y * _f32(gain)
  if bias is not None:
    y = y + _f32(bias)
  return y.astype(x.dtype)


def _dot(a, b):
  return jnp.sum(a * b, axis=-1, keepdims=True)


def tangent_project(x, g):
  """The component of g orthogonal to x: g - (<x,g>/<x,x>) x (tangent space of the sphere at x)."""
  x32, g32 = _f32(x), _f32(g)
  return g32 - (_dot(x32, g32) / _dot(x32, x32)) * x32


def _geodesic_coefficients(angle_sq, alpha, theta_max):
  """cos(theta') and alpha*sin(theta')/theta for theta = sqrt(angle_sq), theta' = min(theta, theta_max).

  Written in terms of theta^2 so that theta -> 0 has a finite value and gradient.
  """
  small = angle_sq < _SMALL_ANGLE_SQ
  theta = jnp.sqrt(jnp.where(small, 1.0, angle_sq))
  clamped = theta if theta_max is None else jnp.minimum(theta, theta_max)
  cos_coef = jnp.where(small, 1.0 - angle_sq / 2.0, jnp.cos(clamped))
  sin_over_theta = jnp.where(small, 1.0 - angle_sq / 6.0, jnp.sin(clamped) / theta)
  return cos_coef, alpha * sin_over_theta


def exp_map(x, v, theta_max=None):
  """Exponential map of the sphere of radius |x| at x, applied to the tangent vector v.

  theta = |v|/|x|;  x' = cos(theta) x + |x| sin(theta) v/|v|  (so |x'| = |x|).
  """
  return _geodesic_step(x, v, 1.0, theta_max)


def geodesic_update(x, g, alpha, theta_max=None):
  """GeoNorm's residual update: move x along the geodesic towards g by angle alpha*|v|/|x|.

  v = tangent_project(x, g); theta = alpha |v| / |x|;
  x' = cos(theta) x + |x| sin(theta) v/|v|  ==  cos(theta) x + alpha sinc(theta) v.
  The second form has no 1/|v|, which is what keeps g || x and g == 0 NaN-free.
  """
  return _geodesic_step(x, tangent_project(x, g), alpha, theta_max)


def _geodesic_step(x, v, alpha, theta_max):
  x32, v32 = _f32(x), _f32(v)
  alpha = jnp.asarray(alpha, x32.dtype)
  angle_sq = alpha * alpha * _dot(v32, v32) / _dot(x32, x32)
  cos_coef, v_coef = _geodesic_coefficients(angle_sq, alpha, theta_max)
  return (cos_coef * x32 + v_coef * v32).astype(x.dtype)


def geodesic_angle(x, g, alpha):
  """theta = alpha |v| / |x| of geodesic_update, before any clamp (for logging)."""
  v = tangent_project(x, g)
  x32 = _f32(x)
  return alpha * jnp.sqrt(_dot(v, v)[..., 0] / _dot(x32, x32)[..., 0])


def geonorm_step_size(k, num_steps, alpha, schedule):
  """alpha_k for the k-th update (1-based) out of num_steps.

  linear_paper is the GeoNorm paper's alpha (T - k)/T, under which the last update does not
  move at all; linear is alpha (T - k + 1)/T, so that it still does.
  """
  if schedule == "constant":
    return alpha
  if schedule == "harmonic":
    return alpha / k
  if schedule == "sqrt":
    return alpha / math.sqrt(k)
  if schedule == "linear":
    return alpha * (num_steps - k + 1) / num_steps
  if schedule == "linear_paper":
    return alpha * (num_steps - k) / num_steps
  raise ValueError(f"unknown GeoNorm schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def deepnorm_alpha(num_layers):
  """DeepNet residual scale for a decoder-only model with num_layers blocks: (2T)^(1/4)."""
  return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers):
  """DeepNet init scale for W_v, W_o and the MLP weights of a decoder-only model: (8T)^(-1/4)."""
  return (8.0 * num_layers) ** -0.25
