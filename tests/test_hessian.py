"""Tests of geonorm_jax.hessian against dense float64 Hessians and known spectra.

References are exact: dense `jax.hessian` in float64 plus `numpy.linalg.eigvalsh`, or
matrices Q diag(lam) Q^T built from a known lam. The estimators run in float32.
"""
import math

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from geonorm_jax import hessian
from geonorm_jax.nn import paths

# ----------------------------------------------------------------------------------------
# Fixtures: a tiny tanh MLP with cross-entropy (264 parameters) and known-spectrum matrices.
# ----------------------------------------------------------------------------------------

D_IN, D_HIDDEN, D_OUT = 8, 20, 4


def init_mlp(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "dense1": {"kernel": jax.random.normal(k1, (D_IN, D_HIDDEN)) / math.sqrt(D_IN),
                 "bias": 0.1 * jax.random.normal(k3, (D_HIDDEN,))},
      "dense2": {"kernel": 2.0 * jax.random.normal(k2, (D_HIDDEN, D_OUT)) / math.sqrt(D_HIDDEN),
                 "bias": jnp.zeros((D_OUT,))},
  }


def mlp_loss(params, batch, hidden_delta=None):
  """Mean cross-entropy; `hidden_delta` (B, D_HIDDEN) is added to the tanh activations."""
  x_BxI, y_B = batch
  h_BxH = jnp.tanh(x_BxI @ params["dense1"]["kernel"] + params["dense1"]["bias"])
  if hidden_delta is not None:
    h_BxH = h_BxH + hidden_delta
  logits_BxO = h_BxH @ params["dense2"]["kernel"] + params["dense2"]["bias"]
  log_probs_BxO = jax.nn.log_softmax(logits_BxO)
  return -jnp.mean(jnp.take_along_axis(log_probs_BxO, y_B[:, None], axis=1))


def make_batch(seed, size):
  x_BxI = jax.random.normal(jax.random.key(seed), (size, D_IN))
  return x_BxI, jax.random.randint(jax.random.key(seed + 1), (size,), 0, D_OUT)


def to_f64(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating)
                      else a, tree)


def dense_hessian(loss_fn, params, *args):
  """Dense float64 Hessian of loss_fn w.r.t. params (raveled in ravel_pytree order).

  A vector-valued loss_fn gives a stack of Hessians, one per output.
  """
  with jax.enable_x64(True):
    flat_N, unravel = ravel_pytree(to_f64(params))
    args64 = to_f64(args)
    hess_NxN = jax.jit(jax.hessian(lambda f, a: loss_fn(unravel(f), *a)))(flat_N, args64)
    return np.asarray(hess_NxN, np.float64)


def materialize(matvec, like):
  """Dense matrix of a pytree matvec (float32), column j = matvec(e_j)."""
  flat_N, unravel = ravel_pytree(like)
  eye_NxN = jnp.eye(flat_N.size, dtype=flat_N.dtype)
  rows = jax.jit(jax.vmap(lambda e: ravel_pytree(matvec(unravel(e)))[0]))(eye_NxN)
  return np.asarray(rows, np.float64).T


