"""Batched probes, the pytree basis and progress reports of hessian_estimators, against
one-at-a-time runs and dense float64 references (fixtures shared with test_hessian.py)."""
import math

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest

from geonorm_jax import hessian
from tests.test_hessian import (KNOWN_LAM, dense_op, known, mlp, mlp_loss,  # noqa: F401
                                spectrum_matrix)


def float64_lanczos(a_NxN, v0_N, num_steps):
  """Textbook Lanczos with full reorthogonalisation in float64: Ritz values, descending."""
  basis = [v0_N / np.linalg.norm(v0_N)]
  alphas, betas = [], []
  for _ in range(num_steps):
    w = a_NxN @ basis[-1]
    alphas.append(basis[-1] @ w)
    for _ in range(2):
      w = w - np.stack(basis).T @ (np.stack(basis) @ w)
    betas.append(np.linalg.norm(w))
    basis.append(w / betas[-1])
  t = np.diag(alphas) + np.diag(betas[:-1], 1) + np.diag(betas[:-1], -1)
  return np.linalg.eigvalsh(t)[::-1], np.asarray(alphas), np.asarray(betas)


def test_pytree_basis_matches_flat_float64_lanczos(mlp):
  # The same start vector through the pytree Lanczos (float32 HVPs) and a flat float64
  # Lanczos on the dense Hessian: the tridiagonal and the Ritz values agree.
  params, batch, hess_NxN, eig = mlp
  flat_N, unravel = ravel_pytree(params)
  v0_N = np.asarray(jax.random.normal(jax.random.key(11), flat_N.shape), np.float64)
  result = jax.jit(lambda s: hessian.lanczos(hessian.params_matvec(mlp_loss, params, batch),
                                             params, 30, None, start=s))(
                                                 unravel(jnp.asarray(v0_N, jnp.float32)))
  ritz64, alphas64, betas64 = float64_lanczos(hess_NxN, v0_N, 30)
  np.testing.assert_allclose(np.asarray(result.alphas)[:10], alphas64[:10], atol=1e-5 * eig[0])
  np.testing.assert_allclose(np.asarray(result.betas)[:10], betas64[:10], atol=1e-5 * eig[0])
  ritz = np.asarray(result.ritz_values, np.float64)
  np.testing.assert_allclose(ritz[:5], ritz64[:5], atol=1e-5 * eig[0])
  np.testing.assert_allclose(ritz[:5], eig[:5], atol=1e-5 * eig[0])


def test_batched_runs_equal_one_at_a_time(known):
  like = jnp.zeros(known.shape[0])
  key = jax.random.key(21)
  batched = jax.jit(lambda k: hessian.lanczos_batch(dense_op(known), like, 25, 5, k, lanes=2))(key)
  single = jax.jit(lambda k: hessian.lanczos(dense_op(known), like, 25, k, init="rademacher"))
  # Rounding differs between a vmapped and a single product, and Lanczos amplifies it in
  # the later alphas; the early tridiagonal and the converged extremes must agree.
  for run, run_key in enumerate(jax.random.split(key, 5)):
    alone = single(run_key)
    np.testing.assert_allclose(np.asarray(batched.alphas[run])[:5],
                               np.asarray(alone.alphas)[:5], atol=2e-5)
    for index in (0, -1):
      assert float(batched.ritz_values[run, index]) == pytest.approx(
          float(alone.ritz_values[index]), abs=1e-4)
  # Different keys: the runs are not copies of one another.
  assert np.ptp(np.asarray(batched.alphas[:, 0])) > 1e-3


def test_batched_runs_mask_a_breakdown_lane():
  # Rank 3: every run breaks down after 4 steps; the batch keeps the same bookkeeping.
  lam = np.zeros(50)
  lam[:3] = [5.0, 0.7, -2.0]
  a_NxN = spectrum_matrix(lam, seed=2)
  runs = jax.jit(lambda k: hessian.lanczos_batch(dense_op(a_NxN), jnp.zeros(50), 10, 3, k))(
      jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(runs.num_valid_steps), 4)
  assert np.all(np.asarray(runs.breakdown)) and np.all(np.asarray(runs.finite))
  np.testing.assert_allclose(np.asarray(runs.ritz_values)[:, :4], [[5.0, 0.7, 0.0, -2.0]] * 3,
                             atol=1e-5)


def exact_smoothed_density(lam, grid, sigma):
  gauss = np.exp(-0.5 * ((grid[None] - lam[:, None]) / sigma) ** 2)
  return np.mean(gauss, axis=0) / (sigma * math.sqrt(2 * math.pi))


