"""Spectra from a matvec `v -> H v`: Lanczos, top eigenvalues, power iteration, the SLQ
density and the Hutchinson / Hutch++ trace estimates.

Vectors are pytrees shaped like `like` (float32 inside the estimators, cast to each leaf's
dtype for the matvec); hessian_matvec builds the matvecs. Lanczos keeps its basis as that
pytree with a leading (num_steps + 1,) axis on every leaf, so with `shardings` (the
parameters' shardings) each device holds only its shard of every basis vector: a replicated
(num_steps + 1, N) buffer would not fit at 7B parameters (results/bench/hessian_memory.json).
Each new vector is fully reorthogonalised against the basis (classical Gram-Schmidt, twice)
inside one `lax.while_loop`, which stops at a breakdown.

Independent runs (SLQ probes, Hutchinson probes) are batched: `lanes` of them share one
vmapped matvec call, so one compiled product serves several probes.

Every estimator takes an optional `progress`, a host function called (through
`jax.debug.callback`) after each product with the number of products just finished; the
progress bar of hessian_progress is one.

Shapes and validation are checked at trace time (ValueError); numerical problems (a
non-finite HVP) are reported in the results via `finite` / `nonfinite_step`, and
`check_finite` turns them into an exception eagerly.
"""
import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from geonorm_jax.nn.paths import path_to_string

PyTree = Any
Matvec = Callable[[PyTree], PyTree]
Progress = Optional[Callable[..., None]]

# Relative to a running estimate of |T|: a residual this small means the Krylov space is
# (numerically) invariant. On an exactly rank-3 matrix stored in float32 the residual at
# the invariant subspace measured 1.2e-7 |A| (n=50) and 1.1e-6 |A| (n=2000). A breakdown
# the test misses only adds a harmless Ritz pair with ~0 coupling and weight, whereas a
# tolerance that is too loose would truncate a genuine bulk sitting far below the
# outliers (LM Hessians: bulk ~1e-3 of lambda_max).
DEFAULT_BREAKDOWN_TOL = 1e-5

# Basis products must not drop to bf16/TF32 (TPU/GPU defaults): reorthogonalisation is
# only as good as these inner products. They cost far less than one HVP.
_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------
# Pytree vectors: validation, random starts, inner products, shardings.
# ----------------------------------------------------------------------------------------


def _abstract(like: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), like)


def _describe_shapes(tree: PyTree) -> str:
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  if len(with_paths) == 1 and not with_paths[0][0]:
    return str(tuple(with_paths[0][1].shape))
  return "{" + ", ".join(f"{path_to_string(p)}: {tuple(x.shape)}" for p, x in with_paths) + "}"


class _Operator(NamedTuple):
  matvec: Matvec  # float32 pytree -> float32 pytree, shaped like `like`
  like: PyTree  # ShapeDtypeStructs
  dim: int
  shardings: Optional[list]  # per leaf: NamedSharding or None


def _operator(matvec: Matvec, like: PyTree, shardings: Optional[PyTree] = None) -> _Operator:
  """Check the matvec's shapes (naming them) and wrap it to work on float32 pytrees."""
  like = _abstract(like)
  leaves = jax.tree.leaves(like)
  if not leaves:
    raise ValueError("`like` has no leaves")
  for leaf in leaves:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(f"`like` must hold floating arrays, got dtype {leaf.dtype}")
  # Trace once up front so a mis-shaped matvec fails here, naming shapes, instead of deep
  # inside the loop with an opaque broadcasting error.
  out = jax.eval_shape(matvec, like)
  shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]
  if jax.tree.structure(out) != jax.tree.structure(like) or shapes(out) != shapes(like):
    raise ValueError(
        "matvec must return a pytree of the same structure and shapes as its input: "
        f"input {_describe_shapes(like)}, output {_describe_shapes(out)}")
  sharding_leaves = None
  if shardings is not None:
    sharding_leaves = jax.tree.leaves(shardings)
    if len(sharding_leaves) != len(leaves):
      raise ValueError(f"shardings has {len(sharding_leaves)} leaves, `like` {len(leaves)}")
    sharding_leaves = [s if isinstance(s, jax.sharding.NamedSharding) else None
                       for s in sharding_leaves]

  def f32_matvec(vector):
    native = jax.tree.map(lambda v, l: v.astype(l.dtype), vector, like)
    return jax.tree.map(lambda h: h.astype(jnp.float32), matvec(native))

  dim = int(sum(math.prod(leaf.shape) for leaf in leaves))
  return _Operator(f32_matvec, like, dim, sharding_leaves)


