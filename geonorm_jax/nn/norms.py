"""Norms and sphere geometry as pure functions of arrays (no Flax).

Every statistic is computed in float32 whatever the input dtype, and the result is cast
back to the input dtype: bfloat16 means of squares lose too many bits to be trusted.
The last axis is the feature axis throughout.
"""
import functools
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
  return _normalize(x, gain, None, eps, False)


def layer_norm(x, gain=None, bias=None, eps=1e-5):
  """(x - mean) / sqrt(var + eps) * gain + bias, biased variance as in PyTorch."""
  return _normalize(x, gain, bias, eps, True)


def _standardize(x32, eps, center):
  """(x - mean if center) / sqrt(mean of its squares + eps), and that 1/sqrt per row."""
  if center:
    x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return x32 * inv_rms, inv_rms


# The derivative is written out: with autodiff of the statistics above, a norm-heavy model's
# CPU step (SimpleNorm: a norm after every linear map) took 1.30x Pre-LN's, with it 1.19x
# (results/bench/train.json, before and after).
@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _normalize(x, gain, bias, eps, center):
  y, _ = _standardize(_f32(x), eps, center)
  if gain is not None:
    y = y * _f32(gain)
  if bias is not None:
    y = y + _f32(bias)
  return y.astype(x.dtype)


@_normalize.defjvp
def _normalize_jvp(eps, center, primals, tangents):
  """d xhat = r (dx' - xhat mean(xhat dx')), dx' = dx - mean(dx) if centered; r = 1/rms."""
  x, gain, bias = primals
  dx, dgain, dbias = tangents
  xhat, inv_rms = _standardize(_f32(x), eps, center)
  dx32 = _f32(dx)
  if center:
    dx32 = dx32 - jnp.mean(dx32, axis=-1, keepdims=True)
  dxhat = inv_rms * (dx32 - xhat * jnp.mean(xhat * dx32, axis=-1, keepdims=True))
  y, dy = xhat, dxhat
  if gain is not None:
    y, dy = y * _f32(gain), dy * _f32(gain) + xhat * _f32(dgain)
  if bias is not None:
    y, dy = y + _f32(bias), dy + _f32(dbias)
  return y.astype(x.dtype), dy.astype(x.dtype)


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


def exp_map(x, v, theta_max=None):
  """Exponential map of the sphere of radius |x| at x, applied to the tangent vector v.

  theta = |v|/|x|;  x' = cos(theta) x + |x| sin(theta) v/|v|  (so |x'| = |x|).
  Plain autodiff (the tests' reference for geodesic_update's hand-written derivative).
  """
  x32, v32 = _f32(x), _f32(v)
  angle_sq = _dot(v32, v32) / _dot(x32, x32)
  small = angle_sq < _SMALL_ANGLE_SQ
  theta = jnp.sqrt(jnp.where(small, 1.0, angle_sq))
  clamped = theta if theta_max is None else jnp.minimum(theta, theta_max)
  cos_coef = jnp.where(small, 1.0 - angle_sq / 2.0, jnp.cos(clamped))
  sin_over_theta = jnp.where(small, 1.0 - angle_sq / 6.0, jnp.sin(clamped) / theta)
  return (cos_coef * x32 + sin_over_theta * v32).astype(x.dtype)


def geodesic_update(x, g, alpha, theta_max=None):
  """GeoNorm's residual update: move x along the geodesic towards g by angle alpha*|v|/|x|.

  v = tangent_project(x, g); theta = alpha |v| / |x|;
  x' = cos(theta) x + |x| sin(theta) v/|v|  ==  cos(theta) x + alpha sinc(theta) v.
  The second form has no 1/|v|, which is what keeps g || x and g == 0 NaN-free.
  Its derivative is written out (`_geodesic_update_jvp`, transposed by JAX for the gradient):
  with autodiff of these few lines a CPU training step took 1.15x Pre-LN's, with it 1.11x
  (results/bench/train.json, before and after).
  """
  return _geodesic_update(x, g, jnp.asarray(alpha), theta_max)


def _geodesic_terms(x32, g32, alpha32, theta_max):
  """Per-row s = <x,x>, c = <x,g>/s, q = |v|^2 (v = g - c x), and the coefficients of u."""
  s = _dot(x32, x32)
  c = _dot(x32, g32) / s
  v = g32 - c * x32
  q = _dot(v, v)
  u = alpha32 * alpha32 * q / s
  return (s, c, q) + _geodesic_coefficients_and_slopes(u, theta_max)


