"""Hessian spectra of losses in JAX: HVPs, Lanczos, SLQ densities, trace estimators.

Everything takes pytrees and returns pytrees, and everything is jit-compatible: a
"matvec" is any function `v -> H v` mapping a pytree shaped like `like` to the same
shape (an array is a pytree). Builders below make matvecs for the whole parameter set,
a parameter subset, an activation perturbation, several batches (token-weighted), and
the Adam-preconditioned Hessian `P^-1/2 H P^-1/2`.

Lanczos keeps a fixed-shape float32 basis buffer `(num_steps + 1, N)` and fully
reorthogonalises each new vector (classical Gram-Schmidt, twice) inside one
`lax.fori_loop`; see design/HESSIAN.md for why each of those choices matters.

Shapes and validation are checked at trace time (ValueError); numerical problems
(a non-finite HVP) are reported in the results via `finite` / `nonfinite_step`, and
`check_finite` turns them into an exception eagerly.
"""
import math
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
from jax import lax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import optax

from geonorm_jax.paths import path_to_string

PyTree = Any
Matvec = Callable[[PyTree], PyTree]

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


def _matmul(a, b):
  return jnp.matmul(a, b, precision=_HIGHEST)


# ----------------------------------------------------------------------------------------
# Hessian-vector products and matvec builders.
# ----------------------------------------------------------------------------------------


def hvp(loss_fn: Callable[..., jax.Array], params: PyTree, vector: PyTree, *args) -> PyTree:
  """H v by forward-over-reverse; `args` are passed through to `loss_fn(params, *args)`."""
  grad_fn = lambda p: jax.grad(loss_fn)(p, *args)
  return jax.jvp(grad_fn, (params,), (vector,))[1]


def params_matvec(loss_fn: Callable[..., jax.Array], params: PyTree, *args) -> Matvec:
  """v -> H v over all of `params` (v shaped like params)."""
  return lambda vector: hvp(loss_fn, params, vector, *args)


def _as_predicate(select: Union[str, Callable[[str], bool]]) -> Callable[[str], bool]:
  if isinstance(select, str):
    pattern = re.compile(select)
    return lambda path: pattern.search(path) is not None
  if callable(select):
    return select
  raise TypeError(f"select must be a regex string or a predicate on paths, got {select!r}")


def subset_matvec(
    loss_fn: Callable[..., jax.Array],
    params: PyTree,
    select: Union[str, Callable[[str], bool]],
    *args,
) -> tuple[Matvec, dict[str, jax.Array]]:
  """HVP restricted to the parameters whose path string satisfies `select`.

  Returns `(matvec, like)` where `like` is a flat dict `path -> array` of the selected
  leaves; the remaining parameters are closed over as constants, so this is exactly the
  diagonal block of the full Hessian for that subset.
  """
  predicate = _as_predicate(select)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [path_to_string(p) for p, _ in with_paths]
  leaves = [leaf for _, leaf in with_paths]
  if len(set(paths)) != len(paths):
    raise ValueError("parameter paths are not unique as strings; cannot select a subset")
  chosen = [i for i, path in enumerate(paths) if predicate(path)]
  if not chosen:
    raise ValueError(f"select matched no parameter; paths are: {paths}")
  like = {paths[i]: leaves[i] for i in chosen}

  def merge(subset):
    merged = list(leaves)
    for i in chosen:
      merged[i] = subset[paths[i]]
    return jax.tree_util.tree_unflatten(treedef, merged)

  def subset_loss(subset, *inner_args):
    return loss_fn(merge(subset), *inner_args)

  return (lambda vector: hvp(subset_loss, like, vector, *args)), like


def activation_matvec(loss_of_perturbation: Callable[[PyTree], jax.Array],
                      like: PyTree) -> Matvec:
  """HVP w.r.t. an additive perturbation `delta` at an activation, taken at delta = 0.

  `loss_of_perturbation(delta)` must add `delta` (shaped like `like`) to the activation of
  interest, e.g. `lambda d: loss(model(x, perturb={'block1.attn_out': d}), y)`.
  """
  zeros = _zeros_like(like)
  grad_fn = jax.grad(loss_of_perturbation)
  return lambda vector: jax.jvp(grad_fn, (zeros,), (vector,))[1]