def _constrain(tree: PyTree, op: _Operator, leading_axes: int = 0) -> PyTree:
  """Pin each leaf (with `leading_axes` extra axes in front) to its parameter's sharding."""
  if op.shardings is None:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  pinned = []
  for leaf, sharding in zip(leaves, op.shardings):
    if sharding is not None:
      spec = tuple(sharding.spec) + (None,) * (leaf.ndim - leading_axes - len(sharding.spec))
      leaf = lax.with_sharding_constraint(leaf, jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(*((None,) * leading_axes + spec))))
    pinned.append(leaf)
  return jax.tree.unflatten(treedef, pinned)


def _dot(a: PyTree, b: PyTree) -> jax.Array:
  return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _norm(a: PyTree) -> jax.Array:
  return jnp.sqrt(_dot(a, a))


def _random_tree(key: jax.Array, op: _Operator, init: str) -> PyTree:
  leaves, treedef = jax.tree.flatten(op.like)
  keys = jax.random.split(key, len(leaves))
  if init == "rademacher":
    draw = lambda k, l: jax.random.rademacher(k, l.shape, dtype=jnp.float32)
  elif init == "gaussian":
    draw = lambda k, l: jax.random.normal(k, l.shape, jnp.float32)
  else:
    raise ValueError(f"init must be 'rademacher' or 'gaussian', got {init!r}")
  return _constrain(jax.tree.unflatten(treedef, [draw(k, l) for k, l in zip(keys, leaves)]), op)


def _unit(vector: PyTree) -> PyTree:
  norm = _norm(vector)
  return jax.tree.map(lambda x: x / norm, vector)


def _report(progress: Progress, done: jax.Array, after: jax.Array) -> None:
  """Tell the host `done` products finished; `after` (a result of them) orders the call."""
  if progress is not None:
    jax.debug.callback(lambda d, _: progress(int(d)), done.astype(jnp.int32), after)


def _check_num_steps(num_steps: int, dim: int) -> None:
  if not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
  if num_steps > dim:
    raise ValueError(f"num_steps={num_steps} exceeds the dimension {dim} of the vector space")


def _check_count(name: str, value: int) -> None:
  if not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------------------
# Lanczos.
# ----------------------------------------------------------------------------------------


class LanczosResult(NamedTuple):
  """Output of `lanczos`; all arrays have fixed shape (M = num_steps).

  Only the leading `num_valid_steps` Lanczos steps are valid (fewer than M after a
  breakdown or a non-finite HVP). Entries of the (M,) Ritz arrays beyond that count are
  padding, flagged by `valid == False`: they repeat the smallest valid Ritz value and its
  residual bound (so sorting, max and min stay correct) and carry weight 0 (so
  quadratures are unaffected). If the matvec ever produced a non-finite value,
  `finite` is False, `nonfinite_step` is that step, `valid` is all False and ritz_values,
  residual_bounds and weights are all NaN. `lanczos_batch` returns the same fields with a
  leading (runs,) axis.
  """
  ritz_values: jax.Array  # (M,) descending
  residual_bounds: jax.Array  # (M,) beta_k |last component of the Ritz vector in T's basis|
  weights: jax.Array  # (M,) squared first components; valid ones sum to 1
  valid: jax.Array  # (M,) bool
  alphas: jax.Array  # (M,) diagonal of T; 0 past the valid steps
  betas: jax.Array  # (M,) betas[j] couples Lanczos vectors j and j+1; 0 past the valid steps
  num_valid_steps: jax.Array  # () int32: size k of the valid block of T
  breakdown: jax.Array  # () bool: an invariant subspace was found (beta ~ 0)
  finite: jax.Array  # () bool
  nonfinite_step: jax.Array  # () int32: first step with a non-finite HVP, -1 if none
  ritz_vectors: Optional[PyTree] = None  # leaves (M, ...) when requested, same order


