"""Hessian-vector products: the matvecs `v -> H v` the estimators in hessian_estimators run on.

A matvec maps a pytree shaped like the parameters (or any `like` pytree) to the same
shape. Builders here cover the whole parameter set, a parameter subset, an activation
perturbation, several micro-batches (token-weighted, recomputed or linearised once) and the
Adam-preconditioned Hessian `P^-1/2 H P^-1/2`.
"""
import re
from typing import Any, Callable, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
import optax

from geonorm_jax.nn.paths import path_to_string

PyTree = Any
Matvec = Callable[[PyTree], PyTree]


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
  zeros = jax.tree.map(jnp.zeros_like, like)
  grad_fn = jax.grad(loss_of_perturbation)
  return lambda vector: jax.jvp(grad_fn, (zeros,), (vector,))[1]


def _num_micro_batches(tokens_KxBxL1):
  """K, the leading axis of the micro-batches (an array or a pytree of arrays)."""
  return jax.tree.leaves(tokens_KxBxL1)[0].shape[0]


def _normalized_weights(count, weights_K):
  if weights_K is None:
    weights_K = jnp.ones((count,), jnp.float32)
  weights_K = jnp.asarray(weights_K, jnp.float32)
  if weights_K.shape != (count,):
    raise ValueError(f"weights_K has shape {weights_K.shape}; expected ({count},), one weight "
                     "per micro-batch")
  return weights_K / jnp.sum(weights_K)


def accumulated_matvec(make_matvec, tokens_KxBxL1, weights_K=None):
  """v -> sum_k w_k make_matvec(tokens[k])(v) / sum_k w_k, over micro-batches in a lax.scan.

  `make_matvec(tokens_BxL1)` builds the matvec of one micro-batch; it is traced inside the
  scan body, so only one micro-batch's HVP intermediates are live at a time (and the
  HVP is compiled once, however many micro-batches there are). Each product recomputes the
  forward and backward pass; `linearized_matvec` pays for them once instead. Equal weights
  by default; pass token counts to get the Hessian of the token-weighted mean loss.
  """
  weights_K = _normalized_weights(_num_micro_batches(tokens_KxBxL1), weights_K)

  def matvec(vector):
    def body(total, inputs):
      tokens_BxL1, weight = inputs
      hv = make_matvec(tokens_BxL1)(vector)
      return jax.tree.map(lambda t, h: t + weight.astype(h.dtype) * h, total, hv), None

    zeros = jax.tree.map(jnp.zeros_like, vector)
    total, _ = lax.scan(body, zeros, (tokens_KxBxL1, weights_K))
    return total

  return matvec


def linearized_matvec(loss_fn: Callable[[PyTree, Any], jax.Array], params: PyTree,
                      tokens_KxBxL1, weights_K=None) -> Matvec:
  """The matvec of `accumulated_matvec(params_matvec ...)`, with the gradient linearised once.

  `jax.linearize` runs the forward and backward pass over every micro-batch once and keeps
  their residuals; each product then runs only the tangent half of forward-over-reverse.
  On the tiny model that halves the cost of a product (results/bench/hessian_analysis.json),
  at the price of holding the residuals of all K micro-batches for the whole analysis
  (about one training step's activations per micro-batch). Use `accumulated_matvec` where
  that does not fit.
  """
  weights_K = _normalized_weights(_num_micro_batches(tokens_KxBxL1), weights_K)

  def mean_grad(p):
    def body(total, inputs):
      tokens_BxL1, weight = inputs
      grads = jax.grad(loss_fn)(p, tokens_BxL1)
      return jax.tree.map(lambda t, g: t + weight.astype(g.dtype) * g, total, grads), None

    zeros = jax.tree.map(jnp.zeros_like, p)
    return lax.scan(body, zeros, (tokens_KxBxL1, weights_K))[0]

  _, tangent = jax.linearize(mean_grad, params)
  return tangent


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
