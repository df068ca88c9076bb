"""Dotted names of pytree leaves, the way parameters are named everywhere in geonorm_jax.

('blocks', 3, 'attn', 'q', 'kernel', .value) -> 'blocks.3.attn.q.kernel': used by the
optimizer's masks and LR multipliers, per-layer statistics and the Hessian subset selectors.
"""
import jax


def path_to_string(path):
  """The dotted name of a jax key path; the `.value` an nnx.Variable flattens through is dropped."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey):
      if key.name != "value":
        parts.append(key.name)
    elif isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      parts.append(str(key.key))
    else:
      parts.append(str(key))
  return ".".join(parts)


def leaf_paths(tree):
  """Dotted names of every leaf of `tree`, in `jax.tree.leaves` order."""
  return [path_to_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