class _LanczosCarry(NamedTuple):
  """The state of `lanes` runs advancing together; per-run arrays end in a (lanes,) axis."""
  basis: PyTree  # leaves (lanes, M + 1, ...); rows not yet computed are zero
  alphas: jax.Array  # (M, lanes)
  betas: jax.Array  # (M, lanes)
  num_valid: jax.Array  # (lanes,)
  active: jax.Array
  breakdown: jax.Array
  nonfinite_step: jax.Array
  norm_estimate: jax.Array  # running max of |alpha|, beta: the scale for "beta ~ 0"


def _lane_sum(tree: PyTree) -> jax.Array:
  """(lanes,) sums over every axis but the leading lane axis, over all leaves."""
  return sum(jnp.sum(x, axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(tree))


def _lane_where(mask_P: jax.Array, tree: PyTree, other) -> PyTree:
  return jax.tree.map(
      lambda x: jnp.where(mask_P.reshape((-1,) + (1,) * (x.ndim - 1)), x, other), tree)


def _lanczos_loop(op: _Operator, v0: PyTree, num_steps: int, breakdown_tol: float,
                  progress: Progress) -> _LanczosCarry:
  """Lanczos runs from the unit start vectors v0 (leaves (lanes, ...)) in lockstep.

  One shared step counter, so reading and writing basis row i are plain dynamic slices
  (a per-lane counter, as vmapping a single run's while_loop gives, turns them into
  gathers and scatters over the whole basis). A lane that breaks down is masked.
  """
  lanes = jax.tree.leaves(v0)[0].shape[0]
  rows = jnp.arange(num_steps + 1)
  # Lanes lead, so both basis contractions are plain batched matrix products (a lanes axis
  # behind the step axis made XLA transpose the whole basis every step).
  basis = jax.tree.map(
      lambda v: jnp.zeros((lanes, num_steps + 1) + v.shape[1:], jnp.float32).at[:, 0].set(v), v0)
  init = _LanczosCarry(
      basis=_constrain(basis, op, leading_axes=2),
      alphas=jnp.zeros((num_steps, lanes), jnp.float32),
      betas=jnp.zeros((num_steps, lanes), jnp.float32),
      num_valid=jnp.zeros((lanes,), jnp.int32),
      active=jnp.ones((lanes,), bool),
      breakdown=jnp.zeros((lanes,), bool),
      nonfinite_step=jnp.full((lanes,), -1, jnp.int32),
      norm_estimate=jnp.zeros((lanes,), jnp.float32),
  )
  if lanes == 1:  # no vmap: the single run's HVP is exactly the caller's matvec
    lane_matvec = lambda v: jax.tree.map(lambda x: x[None], op.matvec(
        jax.tree.map(lambda x: x[0], v)))
  else:
    lane_matvec = jax.vmap(op.matvec)

  def step(i, carry):
    active = carry.active
    v = jax.tree.map(lambda b: b[:, i], carry.basis)
    w = _constrain(lane_matvec(v), op, leading_axes=1)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
                                for x in jax.tree.leaves(w)]), axis=0)
    w = _lane_where(finite, w, 0.0)  # keep NaN out of the basis
    alpha = _lane_sum(jax.tree.map(jnp.multiply, v, w))
    _report(progress, jnp.sum(active), alpha)
    # Full reorthogonalisation subsumes the three-term recurrence; a second pass of
    # classical Gram-Schmidt restores orthogonality to working precision.
    previous = (rows <= i).astype(jnp.float32)[None, :]
    for _ in range(2):
      coefficients = previous * sum(
          jnp.einsum("pm...,p...->pm", b, x, precision=_HIGHEST)
          for b, x in zip(jax.tree.leaves(carry.basis), jax.tree.leaves(w)))
      w = jax.tree.map(
          lambda x, b: x - jnp.einsum("pm,pm...->p...", coefficients, b, precision=_HIGHEST),
          w, carry.basis)
    beta = jnp.sqrt(_lane_sum(jax.tree.map(jnp.square, w)))
    norm_estimate = jnp.maximum(carry.norm_estimate, jnp.maximum(jnp.abs(alpha), beta))
    broke = finite & (beta <= breakdown_tol * norm_estimate)
    proceed = active & finite & ~broke
    scale = jnp.where(proceed, 1.0 / jnp.where(proceed, beta, 1.0), 0.0)
    basis = jax.tree.map(
        lambda b, x: b.at[:, i + 1].set(x * scale.reshape((-1,) + (1,) * (x.ndim - 1))),
        carry.basis, w)
    keep = active & finite
    return _LanczosCarry(
        basis=_constrain(basis, op, leading_axes=2),
        alphas=carry.alphas.at[i].set(jnp.where(keep, alpha, 0.0)),
        betas=carry.betas.at[i].set(jnp.where(keep, beta, 0.0)),
        num_valid=jnp.where(keep, i + 1, carry.num_valid).astype(jnp.int32),
        active=proceed,
        breakdown=jnp.where(active, broke, carry.breakdown),
        nonfinite_step=jnp.where(active & ~finite, i, carry.nonfinite_step).astype(jnp.int32),
        norm_estimate=jnp.where(active, norm_estimate, carry.norm_estimate),
    )

  # A while_loop stops at a breakdown (no wasted HVPs); a lax.cond guard inside a
  # fori_loop did the same but made every HVP ~35% slower on CPU (bench_hessian.py).
  def keep_going(state):
    i, carry = state
    return (i < num_steps) & jnp.any(carry.active)

  def advance(state):
    i, carry = state
    return i + 1, step(i, carry)

  _, carry = lax.while_loop(keep_going, advance, (jnp.asarray(0, jnp.int32), init))
  return carry