def accumulated_matvec(make_matvec, tokens_KxBxL1, weights_K=None):
  """v -> sum_k w_k make_matvec(tokens[k])(v) / sum_k w_k, over micro-batches in a lax.scan.

  `make_matvec(tokens_BxL1)` builds the matvec of one micro-batch; it is traced inside the
  scan body, so only one micro-batch's HVP intermediates are live at a time (and the
  HVP is compiled once, however many micro-batches there are). Equal weights by default;
  pass token counts to get the Hessian of the token-weighted mean loss.
  """
  count = tokens_KxBxL1.shape[0]
  if weights_K is None:
    weights_K = jnp.ones((count,), jnp.float32)
  weights_K = jnp.asarray(weights_K, jnp.float32)
  weights_K = weights_K / jnp.sum(weights_K)

  def matvec(vector):
    def body(total, inputs):
      tokens_BxL1, weight = inputs
      hv = make_matvec(tokens_BxL1)(vector)
      return jax.tree.map(lambda t, h: t + weight.astype(h.dtype) * h, total, hv), None

    zeros = jax.tree.map(jnp.zeros_like, vector)
    total, _ = lax.scan(body, zeros, (tokens_KxBxL1, weights_K))
    return total

  return matvec


def multi_batch_matvec(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batches: Sequence[Any],
    token_counts: Sequence[Any],
) -> Matvec:
  """HVP of the token-weighted mean loss over `batches`: sum_i n_i H_i v / sum_i n_i.

  `loss_fn(params, batch)` must be the mean loss over that batch's tokens, so weighting
  by token counts gives the Hessian of the mean over all tokens (an unweighted mean of
  per-batch Hessians is biased when batch sizes differ). Batches may differ in shape.
  """
  if len(batches) != len(token_counts):
    raise ValueError(f"{len(batches)} batches but {len(token_counts)} token counts")
  if not batches:
    raise ValueError("multi_batch_matvec needs at least one batch")
  counts = [jnp.asarray(c, jnp.float32) for c in token_counts]
  total = sum(counts)

  def matvec(vector):
    result = None
    for batch, count in zip(batches, counts):
      weighted = jax.tree.map(lambda h: h * (count / total).astype(h.dtype),
                              hvp(loss_fn, params, vector, batch))
      result = weighted if result is None else jax.tree.map(jnp.add, result, weighted)
    return result

  return matvec


def _restructure_like(tree: PyTree, reference: PyTree, what: str) -> PyTree:
  """`tree`'s leaves in `reference`'s structure.

  Wrapper classes may differ (an NNX optimizer wraps nu in OptVariables where the params
  have Params), so leaves are matched by order and shape, not by treedef.
  """
  leaves, ref_leaves = jax.tree.leaves(tree), jax.tree.leaves(reference)
  shapes = [jnp.shape(x) for x in leaves]
  ref_shapes = [jnp.shape(x) for x in ref_leaves]
  if shapes != ref_shapes:
    raise ValueError(f"{what} leaf shapes {shapes} do not match the vector's {ref_shapes}")
  return jax.tree.unflatten(jax.tree.structure(reference), leaves)


def preconditioned_matvec(matvec: Matvec, preconditioner_diag: PyTree,
                          eps: float = 0.0) -> Matvec:
  """v -> P^-1/2 H P^-1/2 v for a diagonal preconditioner P (e.g. `adam_preconditioner`).

  `preconditioner_diag` is P itself (for Adam: sqrt(nu_hat) + eps_adam); `eps` is an
  optional extra floor added to P before the inverse square root.
  """

  def apply(vector):
    diag = _restructure_like(preconditioner_diag, vector, "preconditioner")
    scale = jax.tree.map(lambda p: lax.rsqrt(p.astype(jnp.float32) + eps), diag)
    scaled = jax.tree.map(lambda s, v: (s * v).astype(v.dtype), scale, vector)
    hv = matvec(scaled)
    return jax.tree.map(lambda s, h: (s * h).astype(h.dtype), scale, hv)

  return apply


