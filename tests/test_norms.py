"""Norms and sphere geometry against independent float64 computations."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from geonorm_jax.nn import norms


def _rand(seed, *shape):
  return np.random.default_rng(seed).standard_normal(shape)


def _closed_form_geodesic(x, g, alpha):
  """The geodesic update (docs/placements.md) written out in float64 numpy: tangent projection, angle, exponential map."""
  v = g - (x @ g) / (x @ x) * x
  theta = alpha * np.linalg.norm(v) / np.linalg.norm(x)
  return np.cos(theta) * x + np.linalg.norm(x) * np.sin(theta) * v / np.linalg.norm(v), theta


def test_rms_and_layer_norm_match_float64():
  x = _rand(0, 3, 5, 48) * 3 + 1
  gain, bias = _rand(1, 48), _rand(2, 48)
  rms = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-5) * gain
  np.testing.assert_allclose(norms.rms_norm(jnp.float32(x), jnp.float32(gain)), rms, rtol=2e-5)
  mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  ln = (x - mu) / np.sqrt(var + 1e-5) * gain + bias
  np.testing.assert_allclose(norms.layer_norm(jnp.float32(x), gain, bias), ln, rtol=2e-5, atol=2e-5)


def test_statistics_are_float32_for_bfloat16_input():
  # A sum of squares of 4096 bf16 values: with bf16 accumulation the scale is off by ~1e-2.
  x = jnp.asarray(_rand(3, 4, 4096) * 50, jnp.bfloat16)
  y = norms.rms_norm(x)
  assert y.dtype == jnp.bfloat16
  reference = np.asarray(x, np.float64)
  reference = reference / np.sqrt(np.mean(reference**2, -1, keepdims=True) + 1e-5)
  np.testing.assert_allclose(np.asarray(y, np.float64), reference, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("alpha", [1.0, 0.3, 2.5])
def test_geodesic_update_equals_closed_form(alpha):
  for seed in range(5):
    x, g = _rand(seed, 64) * 4, _rand(seed + 10, 64)
    expected, theta = _closed_form_geodesic(x, g, alpha)
    got = norms.geodesic_update(jnp.float32(x), jnp.float32(g), alpha)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(norms.geodesic_angle(jnp.float32(x), jnp.float32(g), alpha), theta,
                               rtol=1e-5)
    # The angle actually travelled between x and x' is theta (mod 2 pi, for theta <= pi).
    if theta <= np.pi:
      cos_travelled = expected @ x / np.linalg.norm(x) ** 2
      np.testing.assert_allclose(np.arccos(np.clip(cos_travelled, -1, 1)), theta, atol=1e-6)


def test_exp_map_angle_is_norm_ratio_with_unit_step():
  x, v = _rand(0, 32) * 2, _rand(1, 32)
  v = v - (x @ v) / (x @ x) * x  # a tangent vector
  expected, theta = _closed_form_geodesic(x, v, 1.0)
  assert np.isclose(theta, np.linalg.norm(v) / np.linalg.norm(x))
  np.testing.assert_allclose(norms.exp_map(jnp.float32(x), jnp.float32(v)), expected, rtol=2e-5,
                             atol=2e-5)


def test_tangent_project_is_orthogonal_and_idempotent():
  x, g = jnp.float32(_rand(0, 7, 32)), jnp.float32(_rand(1, 7, 32))
  v = norms.tangent_project(x, g)
  np.testing.assert_allclose(jnp.sum(v * x, -1), 0.0, atol=1e-4)
  np.testing.assert_allclose(norms.tangent_project(x, v), v, atol=1e-5)


def test_theta_clamp():
  x, g = _rand(0, 16), _rand(1, 16) * 10
  _, theta = _closed_form_geodesic(x, g, 1.0)
  assert theta > 0.5
  clamped = norms.geodesic_update(jnp.float32(x), jnp.float32(g), 1.0, theta_max=0.5)
  cos_travelled = float(clamped @ x) / float(np.linalg.norm(x)) ** 2
  np.testing.assert_allclose(np.arccos(cos_travelled), 0.5, atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(clamped), np.linalg.norm(x), rtol=1e-6)


@pytest.mark.parametrize("case", ["parallel", "antiparallel", "zero"])
def test_geodesic_update_nan_free_value_and_gradient(case):
  x = jnp.float32(_rand(0, 32))
  g = {"parallel": 3.0 * x, "antiparallel": -2.0 * x, "zero": jnp.zeros_like(x)}[case]

  def objective(x, g):
    return jnp.sum(norms.geodesic_update(x, g, 0.7) * jnp.arange(32.0))

  value = norms.geodesic_update(x, g, 0.7)
  np.testing.assert_allclose(value, x, rtol=1e-6)  # no tangent component: identity
  grad_x, grad_g = jax.grad(objective, argnums=(0, 1))(x, g)
  assert np.all(np.isfinite(grad_x)) and np.all(np.isfinite(grad_g))
  # At v = 0 the update is x + alpha * v to first order, so d/dg is alpha * P_tangent(w).
  w = np.arange(32.0)
  xn = np.asarray(x, np.float64)
  expected_grad_g = 0.7 * (w - (w @ xn) / (xn @ xn) * xn)
  np.testing.assert_allclose(grad_g, expected_grad_g, rtol=1e-4, atol=1e-4)


def test_geodesic_gradient_matches_finite_differences():
  x, g = _rand(4, 12), _rand(5, 12)
  w = _rand(6, 12)
  f = lambda x, g: jnp.sum(norms.geodesic_update(x, g, 0.8) * w)
  with jax.enable_x64(True):
    grad = jax.grad(f)(jnp.float64(x), jnp.float64(g))
    eps = 1e-6
    numeric = np.array([(f(x + eps * e, g) - f(x - eps * e, g)) / (2 * eps)
                        for e in np.eye(12)])
  np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def _plain_norm(x, gain, bias, center, eps=1e-5):
  """LayerNorm / RMSNorm as a plain formula, differentiated by JAX: the reference for the
  written-out derivative of norms._normalize."""
  mean = jnp.mean(x, -1, keepdims=True) if center else 0.0
  y = (x - mean) / jnp.sqrt(jnp.mean((x - mean) ** 2, -1, keepdims=True) + eps)
  y = y if gain is None else y * gain
  return y if bias is None else y + bias


def _derivatives(fn, args, argnums, weights, direction):
  """Value, gradient, Hessian-vector product (forward over reverse) and forward-mode JVP."""
  objective = lambda *a: jnp.sum(jnp.sin(fn(*a)) * weights)
  grads = jax.grad(objective, argnums=argnums)(*args)
  hvp = jax.jvp(lambda x: jax.grad(objective)(x, *args[1:]), (args[0],), (direction,))[1]
  jvp = jax.jvp(lambda x: fn(x, *args[1:]), (args[0],), (direction,))[1]
  return (fn(*args),) + tuple(grads) + (hvp, jvp)


@pytest.mark.parametrize("kind", ["layernorm", "layernorm_no_bias", "rmsnorm", "rmsnorm_no_gain"])
def test_norm_derivatives_equal_autodiff_of_the_formula(kind):
  x, gain, bias = _rand(0, 2, 3, 16) * 3 + 1, _rand(1, 16), _rand(2, 16)
  gain = None if kind == "rmsnorm_no_gain" else gain
  bias = bias if kind == "layernorm" else None
  center = kind.startswith("layernorm")
  ours = (lambda x, g, b: norms.layer_norm(x, g, b)) if center else \
      (lambda x, g, b: norms.rms_norm(x, g))
  args = (x, gain, bias)
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  weights, direction = _rand(3, *x.shape), _rand(4, *x.shape)
  with jax.enable_x64(True):
    got = _derivatives(ours, args, argnums, weights, direction)
    want = _derivatives(lambda x, g, b: _plain_norm(x, g, b, center), args, argnums, weights,
                        direction)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["generic", "clamped", "parallel", "zero", "small_angle",
                                  "large_step"])
def test_geodesic_derivatives_equal_autodiff_of_the_exponential_map(case):
  """geodesic_update's written-out derivative against JAX's derivative of exp_map(x, alpha v):
  gradients in x, g and alpha, a Hessian-vector product and forward mode, in float64."""
  x, g = _rand(0, 3, 5, 16), _rand(1, 3, 5, 16)
  g = {"parallel": 3.0 * x, "zero": 0.0 * x, "small_angle": 1e-5 * g}.get(case, g)
  alpha = 2.0 if case == "large_step" else 0.7
  theta_max = 0.5 if case == "clamped" else None
  weights, direction = _rand(3, *x.shape), _rand(4, *x.shape)
  reference = lambda x, g, a: norms.exp_map(x, a * norms.tangent_project(x, g), theta_max)
  with jax.enable_x64(True):
    got = _derivatives(lambda x, g, a: norms.geodesic_update(x, g, a, theta_max),
                       (x, g, jnp.float64(alpha)), (0, 1, 2), weights, direction)
    want = _derivatives(reference, (x, g, jnp.float64(alpha)), (0, 1, 2), weights, direction)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


def test_geodesic_gradient_in_float32_is_as_accurate_as_autodiff():
  """At small angles the slope of sin(theta)/theta cancels in float32; its series keeps the
  float32 gradient within float32 rounding of the float64 one."""
  x, g, weights = _rand(0, 4, 32), 1e-3 * _rand(1, 4, 32), _rand(2, 4, 32)
  objective = lambda x, g: jnp.sum(norms.geodesic_update(x, g, 0.7) * weights)
  with jax.enable_x64(True):
    want = jax.grad(objective, argnums=(0, 1))(x, g)
  got = jax.grad(objective, argnums=(0, 1))(jnp.float32(x), jnp.float32(g))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=0, atol=5e-7 * np.max(np.abs(b)))


def test_post_norm_is_metric_projection_onto_sphere():
  """Post-Norm without gain is sqrt(d) (x+g)/|x+g|: the closest point of the sqrt(d) sphere."""
  d = 64
  x, g = _rand(0, d), _rand(1, d) * 0.5
  post = np.asarray(norms.rms_norm(jnp.asarray(x + g), None, eps=0.0), np.float64)
  projection = np.sqrt(d) * (x + g) / np.linalg.norm(x + g)
  np.testing.assert_allclose(post, projection, rtol=1e-5)
  others = _rand(2, 2000, d)
  others = np.sqrt(d) * others / np.linalg.norm(others, axis=1, keepdims=True)
  assert np.linalg.norm(x + g - projection) <= np.min(np.linalg.norm(x + g - others, axis=1))


def _effective_step_size(x, g):
  """The alpha for which a geodesic step from x lands on the direction of x + g."""
  u = x / np.linalg.norm(x)
  v = g - (u @ g) * u
  return np.arctan2(np.linalg.norm(v), np.linalg.norm(x) + u @ g) * np.linalg.norm(x) \
      / np.linalg.norm(v)


def test_post_norm_step_is_a_geodesic_step():
  """Normalising x + g (Post-Norm) equals a geodesic step with an angle set by |x| and <x,g>."""
  d = 48
  for seed in range(4):
    x = _rand(seed, d)
    x = np.sqrt(d) * x / np.linalg.norm(x)
    g = _rand(seed + 7, d) * (seed + 1)
    post = np.sqrt(d) * (x + g) / np.linalg.norm(x + g)
    geo = norms.geodesic_update(jnp.float32(x), jnp.float32(g), _effective_step_size(x, g))
    np.testing.assert_allclose(geo, post, rtol=1e-5, atol=1e-5)


def test_pre_norm_is_geodesic_with_decaying_step():
  """Pre-Norm's direction moves exactly as a geodesic step of angle ~|v_k|/|x_k|: since |x_k|
  grows with depth, that is GeoNorm with a fixed, non-adaptive decay of the angular step."""
  d, depth = 64, 256
  rng = np.random.default_rng(0)
  x = rng.standard_normal(d)
  angles, step_sizes = [], []
  for _ in range(depth):
    g = rng.standard_normal(d)  # a sublayer output of fixed scale
    alpha = _effective_step_size(x, g)
    geo = np.asarray(norms.geodesic_update(jnp.float32(x), jnp.float32(g), alpha), np.float64)
    x_next = x + g
    np.testing.assert_allclose(geo / np.linalg.norm(geo), x_next / np.linalg.norm(x_next),
                               atol=2e-5)
    step_sizes.append(alpha)
    angles.append(float(norms.geodesic_angle(jnp.float32(x), jnp.float32(g), alpha)))
    x = x_next
  step_sizes, angles = np.array(step_sizes), np.array(angles)
  # Once |x| >> |g| the step size is ~1 (atan(t) ~ t): the decay is all in 1/|x_k| ...
  np.testing.assert_allclose(step_sizes[64:], 1.0, atol=0.05)
  # ... and |x_k| grows like sqrt(k) for independent updates, so the angle shrinks.
  assert angles[-32:].mean() < 0.5 * angles[8:40].mean()


def test_step_size_schedules():
  assert norms.geonorm_step_size(4, 12, 0.8, "constant") == 0.8
  assert norms.geonorm_step_size(4, 12, 0.8, "harmonic") == pytest.approx(0.2)
  assert norms.geonorm_step_size(4, 12, 0.8, "sqrt") == pytest.approx(0.4)
  assert norms.geonorm_step_size(1, 12, 0.8, "linear") == pytest.approx(0.8)
  assert norms.geonorm_step_size(12, 12, 0.8, "linear") == pytest.approx(0.8 / 12)
  # The GeoNorm paper's alpha (T-k)/T: the first update at 11/12 of alpha, the last frozen.
  assert norms.geonorm_step_size(1, 12, 0.8, "linear_paper") == pytest.approx(0.8 * 11 / 12)
  assert norms.geonorm_step_size(12, 12, 0.8, "linear_paper") == 0.0
  with pytest.raises(ValueError, match="cosine.*harmonic"):
    norms.geonorm_step_size(1, 12, 1.0, "cosine")


def test_deepnorm_constants_and_dyt():
  assert norms.deepnorm_alpha(12) == pytest.approx(24 ** 0.25)
  assert norms.deepnorm_beta(12) == pytest.approx(96 ** -0.25)
  x = _rand(0, 10)
  np.testing.assert_allclose(norms.dyt(jnp.float32(x), 0.5, jnp.float32(2.0), jnp.float32(1.0)),
                             2 * np.tanh(0.5 * x) + 1, rtol=1e-6)