def _ritz_from_tridiagonal(alphas_M, betas_M, num_valid):
  """Eigen-decomposition of the valid k x k block of T, padded to fixed shape M.

  The invalid tail of the diagonal is filled with a sentinel strictly above every
  eigenvalue of the valid block (Gershgorin), and its off-diagonals are zeroed, so
  `eigh` returns the valid eigenvalues first (ascending) and the sentinels last.
  """
  m = alphas_M.shape[0]
  index = jnp.arange(m)
  valid = index < num_valid
  alphas_M = jnp.where(valid, alphas_M, 0.0)
  off_diag = jnp.where(index[:-1] < num_valid - 1, betas_M[:-1], 0.0)
  gershgorin = jnp.max(jnp.abs(alphas_M)) + 2.0 * jnp.max(jnp.abs(betas_M), initial=0.0)
  diag = jnp.where(valid, alphas_M, 2.0 * gershgorin + 1.0)
  tridiag_MxM = jnp.diag(diag) + jnp.diag(off_diag, 1) + jnp.diag(off_diag, -1)
  evals_M, evecs_MxM = jnp.linalg.eigh(tridiag_MxM)
  # Descending valid values, then padding that repeats the smallest valid one (index 0).
  order = jnp.where(valid, num_valid - 1 - index, 0)
  ritz_M = evals_M[order]
  evecs_MxM = evecs_MxM[:, order]
  weights_M = jnp.where(valid, evecs_MxM[0] ** 2, 0.0)
  last = jnp.maximum(num_valid - 1, 0)
  bounds_M = betas_M[last] * jnp.abs(evecs_MxM[last])
  return ritz_M, bounds_M, weights_M, valid, evecs_MxM