def find_adam_state(opt_state: PyTree) -> optax.ScaleByAdamState:
  """The unique `optax.ScaleByAdamState` inside an (optax or NNX) optimizer state."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
  if len(found) != 1:
    raise ValueError(
        f"expected exactly one optax.ScaleByAdamState in opt_state, found {len(found)}")
  return found[0]


def adam_preconditioner(opt_state: PyTree, step: Optional[Any], b2: float,
                        eps: float) -> PyTree:
  """Adam's diagonal preconditioner P = sqrt(nu / (1 - b2^step)) + eps, shaped like nu.

  `step` is the number of Adam updates taken (None: the state's own `count`); b2 and eps
  must be the optimizer's, since a wrong b2 silently mis-scales the bias correction.
  """
  adam_state = find_adam_state(opt_state)
  count = adam_state.count if step is None else step
  correction = 1.0 - jnp.asarray(b2, jnp.float32) ** jnp.asarray(count, jnp.float32)
  return jax.tree.map(lambda nu: jnp.sqrt(nu.astype(jnp.float32) / correction) + eps,
                      adam_state.nu)


# ----------------------------------------------------------------------------------------
# Flattening and validation shared by all the estimators.
# ----------------------------------------------------------------------------------------


def _zeros_like(like: PyTree) -> PyTree:
  """Zeros shaped like `like`; leaves may be arrays or jax.ShapeDtypeStruct."""
  def zeros(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jnp.zeros(x.shape, x.dtype)
    return jnp.zeros_like(x)
  return jax.tree.map(zeros, like)


def _describe_shapes(tree: PyTree) -> str:
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  if len(with_paths) == 1 and not with_paths[0][0]:
    return str(tuple(with_paths[0][1].shape))
  return "{" + ", ".join(f"{path_to_string(p)}: {tuple(x.shape)}" for p, x in with_paths) + "}"


class _FlatOperator(NamedTuple):
  matvec: Callable[[jax.Array], jax.Array]  # float32 (N,) -> float32 (N,)
  unravel: Callable[[jax.Array], PyTree]  # float32 (N,) -> pytree shaped like `like`
  dim: int


def _flat_operator(matvec: Matvec, like: PyTree) -> _FlatOperator:
  """Wrap a pytree matvec as a float32 (N,) -> (N,) map, after checking its shapes."""
  zeros = _zeros_like(like)
  flat_zeros, unravel_native = ravel_pytree(zeros)
  if not jnp.issubdtype(flat_zeros.dtype, jnp.floating):
    raise ValueError(f"`like` must hold floating arrays, got dtype {flat_zeros.dtype}")
  # Trace once up front so a mis-shaped matvec fails here, naming shapes, instead of deep
  # inside the loop with an opaque broadcasting error.
  out = jax.eval_shape(matvec, zeros)
  same_structure = jax.tree.structure(out) == jax.tree.structure(zeros)
  shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]
  same_shapes = shapes(out) == shapes(zeros)
  if not (same_structure and same_shapes):
    raise ValueError(
        "matvec must return a pytree of the same structure and shapes as its input: "
        f"input {_describe_shapes(zeros)}, output {_describe_shapes(out)}")

  # ravel_pytree's unravel insists on the original flat dtype (e.g. bfloat16 params).
  unravel = lambda v_N: unravel_native(v_N.astype(flat_zeros.dtype))
  flat_matvec = lambda v_N: ravel_pytree(matvec(unravel(v_N)))[0].astype(jnp.float32)
  return _FlatOperator(flat_matvec, unravel, int(flat_zeros.size))


def _check_num_steps(num_steps: int, dim: int) -> None:
  if not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
  if num_steps > dim:
    raise ValueError(f"num_steps={num_steps} exceeds the dimension {dim} of the vector space")


def _random_unit(key: jax.Array, dim: int, init: str) -> jax.Array:
  if init == "rademacher":
    z_N = jax.random.rademacher(key, (dim,), dtype=jnp.float32)
  elif init == "gaussian":
    z_N = jax.random.normal(key, (dim,), jnp.float32)
  else:
    raise ValueError(f"init must be 'rademacher' or 'gaussian', got {init!r}")
  return z_N / jnp.linalg.norm(z_N)


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
  residual_bounds and weights are all NaN.
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

  @property
  def breakdown_step(self) -> jax.Array:
    """The step count at which beta ~ 0 stopped the iteration (num_steps if it did not)."""
    return self.num_valid_steps


class _LanczosCarry(NamedTuple):
  basis: jax.Array  # (M + 1, N); rows not yet computed are zero
  alphas: jax.Array
  betas: jax.Array
  num_valid: jax.Array
  active: jax.Array
  breakdown: jax.Array
  nonfinite_step: jax.Array
  norm_estimate: jax.Array  # running max of |alpha|, beta: the scale for "beta ~ 0"


def _lanczos_loop(flat_matvec, v0_N: jax.Array, num_steps: int,
                  breakdown_tol: float) -> _LanczosCarry:
  dim = v0_N.shape[0]
  rows = jnp.arange(num_steps + 1)
  init = _LanczosCarry(
      basis=jnp.zeros((num_steps + 1, dim), jnp.float32).at[0].set(v0_N),
      alphas=jnp.zeros((num_steps,), jnp.float32),
      betas=jnp.zeros((num_steps,), jnp.float32),
      num_valid=jnp.int32(0),
      active=jnp.bool_(True),
      breakdown=jnp.bool_(False),
      nonfinite_step=jnp.int32(-1),
      norm_estimate=jnp.float32(0.0),
  )

  def step(i, carry):
    v_N = carry.basis[i]
    w_N = flat_matvec(v_N)
    finite = jnp.all(jnp.isfinite(w_N))
    w_N = jnp.where(finite, w_N, 0.0)  # keep NaN out of the basis
    alpha = _matmul(v_N, w_N)
    # Full reorthogonalisation subsumes the three-term recurrence; a second pass of
    # classical Gram-Schmidt restores orthogonality to working precision.
    previous = (rows <= i).astype(jnp.float32)
    for _ in range(2):
      w_N = w_N - _matmul(previous * _matmul(carry.basis, w_N), carry.basis)
    beta = jnp.linalg.norm(w_N)
    norm_estimate = jnp.maximum(carry.norm_estimate, jnp.maximum(jnp.abs(alpha), beta))
    broke = finite & (beta <= breakdown_tol * norm_estimate)
    proceed = finite & ~broke
    next_N = jnp.where(proceed, w_N / jnp.where(proceed, beta, 1.0), 0.0)
    return _LanczosCarry(
        basis=carry.basis.at[i + 1].set(next_N),
        alphas=carry.alphas.at[i].set(jnp.where(finite, alpha, 0.0)),
        betas=carry.betas.at[i].set(jnp.where(finite, beta, 0.0)),
        num_valid=jnp.where(finite, i + 1, i).astype(jnp.int32),
        active=proceed,
        breakdown=broke,
        nonfinite_step=jnp.where(finite, -1, i).astype(jnp.int32),
        norm_estimate=norm_estimate,
    )

  # A while_loop stops at a breakdown (no wasted HVPs); a lax.cond guard inside a
  # fori_loop did the same but made every HVP ~35% slower on CPU (bench_hessian.py).
  def keep_going(state):
    i, carry = state
    return (i < num_steps) & carry.active

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


def _lanczos_flat(flat_op: _FlatOperator, v0_N, num_steps, breakdown_tol, return_vectors):
  carry = _lanczos_loop(flat_op.matvec, v0_N, num_steps, breakdown_tol)
  ritz_M, bounds_M, weights_M, valid_M, evecs_MxM = _ritz_from_tridiagonal(
      carry.alphas, carry.betas, carry.num_valid)
  finite = carry.nonfinite_step < 0
  nan_unless_finite = lambda x: jnp.where(finite, x, jnp.nan)
  vectors = None
  if return_vectors:
    vectors_MxN = nan_unless_finite(_matmul(evecs_MxM.T, carry.basis[:num_steps]))
    vectors = jax.vmap(flat_op.unravel)(vectors_MxN)
  step_valid = jnp.arange(num_steps) < carry.num_valid
  return LanczosResult(
      ritz_values=nan_unless_finite(ritz_M),
      residual_bounds=nan_unless_finite(bounds_M),
      weights=nan_unless_finite(weights_M),
      valid=valid_M & finite,
      alphas=jnp.where(step_valid, carry.alphas, 0.0),
      betas=jnp.where(step_valid, carry.betas, 0.0),
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
    key: jax.Array,
    *,
    init: str = "gaussian",
    breakdown_tol: float = DEFAULT_BREAKDOWN_TOL,
    return_vectors: bool = False,
) -> LanczosResult:
  """`num_steps` steps of Lanczos with full reorthogonalisation, from a random unit vector.

  A Gaussian start is the default: a Rademacher vector can be exactly orthogonal to a
  structured eigenvector (e.g. e1 - e2). With `return_vectors`, the Ritz vectors are
  returned as a pytree whose leaves have a leading (num_steps,) axis.
  Call it under `jax.jit`; it raises ValueError at trace time on a mis-shaped matvec or
  num_steps > dimension.
  """
  flat_op = _flat_operator(matvec, like)
  _check_num_steps(num_steps, flat_op.dim)
  v0_N = _random_unit(key, flat_op.dim, init)
  return _lanczos_flat(flat_op, v0_N, num_steps, breakdown_tol, return_vectors)


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
  flat_op = _flat_operator(matvec, like)
  if not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
  v0_N = _random_unit(key, flat_op.dim, "gaussian")

  def step(_, carry):
    v_N, _ = carry
    w_N = flat_op.matvec(v_N)
    rayleigh = _matmul(v_N, w_N)
    norm = jnp.linalg.norm(w_N)
    # A zero image (v in the null space) leaves v as is rather than dividing by zero.
    v_N = jnp.where(norm > 0, w_N / jnp.where(norm > 0, norm, 1.0), v_N)
    return v_N, rayleigh

  v_N, rayleigh = lax.fori_loop(0, num_steps, step, (v0_N, jnp.float32(0.0)))
  return rayleigh, flat_op.unravel(v_N)


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


def spectral_density(
    matvec: Matvec,
    like: PyTree,
    num_steps: int,
    num_probes: int,
    key: jax.Array,
    grid: jax.Array,
    sigma: float,
    *,
    breakdown_tol: float = DEFAULT_BREAKDOWN_TOL,
) -> SpectralDensity:
  """Stochastic Lanczos quadrature: density = mean_p sum_k w_pk N(t; theta_pk, sigma^2).

  Each probe is a normalized Rademacher vector; probes run sequentially (`lax.map`) so
  memory stays at one basis buffer.
  """
  flat_op = _flat_operator(matvec, like)
  _check_num_steps(num_steps, flat_op.dim)
  if num_probes < 1:
    raise ValueError(f"num_probes must be >= 1, got {num_probes}")

  def one_probe(probe_key):
    v0_N = _random_unit(probe_key, flat_op.dim, "rademacher")
    return _lanczos_flat(flat_op, v0_N, num_steps, breakdown_tol, return_vectors=False)

  results = lax.map(one_probe, jax.random.split(key, num_probes))
  nodes_PxM, weights_PxM = results.ritz_values, results.weights
  grid_G = jnp.asarray(grid, jnp.float32)
  z_PxMxG = (grid_G - nodes_PxM[..., None]) / sigma
  gauss_PxMxG = jnp.exp(-0.5 * z_PxMxG**2) / (sigma * math.sqrt(2 * math.pi))
  density_G = jnp.einsum("pm,pmg->g", weights_PxM, gauss_PxMxG, precision=_HIGHEST)
  density_G = density_G / num_probes
  # e1^T T e1 = v^T H v for each probe, so n * sum_k w_k theta_k is a Hutchinson sample.
  trace, stderr = _mean_and_stderr(flat_op.dim * jnp.sum(weights_PxM * nodes_PxM, axis=1))
  return SpectralDensity(grid_G, density_G, nodes_PxM, weights_PxM, trace, stderr,
                         results.num_valid_steps, jnp.all(results.finite),
                         results.nonfinite_step)


class TraceEstimate(NamedTuple):
  estimate: jax.Array
  stderr: jax.Array
  finite: jax.Array


def hutchinson_trace(matvec: Matvec, like: PyTree, num_probes: int,
                     key: jax.Array) -> TraceEstimate:
  """Hutchinson's estimator z^T H z with Rademacher z, averaged over `num_probes`."""
  flat_op = _flat_operator(matvec, like)
  if num_probes < 1:
    raise ValueError(f"num_probes must be >= 1, got {num_probes}")

  def sample(probe_key):
    z_N = jax.random.rademacher(probe_key, (flat_op.dim,), dtype=jnp.float32)
    return _matmul(z_N, flat_op.matvec(z_N))

  samples_P = lax.map(sample, jax.random.split(key, num_probes))
  estimate, stderr = _mean_and_stderr(samples_P)
  return TraceEstimate(estimate, stderr, jnp.all(jnp.isfinite(samples_P)))


def hutchpp_trace(matvec: Matvec, like: PyTree, num_matvecs: int,
                  key: jax.Array) -> TraceEstimate:
  """Hutch++ (Meyer et al. 2021) with a budget of `num_matvecs` HVPs.

  A third of the budget sketches the top range Q of H (exact trace of Q^T H Q), a third
  applies H to Q, and the rest runs Hutchinson on the deflated (I - QQ^T) H (I - QQ^T).
  The reported stderr is that of the deflated Hutchinson part, conditional on Q; the
  estimate is unbiased conditional on Q, so it is the relevant error bar.
  """
  flat_op = _flat_operator(matvec, like)
  sketch = num_matvecs // 3
  num_residual = num_matvecs - 2 * sketch
  if sketch < 1 or num_residual < 2:
    raise ValueError(f"hutchpp_trace needs num_matvecs >= 4, got {num_matvecs}")
  if sketch > flat_op.dim:
    raise ValueError(
        f"sketch size {sketch} (num_matvecs // 3) exceeds the dimension {flat_op.dim}")
  sketch_key, residual_key = jax.random.split(key)
  batched_matvec = lambda rows_KxN: lax.map(flat_op.matvec, rows_KxN)

  s_KxN = jax.random.rademacher(sketch_key, (sketch, flat_op.dim), dtype=jnp.float32)
  q_NxK, _ = jnp.linalg.qr(batched_matvec(s_KxN).T)  # orthonormal basis of range(H S)
  low_rank_trace = jnp.sum(q_NxK.T * batched_matvec(q_NxK.T))

  g_RxN = jax.random.rademacher(residual_key, (num_residual, flat_op.dim), dtype=jnp.float32)
  projected_RxN = g_RxN - _matmul(_matmul(g_RxN, q_NxK), q_NxK.T)
  samples_R = jnp.sum(projected_RxN * batched_matvec(projected_RxN), axis=1)
  residual_trace, stderr = _mean_and_stderr(samples_R)
  estimate = low_rank_trace + residual_trace
  finite = jnp.isfinite(low_rank_trace) & jnp.all(jnp.isfinite(samples_R))
  return TraceEstimate(estimate, stderr, finite)


def check_finite(
    result: Union["LanczosResult", "SpectralDensity", "TopEigenvalues", "TraceEstimate"],
) -> None:
  """Eagerly raise ValueError if a result was computed from a non-finite HVP."""
  if bool(jnp.all(result.finite)):
    return
  step = getattr(result, "nonfinite_step", None)
  where = ""
  if step is not None:
    where = f" (first non-finite step per run: {jax.device_get(step).tolist()})"
  raise ValueError(f"the Hessian-vector product produced non-finite values{where}")
