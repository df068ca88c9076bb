"""XLA compiler options of the project's jitted programs (train and eval steps, Hessian
products): on a CPU, keep optimization barriers until fusion.

XLA's CPU pipeline removes every optimization barrier before fusion (its
`cse_barrier_expander` pass). The barriers on GeoNorm's update (norms.py) are what keeps it
from fusing the gradients of all the updates into per-update loops that recompute the later
ones: with the pass disabled, GeoNorm's CPU train step went from 1.108x to 1.061x Pre-LN's
(results/bench/train.json, `barriers`) and its Hessian-vector product ran 1.11x faster
(results/bench/hessian_barriers.json); Pre-LN's programs, which hold no barriers, are
unchanged. Other backends keep XLA's defaults: not measured there.
"""


KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def for_mesh(mesh):
  if mesh.devices.flat[0].platform == "cpu":
    return dict(KEEP_BARRIERS)
  return {}