def _lanczos_runs(op: _Operator, v0: PyTree, num_steps: int, breakdown_tol: float,
                  return_vectors: bool, progress: Progress) -> LanczosResult:
  """Results with a leading (lanes,) axis for the unit starts v0 (leaves (lanes, ...))."""
  carry = _lanczos_loop(op, v0, num_steps, breakdown_tol, progress)
  ritz, bounds, weights, valid, evecs = jax.vmap(_ritz_from_tridiagonal)(
      carry.alphas.T, carry.betas.T, carry.num_valid)
  finite = carry.nonfinite_step < 0
  lane = lambda x: finite.reshape((-1,) + (1,) * (x.ndim - 1))
  nan_unless_finite = lambda x: jnp.where(lane(x), x, jnp.nan)
  vectors = None
  if return_vectors:
    vectors = jax.tree.map(
        lambda b: nan_unless_finite(jnp.einsum("pkm,pk...->pm...", evecs, b[:, :num_steps],
                                               precision=_HIGHEST)), carry.basis)
  step_valid = (jnp.arange(num_steps)[None, :] < carry.num_valid[:, None])
  return LanczosResult(
      ritz_values=nan_unless_finite(ritz),
      residual_bounds=nan_unless_finite(bounds),
      weights=nan_unless_finite(weights),
      valid=valid & finite[:, None],
      alphas=jnp.where(step_valid, carry.alphas.T, 0.0),
      betas=jnp.where(step_valid, carry.betas.T, 0.0),
      num_valid_steps=carry.num_valid,
      breakdown=carry.breakdown,
      finite=finite,
      nonfinite_step=carry.nonfinite_step,
      ritz_vectors=vectors,
  )


def lanczos(
    matvec: Matvec,
    like: PyTree,
    num_steps: int,
    key: Optional[jax.Array],
    *,
    init: str = "gaussian",
    start: Optional[PyTree] = None,
    breakdown_tol: float = DEFAULT_BREAKDOWN_TOL,
    return_vectors: bool = False,
    shardings: Optional[PyTree] = None,
    progress: Progress = None,
) -> LanczosResult:
  """`num_steps` steps of Lanczos with full reorthogonalisation, from a random unit vector.

  A Gaussian start is the default: a Rademacher vector can be exactly orthogonal to a
  structured eigenvector (e.g. e1 - e2). `start` (shaped like `like`, normalised here)
  replaces the random one. With `return_vectors`, the Ritz vectors are returned as a
  pytree whose leaves have a leading (num_steps,) axis. `shardings` (a pytree of
  NamedShardings shaped like `like`) shards every basis vector as the parameters are.
  Call it under `jax.jit`; it raises ValueError at trace time on a mis-shaped matvec or
  num_steps > dimension.
  """
  op = _operator(matvec, like, shardings)
  _check_num_steps(num_steps, op.dim)
  if start is None:
    start = _random_tree(key, op, init)
  v0 = _unit(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), start))
  result = _lanczos_runs(op, jax.tree.map(lambda x: x[None], v0), num_steps, breakdown_tol,
                         return_vectors, progress)
  return jax.tree.map(lambda x: x[0], result)