def _geodesic_coefficients_and_slopes(angle_sq, theta_max):
  """cos(theta'), sin(theta')/theta and their derivatives in u = theta^2 (theta' = clamped).

  The slope of sin(theta)/theta, (theta cos theta - sin theta) / (2 theta^3), cancels badly
  in float32 for small theta, so below u = 1e-2 it is its Taylor series.
  """
  small = angle_sq < _SMALL_ANGLE_SQ
  u = jnp.where(small, 1.0, angle_sq)
  theta = jnp.sqrt(u)
  clamped = theta if theta_max is None else jnp.minimum(theta, theta_max)
  is_clamped = jnp.zeros_like(small) if theta_max is None else theta > theta_max
  sin_c, cos_c = jnp.sin(clamped), jnp.cos(clamped)
  cos_coef = jnp.where(small, 1.0 - angle_sq / 2.0, cos_c)
  sin_over_theta = jnp.where(small, 1.0 - angle_sq / 6.0, sin_c / theta)
  series = -1.0 / 6.0 + u * (1.0 / 60.0 - u * (1.0 / 1680.0 - u / 90720.0))
  free_slope = jnp.where(u < 1e-2, series, (theta * cos_c - sin_c) / (2.0 * u * theta))
  dcos = jnp.where(small, -0.5, jnp.where(is_clamped, 0.0, -sin_c / (2.0 * theta)))
  dsin_over_theta = jnp.where(small, -1.0 / 6.0,
                              jnp.where(is_clamped, -sin_c / (2.0 * u * theta), free_slope))
  return cos_coef, sin_over_theta, dcos, dsin_over_theta


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _geodesic_update(x, g, alpha, theta_max):
  x32, g32 = _f32(x), _f32(g)
  alpha32 = alpha.astype(x32.dtype)
  _, c, _, cos_coef, sin_over_theta, _, _ = _geodesic_terms(x32, g32, alpha32, theta_max)
  w = alpha32 * sin_over_theta
  # Materialised per row: else XLA (CPU) fused them into the elementwise loops of several
  # layers at once and recomputed cos/sin for every feature. Forward-only programs take this
  # path (the eval step, where compile_options keeps the barrier); gradients take the JVP.
  a_coef, w = jax.lax.optimization_barrier((cos_coef - w * c, w))
  return (a_coef * x32 + w * g32).astype(x.dtype)


@_geodesic_update.defjvp
def _geodesic_update_jvp(theta_max, primals, tangents):
  """d out = C' du x + C dx + (alpha H' du + H dalpha) v + alpha H dv, with
  dv = dg - dc x - c dx, dc = (<dx,g> + <x,dg> - c ds)/s, ds = 2<x,dx>,
  dq = 2<v,dv> = 2(<v,dg> - c<v,dx>) (as <v,x> = 0), du = d(alpha^2 q / s);
  gathered as per-row coefficients of dx, dg, x and g, so that the gradient (its transpose)
  is four row reductions and two elementwise sums."""
  x, g, alpha = primals
  dx, dg, dalpha = tangents
  x32, g32 = _f32(x), _f32(g)
  # Barriers on the tangents, hence on the cotangents of the gradient (their transpose):
  # without them XLA fused the gradient of all a model's updates into one elementwise loop
  # per update, each recomputing the later ones' per-row cos/sin for every feature. They
  # hold on a CPU only where compile_options.py keeps barriers until fusion.
  dx32, dg32 = jax.lax.optimization_barrier((_f32(dx), _f32(dg)))
  alpha32, dalpha32 = alpha.astype(x32.dtype), dalpha.astype(x32.dtype)
  s, c, q, cos_coef, sin_over_theta, dcos, dsin_over_theta = _geodesic_terms(
      x32, g32, alpha32, theta_max)
  w = alpha32 * sin_over_theta
  a_coef = cos_coef - w * c
  x_dx, g_dx, x_dg, g_dg = _dot(x32, dx32), _dot(g32, dx32), _dot(x32, dg32), _dot(g32, dg32)
  ds = 2.0 * x_dx
  dc = (g_dx + x_dg - c * ds) / s
  dq = 2.0 * ((g_dg - c * x_dg) - c * (g_dx - c * x_dx))
  du = (2.0 * alpha32 * dalpha32 * q + alpha32 * alpha32 * (dq - q * ds / s)) / s
  v_coef = alpha32 * dsin_over_theta * du + sin_over_theta * dalpha32
  x_coef = dcos * du - w * dc - v_coef * c
  out = a_coef * x32 + w * g32
  dout = jax.lax.optimization_barrier(a_coef * dx32 + w * dg32 + x_coef * x32 + v_coef * g32)
  return out.astype(x.dtype), dout.astype(x.dtype)


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