def test_batched_density_on_the_mlp_hessian(mlp):
  params, batch, _, eig = mlp
  sigma = 0.02 * (eig[0] - eig[-1])
  grid = jnp.linspace(eig[-1] - 5 * sigma, eig[0] + 5 * sigma, 801)
  matvec = hessian.params_matvec(mlp_loss, params, batch)
  run = jax.jit(lambda k, lanes: hessian.spectral_density(
      matvec, params, 40, 8, k, grid, sigma, lanes=lanes), static_argnums=1)
  all_lanes, two_lanes = run(jax.random.key(2), 8), run(jax.random.key(2), 2)
  np.testing.assert_allclose(np.asarray(all_lanes.density), np.asarray(two_lanes.density),
                             atol=1e-5 * float(np.max(all_lanes.density)))
  g = np.asarray(grid, np.float64)
  l1 = np.trapezoid(np.abs(np.asarray(all_lanes.density) - exact_smoothed_density(eig, g, sigma)), g)
  assert l1 < 0.25  # uniform weights or misplaced nodes give > 0.5 on this spectrum
  assert abs(float(all_lanes.trace) - eig.sum()) <= 3 * float(all_lanes.trace_stderr)


def test_top_run_counts_as_a_probe(known):
  # A Gaussian-started top-eigenvalue run joined to Rademacher probes: still a density
  # that integrates to 1 and an unbiased trace.
  like = jnp.zeros(known.shape[0])
  grid = jnp.linspace(-12.0, 14.0, 2601)

  def analyse(key):
    top_key, probe_key = jax.random.split(key)
    top = hessian.lanczos(dense_op(known), like, 30, top_key)
    probes = hessian.lanczos_batch(dense_op(known), like, 30, 15, probe_key)
    runs = hessian.concatenate_runs(top, probes)
    return hessian.density_from_runs(runs, known.shape[0], grid, 0.2)

  density = jax.jit(analyse)(jax.random.key(5))
  assert density.nodes.shape == (16, 30)
  g = np.asarray(grid, np.float64)
  assert np.trapezoid(np.asarray(density.density), g) == pytest.approx(1.0, abs=1e-4)
  l1 = np.trapezoid(np.abs(np.asarray(density.density) - exact_smoothed_density(KNOWN_LAM, g, 0.2)), g)
  assert l1 < 0.25
  assert abs(float(density.trace) - KNOWN_LAM.sum()) <= 3 * float(density.trace_stderr)


def test_hutchinson_lanes_do_not_change_the_samples(known):
  like = jnp.zeros(known.shape[0])
  run = jax.jit(lambda k, lanes: hessian.hutchinson_trace(dense_op(known), like, 40, k,
                                                          lanes=lanes), static_argnums=1)
  one, seven, every = (run(jax.random.key(6), lanes) for lanes in (1, 7, 40))
  for other in (seven, every):
    assert float(other.estimate) == pytest.approx(float(one.estimate), rel=1e-5)
    assert float(other.stderr) == pytest.approx(float(one.stderr), rel=1e-4)
  assert abs(float(one.estimate) - KNOWN_LAM.sum()) <= 3 * float(one.stderr)


def test_progress_counts_every_product(known):
  like = jnp.zeros(known.shape[0])
  counted = []
  progress = counted.append

  def analyse(key):
    top = hessian.lanczos(dense_op(known), like, 12, key, progress=progress)
    probes = hessian.lanczos_batch(dense_op(known), like, 12, 5, key, lanes=2,
                                   progress=progress)
    trace = hessian.hutchinson_trace(dense_op(known), like, 3, key, progress=progress)
    return top.alphas, probes.alphas, trace.estimate

  jax.block_until_ready(jax.jit(analyse)(jax.random.key(0)))
  jax.effects_barrier()
  assert sum(counted) == 12 + 5 * 12 + 3


def test_batched_arguments_are_checked():
  with pytest.raises(ValueError, match="lanes must be a positive int"):
    hessian.lanczos_batch(lambda v: v, jnp.zeros(10), 3, 2, jax.random.key(0), lanes=0)
  with pytest.raises(ValueError, match="num_runs must be a positive int"):
    hessian.lanczos_batch(lambda v: v, jnp.zeros(10), 3, 0, jax.random.key(0))
  with pytest.raises(ValueError, match="different numbers of steps"):
    a = hessian.lanczos(lambda v: v, jnp.zeros(10), 3, jax.random.key(0))
    b = hessian.lanczos(lambda v: v, jnp.zeros(10), 4, jax.random.key(0))
    hessian.concatenate_runs(a, b)