def lanczos_batch(
    matvec: Matvec,
    like: PyTree,
    num_steps: int,
    num_runs: int,
    key: jax.Array,
    *,
    init: str = "rademacher",
    lanes: Optional[int] = None,
    breakdown_tol: float = DEFAULT_BREAKDOWN_TOL,
    shardings: Optional[PyTree] = None,
    progress: Progress = None,
) -> LanczosResult:
  """`num_runs` independent Lanczos runs from random starts, `lanes` at a time (default all).

  The runs of one group advance in lockstep through one vmapped matvec (one compiled call
  with a leading lanes axis serves the group), with one basis per lane; groups run one
  after another. A run that breaks down is masked while the others continue. Fields gain
  a leading (num_runs,) axis; run r starts from `jax.random.split(key, num_runs)[r]`.
  """
  op = _operator(matvec, like, shardings)
  _check_num_steps(num_steps, op.dim)
  _check_count("num_runs", num_runs)
  lanes = num_runs if lanes is None else lanes
  _check_count("lanes", lanes)

  def group(keys):
    v0 = jax.vmap(lambda k: _unit(_random_tree(k, op, init)))(keys)
    return _lanczos_runs(op, v0, num_steps, breakdown_tol, False, progress)

  keys = jax.random.split(key, num_runs)
  lanes = min(lanes, num_runs)
  full, rest = divmod(num_runs, lanes)
  parts = []
  if full:
    grouped = lax.map(group, keys[:full * lanes].reshape(full, lanes))
    parts.append(jax.tree.map(lambda x: x.reshape((full * lanes,) + x.shape[2:]), grouped))
  if rest:
    parts.append(group(keys[full * lanes:]))
  return parts[0] if len(parts) == 1 else concatenate_runs(*parts)


def concatenate_runs(*runs: LanczosResult) -> LanczosResult:
  """Runs of `lanczos` (one run) or `lanczos_batch` (several) as one batch, in order."""
  if not runs:
    raise ValueError("concatenate_runs needs at least one run")
  steps = {run.alphas.shape[-1] for run in runs}
  if len(steps) != 1:
    raise ValueError(f"runs have different numbers of steps: {sorted(steps)}")
  batched = [run._replace(ritz_vectors=None) for run in runs]
  batched = [jax.tree.map(lambda x: x[None], r) if r.alphas.ndim == 1 else r for r in batched]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *batched)


class TopEigenvalues(NamedTuple):
  values: jax.Array  # (k,) descending
  residual_bounds: jax.Array  # (k,)
  valid: jax.Array  # (k,) bool: False for padding after an early breakdown
  finite: jax.Array  # () bool


def top_eigenvalues(matvec: Matvec, like: PyTree, k: int, num_steps: int, key: jax.Array,
                    **lanczos_kwargs) -> TopEigenvalues:
  """The k largest (algebraic) Ritz values after `num_steps` Lanczos steps."""
  if not 1 <= k <= num_steps:
    raise ValueError(f"need 1 <= k <= num_steps, got k={k}, num_steps={num_steps}")
  result = lanczos(matvec, like, num_steps, key, **lanczos_kwargs)
  return TopEigenvalues(result.ritz_values[:k], result.residual_bounds[:k],
                        result.valid[:k], result.finite)


def power_iteration(matvec: Matvec, like: PyTree, num_steps: int,
                    key: jax.Array) -> tuple[jax.Array, PyTree]:
  """(Rayleigh quotient, unit vector) for the eigenvalue of largest magnitude.

  Converges like |lambda_2 / lambda_1|^num_steps; prefer `lanczos` for accuracy. The
  eigenvalue keeps its sign (a dominant negative eigenvalue is returned negative).
  """
  op = _operator(matvec, like)
  _check_count("num_steps", num_steps)
  v0 = _unit(_random_tree(key, op, "gaussian"))

  def step(_, carry):
    v, _ = carry
    w = op.matvec(v)
    rayleigh = _dot(v, w)
    norm = _norm(w)
    # A zero image (v in the null space) leaves v as is rather than dividing by zero.
    scale = 1.0 / jnp.where(norm > 0, norm, 1.0)
    v = jax.tree.map(lambda x, y: jnp.where(norm > 0, y * scale, x), v, w)
    return v, rayleigh

  v, rayleigh = lax.fori_loop(0, num_steps, step, (v0, jnp.float32(0.0)))
  return rayleigh, jax.tree.map(lambda x, l: x.astype(l.dtype), v, op.like)


# ----------------------------------------------------------------------------------------
# Stochastic Lanczos quadrature and trace estimators.
# ----------------------------------------------------------------------------------------


