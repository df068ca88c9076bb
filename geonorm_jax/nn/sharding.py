"""Mesh and sharding rules: the only place that names physical mesh axes.

The model labels each parameter with logical axes (embed, heads, kv, mlp, vocab, ...); the
rules below map them to mesh axes (data, fsdp, tensor). A dimension that the mapped mesh
axes do not divide stays replicated, so one rule set serves a laptop and a pod.

Activations get the same treatment: the model calls `constrain(x, logical_axes)` on its
residual stream, attention heads, MLP hidden units and logits. Without these constraints
GSPMD propagated the FSDP weight sharding into the activations and kept every device's
activations for the whole batch (results/bench/memory.md). `constrain` does nothing outside
an `activation_sharding(mesh, rules)` block, so a model called directly (tests, sampling)
is unaffected.
"""
import contextlib
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over every axis that holds a replica

# MaxText-style defaults: FSDP shards the model width, tensor parallelism the heads/MLP/vocab.
DEFAULT_RULES = {
    "batch": BATCH_AXES,
    "embed": "fsdp",
    "heads": "tensor",
    "kv": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "length": None,
    "head_dim": None,
    "layers": None,  # model.scan_layers' stacked block axis: never split
}


def maybe_initialize_distributed(mesh_config):
  """jax.distributed.initialize when the config asks, or (auto) when the environment does."""
  mode = str(mesh_config.distributed).lower()
  if mode not in ("auto", "true", "false"):
    raise ValueError(f"mesh.distributed={mesh_config.distributed!r}; valid: auto, true, false")
  if mode == "false" or jax.distributed.is_initialized():
    return
  env_asks = any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES",
                                           "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))
  if mode == "auto" and not (env_asks or mesh_config.coordinator_address):
    return
  kwargs = {}
  if mesh_config.coordinator_address:
    kwargs = dict(coordinator_address=mesh_config.coordinator_address,
                  num_processes=mesh_config.num_processes, process_id=mesh_config.process_id)
  jax.distributed.initialize(**kwargs)


def mesh_shape(mesh_config, num_devices):
  """(data, fsdp, tensor) with a single -1 filled from the device count."""
  sizes = [mesh_config.data, mesh_config.fsdp, mesh_config.tensor]
  for name, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{name}={size} must be positive or -1 (fill)")
  if sizes.count(-1) > 1:
    raise ValueError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if num_devices % known:
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} do not divide the "
                     f"{num_devices} devices")
  sizes = [num_devices // known if s == -1 else s for s in sizes]
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} uses {int(np.prod(sizes))} devices, "
                     f"but {num_devices} are present")
  return tuple(sizes)


def make_mesh(mesh_config, devices=None):
  devices = jax.devices() if devices is None else devices
  # Auto axes: GSPMD propagates shardings from the in/out annotations (MaxText's mode).
  return jax.make_mesh(mesh_shape(mesh_config, len(devices)), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def parse_rules(text):
  """DEFAULT_RULES updated by "logical=physical[+physical],..." ("none" replicates)."""
  rules = dict(DEFAULT_RULES)
  for item in filter(None, (t.strip() for t in text.split(","))):
    logical, sep, physical = item.partition("=")
    if not sep:
      raise ValueError(f"mesh.rules item {item!r} is not logical=physical")
    axes = tuple(a for a in physical.split("+") if a and a.lower() != "none")
    for axis in axes:
      if axis not in MESH_AXES:
        raise ValueError(f"mesh.rules maps {logical!r} to unknown mesh axis {axis!r}; "
                         f"valid: {', '.join(MESH_AXES)}, none")
    rules[logical] = axes or None
  return rules


def _as_tuple(axes):
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical_axes, shape, mesh, rules):
  """PartitionSpec for one array: each dimension gets the mesh axes its logical name maps to,
  unless they do not divide it or an earlier dimension already used them."""
  used, spec = set(), []
  for name, size in zip(logical_axes, shape):
    axes = tuple(a for a in _as_tuple(rules.get(name)) if a not in used and mesh.shape[a] > 1)
    if axes and size % int(np.prod([mesh.shape[a] for a in axes])) == 0:
      used.update(axes)
      spec.append(axes[0] if len(axes) == 1 else axes)
    else:
      spec.append(None)
  return PartitionSpec(*spec)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh, rules):
  """A sharding for every leaf: Variables by their logical axes, anything else replicated.

  Works on params and on optimizer states, whose moments keep the parameters' Variables.
  """
  def one(leaf):
    if _is_variable(leaf):
      axes = leaf.get_metadata().get("logical_axes") or (None,) * len(leaf.shape)
      return leaf.replace(NamedSharding(mesh, logical_to_spec(axes, leaf.shape, mesh, rules)))
    return NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(one, tree, is_leaf=_is_variable)


def batch_sharding(mesh, rules, ndim, batch_dim=0):
  """A token array whose `batch_dim` is split over the replica axes, the rest replicated."""
  batch_axes = tuple(a for a in _as_tuple(rules.get("batch")) if mesh.shape[a] > 1)
  spec = [None] * ndim
  spec[batch_dim] = batch_axes if len(batch_axes) > 1 else (batch_axes[0] if batch_axes else None)
  return NamedSharding(mesh, PartitionSpec(*spec))


def data_parallel_size(axis_sizes, rules):
  """How many ways the batch is split: the product of the mesh axes `batch` maps to.

  `axis_sizes` is `mesh.shape` or any {axis name: size} mapping (before a mesh exists).
  """
  return int(np.prod([axis_sizes[a] for a in _as_tuple(rules.get("batch"))]))


_ACTIVATION_MESH = []  # (mesh, rules) of the enclosing activation_sharding block, if any


@contextlib.contextmanager
def activation_sharding(mesh, rules):
  """Within this block (while a step is traced), `constrain` pins activations to the rules."""
  _ACTIVATION_MESH.append((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_MESH.pop()


def constrain(x, logical_axes):
  """x with its sharding pinned to its logical axes under the current rules; else x itself."""
  if not _ACTIVATION_MESH:
    return x
  mesh, rules = _ACTIVATION_MESH[-1]
  if mesh.size == 1:
    return x
  spec = logical_to_spec(logical_axes, x.shape, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