def rel_frobenius(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def spectrum_matrix(lam, seed=0):
  rng = np.random.default_rng(seed)
  q_NxN, _ = np.linalg.qr(rng.normal(size=(lam.size, lam.size)))
  return (q_NxN * lam) @ q_NxN.T


def dense_op(a_NxN):
  a_NxN = jnp.asarray(a_NxN, jnp.float32)
  return lambda v: a_NxN @ v


@pytest.fixture(scope="module")
def mlp():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(1, 32)
  hess_NxN = dense_hessian(mlp_loss, params, batch)
  eigvals_desc = np.linalg.eigvalsh(hess_NxN)[::-1]
  return params, batch, hess_NxN, eigvals_desc


@pytest.fixture(scope="module")
def mlp_lanczos(mlp):
  params, batch, _, _ = mlp
  run = jax.jit(lambda key: hessian.lanczos(
      hessian.params_matvec(mlp_loss, params, batch), params, 30, key, return_vectors=True))
  return run(jax.random.key(3))


# Clusters at the top (10, 9.99, 9.98) and bottom (-5, -5.01), a triple eigenvalue, a
# bulk in [-1, 1]; trace 23.96 (the symmetric bulk sums to 0).
KNOWN_LAM = np.concatenate([[10.0, 9.99, 9.98], [4.0, 4.0, 4.0], [-5.0, -5.01, -8.0],
                            np.linspace(-1.0, 1.0, 51)])


@pytest.fixture(scope="module")
def known():
  return spectrum_matrix(KNOWN_LAM)


# ----------------------------------------------------------------------------------------
# Lanczos on the MLP Hessian.
# ----------------------------------------------------------------------------------------


def test_mlp_has_the_spectrum_the_tests_need(mlp):
  # The checks below are only meaningful with a gap at the top and negative curvature.
  _, _, _, eig = mlp
  assert eig.size == 264
  assert eig[1] / eig[0] < 0.9 and eig[-1] < -0.1 * eig[0]


def test_top_eigenvalue_matches_dense(mlp, mlp_lanczos):
  _, _, _, eig = mlp
  assert bool(mlp_lanczos.finite) and not bool(mlp_lanczos.breakdown)
  assert abs(float(mlp_lanczos.ritz_values[0]) - eig[0]) / eig[0] <= 1e-4


def test_top5_ritz_values_match_dense(mlp, mlp_lanczos):
  # At 30 steps the top-5 residual bounds are <= ~3e-4 and the gaps >= 0.06, so the Ritz
  # errors are <= r^2 / gap ~ 2e-6 (Kahan-Parlett); float32 HVP rounding adds ~1e-6
  # relative. 1e-5 * lambda_1 leaves margin, while at 20 steps the 3rd and 5th values
  # were still off by 1e-4 and 2e-2 (measured), so an under-converged run fails it.
  _, _, _, eig = mlp
  ritz = np.asarray(mlp_lanczos.ritz_values[:5], np.float64)
  np.testing.assert_allclose(ritz, eig[:5], rtol=0, atol=1e-5 * eig[0])
  assert np.all(np.diff(np.asarray(mlp_lanczos.ritz_values)) <= 0)  # sorted descending


def test_most_negative_eigenvalue_found(mlp, mlp_lanczos):
  _, _, _, eig = mlp
  assert abs(float(mlp_lanczos.ritz_values[-1]) - eig[-1]) <= 1e-4 * eig[0]


def test_residual_bounds_bound_the_error(mlp, mlp_lanczos):
  # Every Ritz value lies within its residual bound of some true eigenvalue (up to float32
  # rounding); the converged top one has a tiny bound.
  _, _, _, eig = mlp
  ritz = np.asarray(mlp_lanczos.ritz_values, np.float64)
  bounds = np.asarray(mlp_lanczos.residual_bounds, np.float64)
  distance = np.min(np.abs(ritz[:, None] - eig[None, :]), axis=1)
  assert np.all(distance <= bounds + 1e-5 * eig[0])
  assert bounds[0] < 1e-5 * eig[0] and np.max(bounds) > 1e-3 * eig[0]


def test_quadrature_weights_sum_to_one(mlp_lanczos):
  weights = np.asarray(mlp_lanczos.weights)
  assert np.all(weights >= 0) and abs(weights.sum() - 1.0) < 1e-5


def test_top_ritz_vector_is_an_eigenvector(mlp, mlp_lanczos):
  _, _, hess_NxN, eig = mlp
  top_pytree = jax.tree.map(lambda x: x[0], mlp_lanczos.ritz_vectors)
  u_N = np.asarray(ravel_pytree(top_pytree)[0], np.float64)
  assert abs(np.linalg.norm(u_N) - 1.0) < 1e-5
  assert np.linalg.norm(hess_NxN @ u_N - eig[0] * u_N) < 1e-4 * eig[0]




def test_lanczos_on_sharded_params_and_batch(mlp):
  # The project's meshes use Auto axes (sharding.make_mesh); raveling sharded leaves into
  # one basis vector must still compile and give the same spectrum.
  params, batch, _, eig = mlp
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  shard = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  sharded_params = jax.tree.map(
      lambda a: shard(a, jax.sharding.PartitionSpec("data") if a.shape[0] % 8 == 0
                      else jax.sharding.PartitionSpec()), params)
  sharded_batch = jax.tree.map(lambda a: shard(a, jax.sharding.PartitionSpec("data")), batch)
  assert len(sharded_params["dense1"]["kernel"].sharding.device_set) == 8
  run = jax.jit(lambda p, b, key: hessian.lanczos(
      hessian.params_matvec(mlp_loss, p, b), p, 30, key))
  result = run(sharded_params, sharded_batch, jax.random.key(3))
  assert abs(float(result.ritz_values[0]) - eig[0]) / eig[0] <= 1e-4


# ----------------------------------------------------------------------------------------
# Lanczos on known spectra.
# ----------------------------------------------------------------------------------------


def test_known_spectrum_clusters_and_negatives(known):
  # `like` may be abstract: only its shape and dtype are used.
  like = jax.ShapeDtypeStruct((known.shape[0],), jnp.float32)
  result = jax.jit(lambda key: hessian.lanczos(dense_op(known), like, 40, key))(jax.random.key(0))
  ritz = np.asarray(result.ritz_values, np.float64)
  # Top cluster (gap 0.01 out of a spread of 18) and bottom cluster fully resolved.
  np.testing.assert_allclose(ritz[:3], [10.0, 9.99, 9.98], atol=1e-4)
  np.testing.assert_allclose(ritz[-3:], [-5.0, -5.01, -8.0], atol=1e-4)


def test_top_eigenvalues_helper(known):
  run = jax.jit(lambda key: hessian.top_eigenvalues(dense_op(known), jnp.zeros(60), 3, 40, key))
  top = run(jax.random.key(4))
  assert top.values.shape == (3,) and bool(jnp.all(top.valid)) and bool(top.finite)
  np.testing.assert_allclose(np.asarray(top.values), [10.0, 9.99, 9.98], atol=1e-4)
  assert np.all(np.asarray(top.residual_bounds) < 1e-3)


def test_no_spurious_copies_with_reorthogonalization():
  # Plain three-term Lanczos in float32 on this matrix yields 9 copies of lambda=10 by
  # step 80 (measured); full reorthogonalisation must keep exactly one.
  lam = np.concatenate([[10.0], np.linspace(-1.0, 3.0, 99)])
  a_NxN = spectrum_matrix(lam, seed=1)
  result = jax.jit(lambda key: hessian.lanczos(dense_op(a_NxN), jnp.zeros(100), 80, key))(
      jax.random.key(0))
  ritz = np.asarray(result.ritz_values)
  assert np.sum(np.abs(ritz - 10.0) < 1e-2) == 1


def test_breakdown_rank3_returns_nonzero_eigenvalues_and_zero():
  lam = np.zeros(50)
  lam[:3] = [5.0, 0.7, -2.0]
  a_NxN = spectrum_matrix(lam, seed=2)
  result = jax.jit(lambda key: hessian.lanczos(dense_op(a_NxN), jnp.zeros(50), 10, key))(
      jax.random.key(0))
  leaves = jax.tree.leaves(result)
  floats = [np.asarray(x) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
  assert all(np.all(np.isfinite(x)) for x in floats)
  # Krylov space of a random start: the 3 eigenvectors plus the start's null-space part.
  assert int(result.num_valid_steps) == 4
  assert bool(result.breakdown) and bool(result.finite)
  np.testing.assert_array_equal(np.asarray(result.valid), np.arange(10) < 4)
  ritz = np.asarray(result.ritz_values)
  np.testing.assert_allclose(ritz[:4], [5.0, 0.7, 0.0, -2.0], atol=1e-5)
  # Padding repeats the smallest valid value with zero weight; weights still sum to 1.
  np.testing.assert_allclose(ritz[4:], -2.0, atol=1e-5)
  weights = np.asarray(result.weights)
  assert np.all(weights[4:] == 0) and abs(weights.sum() - 1.0) < 1e-5
  assert np.all(np.asarray(result.alphas)[4:] == 0) and np.all(np.asarray(result.betas)[4:] == 0)
  assert np.all(np.asarray(result.residual_bounds)[:4] < 1e-5)


def test_zero_matrix_breaks_down_at_first_step():
  result = jax.jit(lambda key: hessian.lanczos(lambda v: 0.0 * v, jnp.zeros(20), 5, key))(
      jax.random.key(0))
  assert int(result.num_valid_steps) == 1 and bool(result.breakdown)
  np.testing.assert_array_equal(np.asarray(result.ritz_values), 0.0)
  assert float(result.weights[0]) == pytest.approx(1.0)


def test_power_iteration_finds_largest_magnitude():
  lam = np.concatenate([[-10.0, 6.0, 5.0], np.linspace(-3.0, 3.0, 37)])
  a_NxN = spectrum_matrix(lam, seed=3)
  run = jax.jit(lambda key: hessian.power_iteration(dense_op(a_NxN), jnp.zeros(40), 60, key))
  value, vector = run(jax.random.key(0))
  assert float(value) == pytest.approx(-10.0, rel=1e-5)
  top_N = np.linalg.eigh(a_NxN)[1][:, 0]  # eigenvector of -10 (smallest)
  assert abs(np.dot(np.asarray(vector, np.float64), top_N)) > 1 - 1e-6


# ----------------------------------------------------------------------------------------
# SLQ density and trace estimators.
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def known_density(known):
  grid = jnp.linspace(-12.0, 14.0, 2601)
  run = jax.jit(lambda key: hessian.spectral_density(
      dense_op(known), jnp.zeros(known.shape[0]), 30, 16, key, grid, 0.2))
  return run(jax.random.key(5))


def test_slq_density_integrates_to_one(known_density):
  assert bool(known_density.finite)
  integral = np.trapezoid(np.asarray(known_density.density), np.asarray(known_density.grid))
  assert integral == pytest.approx(1.0, abs=1e-4)
  np.testing.assert_allclose(np.asarray(known_density.weights).sum(axis=1), 1.0, atol=1e-5)


def test_slq_density_close_to_exact_smoothed_density(known_density):
  grid = np.asarray(known_density.grid, np.float64)
  exact = np.mean(np.exp(-0.5 * ((grid[None] - KNOWN_LAM[:, None]) / 0.2) ** 2), axis=0)
  exact /= 0.2 * math.sqrt(2 * math.pi)
  l1 = np.trapezoid(np.abs(np.asarray(known_density.density) - exact), grid)
  # Measured ~0.1 with 16 probes; uniform weights or misplaced nodes give > 0.5.
  assert l1 < 0.25


def test_slq_trace_within_three_stderr(known_density):
  exact = KNOWN_LAM.sum()
  estimate, stderr = float(known_density.trace), float(known_density.trace_stderr)
  assert 0 < stderr < 0.5 * abs(exact)
  assert abs(estimate - exact) <= 3 * stderr


def test_hutchinson_trace_and_stderr(known):
  num_probes = 200
  result = jax.jit(lambda key: hessian.hutchinson_trace(
      dense_op(known), jnp.zeros(known.shape[0]), num_probes, key))(jax.random.key(6))
  assert abs(float(result.estimate) - KNOWN_LAM.sum()) <= 3 * float(result.stderr)
  # Rademacher variance is 2 (|A|_F^2 - sum_i A_ii^2); the sample stderr must match it.
  theory = math.sqrt(2 * (np.sum(known**2) - np.sum(np.diag(known)**2)) / num_probes)
  assert float(result.stderr) == pytest.approx(theory, rel=0.25)


def test_hutchpp_trace(known):
  result = jax.jit(lambda key: hessian.hutchpp_trace(
      dense_op(known), jnp.zeros(known.shape[0]), 60, key))(jax.random.key(7))
  assert abs(float(result.estimate) - KNOWN_LAM.sum()) <= 3 * float(result.stderr)


def test_hutchpp_exact_on_low_rank():
  # Rank 5 < sketch size 10: the deflation captures everything, Hutchinson would not.
  lam = np.zeros(80)
  lam[:5] = [7.0, -4.0, 3.0, 2.0, 1.5]
  a_NxN = spectrum_matrix(lam, seed=4)
  result = jax.jit(lambda key: hessian.hutchpp_trace(dense_op(a_NxN), jnp.zeros(80), 30, key))(
      jax.random.key(8))
  assert float(result.estimate) == pytest.approx(lam.sum(), abs=1e-4)
  assert float(result.stderr) < 1e-4


# ----------------------------------------------------------------------------------------
# Matvec builders against dense Hessians.
# ----------------------------------------------------------------------------------------


def test_params_matvec_matches_dense(mlp):
  params, batch, hess_NxN, _ = mlp
  got = materialize(hessian.params_matvec(mlp_loss, params, batch), params)
  assert rel_frobenius(got, hess_NxN) < 1e-5


@pytest.mark.parametrize("select", [lambda path: path.startswith("dense2"), r"^dense2\."])
def test_subset_matvec_is_dense_block(mlp, select):
  params, batch, hess_NxN, _ = mlp
  matvec, like = hessian.subset_matvec(mlp_loss, params, select, batch)
  assert sorted(like) == ["dense2.bias", "dense2.kernel"]
  # Indices of the selected leaves in the full ravel order, in the subset's ravel order.
  offsets, start = {}, 0
  for path, leaf in zip(paths.leaf_paths(params), jax.tree.leaves(params)):
    offsets[path] = np.arange(start, start + leaf.size)
    start += leaf.size
  index = np.concatenate([offsets[path] for path in paths.leaf_paths(like)])
  got = materialize(matvec, like)
  assert rel_frobenius(got, hess_NxN[np.ix_(index, index)]) < 1e-5


def test_subset_matvec_rejects_empty_selection(mlp):
  params, batch, _, _ = mlp
  with pytest.raises(ValueError, match="matched no parameter"):
    hessian.subset_matvec(mlp_loss, params, "attention", batch)


@pytest.mark.parametrize("build", ["accumulated", "linearized"])
def test_micro_batch_matvecs_are_token_weighted(mlp, build):
  params, _, _, _ = mlp
  sizes = (20, 7, 3)  # token counts of three equally shaped micro-batches
  batches = [make_batch(10 + 2 * i, 12) for i in range(len(sizes))]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  if build == "accumulated":
    matvec = hessian.accumulated_matvec(
        lambda b: hessian.params_matvec(mlp_loss, params, b), stacked, sizes)
  else:
    matvec = hessian.linearized_matvec(mlp_loss, params, stacked, sizes)
  got = materialize(matvec, params)
  # Hessian of the token-weighted mean loss sum_i n_i L_i / sum_i n_i, by linearity from
  # per-batch dense Hessians.
  stacked_loss = lambda p, *bs: jnp.stack([mlp_loss(p, b) for b in bs])
  per_batch = dense_hessian(stacked_loss, params, *batches)  # one compile, (3, N, N)
  weighted = sum(n * h for n, h in zip(sizes, per_batch)) / sum(sizes)
  unweighted = np.mean(per_batch, axis=0)
  assert rel_frobenius(got, weighted) < 1e-5
  assert rel_frobenius(unweighted, weighted) > 0.05  # so the check above discriminates


def test_micro_batch_weights_must_match_the_batches(mlp):
  params, batch, _, _ = mlp
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
  with pytest.raises(ValueError, match="weights_K has shape"):
    hessian.linearized_matvec(mlp_loss, params, stacked, [1.0, 2.0, 3.0])


def test_adam_preconditioner_and_preconditioned_matvec(mlp):
  params, batch, hess_NxN, _ = mlp
  b2, eps, steps = 0.95, 1e-8, 3
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.9, b2=b2, eps=eps))

  @jax.jit
  def train_step(trained, opt_state):
    updates, opt_state = tx.update(jax.grad(mlp_loss)(trained, batch), opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state

  opt_state, trained = tx.init(params), params
  for _ in range(steps):
    trained, opt_state = train_step(trained, opt_state)

  precond = hessian.adam_preconditioner(opt_state, None, b2=b2, eps=eps)
  nu_N = np.asarray(ravel_pytree(hessian.find_adam_state(opt_state).nu)[0], np.float64)
  p_N = np.sqrt(nu_N / (1 - b2**steps)) + eps
  np.testing.assert_allclose(np.asarray(ravel_pytree(precond)[0]), p_N, rtol=1e-6)
  explicit_step = hessian.adam_preconditioner(opt_state, steps, b2=b2, eps=eps)
  np.testing.assert_allclose(ravel_pytree(explicit_step)[0], ravel_pytree(precond)[0], rtol=1e-6)

  matvec = hessian.preconditioned_matvec(hessian.params_matvec(mlp_loss, params, batch), precond)
  got = materialize(matvec, params)
  scale_N = 1 / np.sqrt(p_N)
  assert rel_frobenius(got, scale_N[:, None] * hess_NxN * scale_N[None, :]) < 1e-5


def test_activation_matvec_matches_dense(mlp):
  params, _, _, _ = mlp
  batch = make_batch(20, 8)
  like = jnp.zeros((8, D_HIDDEN))
  matvec = hessian.activation_matvec(lambda delta: mlp_loss(params, batch, delta), like)
  got = materialize(matvec, like)
  dense = dense_hessian(lambda delta, p, b: mlp_loss(p, b, delta), like, params, batch)
  assert rel_frobenius(got, dense) < 1e-5
  # The loss is not linear in the activation: the check is not trivially 0 == 0.
  assert np.linalg.norm(dense) > 1e-2


# ----------------------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------------------


def test_mismatched_matvec_shape_raises():
  with pytest.raises(ValueError, match=r"input \(50,\), output \(49,\)"):
    hessian.lanczos(lambda v: v[:-1], jnp.zeros(50), 5, jax.random.key(0))
  with pytest.raises(ValueError, match=r"a: \(3,\).*a: \(3, 1\)"):
    hessian.hutchinson_trace(lambda v: {"a": v["a"][:, None]}, {"a": jnp.zeros(3)}, 4,
                             jax.random.key(0))


def test_num_steps_above_dimension_raises():
  with pytest.raises(ValueError, match=r"num_steps=11 exceeds the dimension 10"):
    hessian.lanczos(lambda v: v, jnp.zeros(10), 11, jax.random.key(0))
  with pytest.raises(ValueError, match=r"num_steps=21 exceeds the dimension 20"):
    hessian.spectral_density(lambda v: v, {"w": jnp.zeros((4, 5))}, 21, 2, jax.random.key(0),
                             jnp.linspace(-1, 1, 5), 0.1)


def _nan_after_first_step(n):
  """A valid matvec on the (Rademacher) start vector, NaN on every later Lanczos vector."""
  a_NxN = jnp.asarray(spectrum_matrix(np.linspace(-1.0, 2.0, n), seed=5), jnp.float32)

  def matvec(v):
    is_start = jnp.abs(jnp.abs(v[0]) * math.sqrt(n) - 1.0) < 1e-4
    return jnp.where(is_start, a_NxN @ v, jnp.nan)

  return matvec


def test_nonfinite_hvp_is_flagged_not_silent():
  result = jax.jit(lambda key: hessian.lanczos(_nan_after_first_step(30), jnp.zeros(30), 8, key,
                                               init="rademacher"))(jax.random.key(0))
  assert not bool(result.finite) and int(result.nonfinite_step) == 1
  assert int(result.num_valid_steps) == 1 and not np.any(np.asarray(result.valid))
  assert np.all(np.isnan(np.asarray(result.ritz_values)))
  assert np.all(np.isfinite(np.asarray(result.alphas)))  # the bad step is masked, not stored
  with pytest.raises(ValueError, match=r"non-finite.*\b1\b"):
    hessian.check_finite(result)


def test_nonfinite_hvp_flagged_in_density():
  density = jax.jit(lambda key: hessian.spectral_density(
      _nan_after_first_step(30), jnp.zeros(30), 5, 3, key, jnp.linspace(-2, 3, 11), 0.1))(
          jax.random.key(1))
  assert not bool(density.finite)
  np.testing.assert_array_equal(np.asarray(density.nonfinite_step), 1)
  with pytest.raises(ValueError, match="non-finite"):
    hessian.check_finite(density)