def _mean_and_stderr(samples_P: jax.Array) -> tuple[jax.Array, jax.Array]:
  num = samples_P.shape[0]
  if num < 2:
    return jnp.mean(samples_P), jnp.float32(jnp.inf)  # one sample: the error is unknown
  return jnp.mean(samples_P), jnp.std(samples_P, ddof=1) / math.sqrt(num)


class SpectralDensity(NamedTuple):
  grid: jax.Array  # (G,)
  density: jax.Array  # (G,) integrates to ~1 over a grid covering the spectrum
  nodes: jax.Array  # (P, M) Ritz values per probe (padded as in LanczosResult)
  weights: jax.Array  # (P, M) quadrature weights per probe (0 on padding)
  trace: jax.Array  # () n * mean_p sum_k w_k theta_k
  trace_stderr: jax.Array  # () standard error of `trace` across probes
  num_valid_steps: jax.Array  # (P,)
  finite: jax.Array  # () bool: every probe's HVPs were finite
  nonfinite_step: jax.Array  # (P,) per probe, -1 if none


def density_from_runs(runs: LanczosResult, dim: int, grid: jax.Array,
                      sigma: float) -> SpectralDensity:
  """SLQ from batched Lanczos runs: density = mean_p sum_k w_pk N(t; theta_pk, sigma^2).

  Any run from a start uniform on the sphere qualifies: a normalised Rademacher or
  Gaussian vector (so `lanczos`'s top-eigenvalue run counts as a probe). `dim` is n.
  """
  nodes_PxM, weights_PxM = runs.ritz_values, runs.weights
  num_probes = nodes_PxM.shape[0]
  grid_G = jnp.asarray(grid, jnp.float32)
  z_PxMxG = (grid_G - nodes_PxM[..., None]) / sigma
  gauss_PxMxG = jnp.exp(-0.5 * z_PxMxG**2) / (sigma * math.sqrt(2 * math.pi))
  density_G = jnp.einsum("pm,pmg->g", weights_PxM, gauss_PxMxG, precision=_HIGHEST)
  density_G = density_G / num_probes
  # e1^T T e1 = v^T H v for each probe, so n * sum_k w_k theta_k is a Hutchinson sample.
  trace, stderr = _mean_and_stderr(dim * jnp.sum(weights_PxM * nodes_PxM, axis=1))
  return SpectralDensity(grid_G, density_G, nodes_PxM, weights_PxM, trace, stderr,
                         runs.num_valid_steps, jnp.all(runs.finite), runs.nonfinite_step)


def spectral_density(
    matvec: Matvec,
    like: PyTree,
    num_steps: int,
    num_probes: int,
    key: jax.Array,
    grid: jax.Array,
    sigma: float,
    *,
    lanes: Optional[int] = None,
    breakdown_tol: float = DEFAULT_BREAKDOWN_TOL,
    shardings: Optional[PyTree] = None,
    progress: Progress = None,
) -> SpectralDensity:
  """Stochastic Lanczos quadrature with `num_probes` normalised Rademacher probes.

  Probes run `lanes` at a time through one vmapped matvec (`lanczos_batch`; default all
  at once); memory grows with lanes (one basis per lane).
  """
  op = _operator(matvec, like, shardings)
  _check_num_steps(num_steps, op.dim)
  runs = lanczos_batch(matvec, like, num_steps, num_probes, key, lanes=lanes,
                       breakdown_tol=breakdown_tol, shardings=shardings, progress=progress)
  return density_from_runs(runs, op.dim, grid, sigma)


class TraceEstimate(NamedTuple):
  estimate: jax.Array
  stderr: jax.Array
  finite: jax.Array


def hutchinson_trace(matvec: Matvec, like: PyTree, num_probes: int, key: jax.Array, *,
                     lanes: Optional[int] = None, shardings: Optional[PyTree] = None,
                     progress: Progress = None) -> TraceEstimate:
  """Hutchinson's estimator z^T H z with Rademacher z, averaged over `num_probes`,
  `lanes` probes per vmapped matvec call (default all)."""
  op = _operator(matvec, like, shardings)
  _check_count("num_probes", num_probes)
  lanes = num_probes if lanes is None else lanes
  _check_count("lanes", lanes)

  def sample(probe_key):
    z = _random_tree(probe_key, op, "rademacher")
    value = _dot(z, _constrain(op.matvec(z), op))
    _report(progress, jnp.int32(1), value)
    return value

  samples_P = lax.map(sample, jax.random.split(key, num_probes),
                      batch_size=min(lanes, num_probes))
  estimate, stderr = _mean_and_stderr(samples_P)
  return TraceEstimate(estimate, stderr, jnp.all(jnp.isfinite(samples_P)))


def hutchpp_trace(matvec: Matvec, like: PyTree, num_matvecs: int, key: jax.Array, *,
                  lanes: Optional[int] = None) -> TraceEstimate:
  """Hutch++ (Meyer et al. 2021) with a budget of `num_matvecs` HVPs.

  A third of the budget sketches the top range Q of H (exact trace of Q^T H Q), a third
  applies H to Q, and the rest runs Hutchinson on the deflated (I - QQ^T) H (I - QQ^T).
  The reported stderr is that of the deflated Hutchinson part, conditional on Q; the
  estimate is unbiased conditional on Q, so it is the relevant error bar. The sketch is a
  dense (n, num_matvecs / 3) matrix: a tool for models whose parameters fit many times.
  """
  op = _operator(matvec, like)
  sketch = num_matvecs // 3
  num_residual = num_matvecs - 2 * sketch
  if sketch < 1 or num_residual < 2:
    raise ValueError(f"hutchpp_trace needs num_matvecs >= 4, got {num_matvecs}")
  if sketch > op.dim:
    raise ValueError(f"sketch size {sketch} (num_matvecs // 3) exceeds the dimension {op.dim}")
  _, unravel = ravel_pytree(jax.tree.map(lambda l: jnp.zeros(l.shape, jnp.float32), op.like))
  flat_matvec = lambda v_N: ravel_pytree(op.matvec(unravel(v_N)))[0]
  batched_matvec = lambda rows_KxN: lax.map(flat_matvec, rows_KxN, batch_size=lanes)
  sketch_key, residual_key = jax.random.split(key)

  s_KxN = jax.random.rademacher(sketch_key, (sketch, op.dim), dtype=jnp.float32)
  q_NxK, _ = jnp.linalg.qr(batched_matvec(s_KxN).T)  # orthonormal basis of range(H S)
  low_rank_trace = jnp.sum(q_NxK.T * batched_matvec(q_NxK.T))

  g_RxN = jax.random.rademacher(residual_key, (num_residual, op.dim), dtype=jnp.float32)
  projected_RxN = g_RxN - jnp.matmul(jnp.matmul(g_RxN, q_NxK, precision=_HIGHEST), q_NxK.T,
                                     precision=_HIGHEST)
  samples_R = jnp.sum(projected_RxN * batched_matvec(projected_RxN), axis=1)
  residual_trace, stderr = _mean_and_stderr(samples_R)
  estimate = low_rank_trace + residual_trace
  finite = jnp.isfinite(low_rank_trace) & jnp.all(jnp.isfinite(samples_R))
  return TraceEstimate(estimate, stderr, finite)


def check_finite(
    result: Union[LanczosResult, SpectralDensity, TopEigenvalues, TraceEstimate],
) -> None:
  """Eagerly raise ValueError if a result was computed from a non-finite HVP."""
  if bool(jnp.all(result.finite)):
    return
  step = getattr(result, "nonfinite_step", None)
  where = ""
  if step is not None:
    where = f" (first non-finite step per run: {jax.device_get(step).tolist()})"
  raise ValueError(f"the Hessian-vector product produced non-finite values{where}")
