"""Residual placements: one pure function per placement, and a registry keyed by config string.

Every update has the signature `update(x, sublayer, norms, ctx) -> x_next` where
  x         the residual stream (..., D),
  sublayer  F, a function of arrays (attention or MLP, its parameters closed over),
  norms     SublayerNorms: `input` and `output` callables (None where the placement has none),
  ctx       ResidualContext: the per-sublayer constants (dt, depth index, step size, ...).
The model asks the registry which norms to build; the equations live only here.
"""
import dataclasses
import math
from typing import Any, Callable, Optional

import jax.numpy as jnp

from geonorm_jax import norms as norms_lib

Array = Any
Norm = Callable[[Array], Array]


@dataclasses.dataclass(frozen=True)
class SublayerNorms:
  input: Optional[Norm] = None
  output: Optional[Norm] = None


@dataclasses.dataclass(frozen=True)
class ResidualContext:
  layer: int  # 1-based block index l
  num_layers: int  # T
  dt: float = 1.0  # residual step of additive placements
  geo_step_size: float = 1.0  # alpha_k of GeoNorm
  geo_theta_max: Optional[float] = None
  deepnorm_alpha: float = 1.0
  ngpt_alpha: Optional[Array] = None  # per-feature eigen learning rate of nGPT


def pre(x, sublayer, norms, ctx):
  """x' = x + dt F(N(x))."""
  return x + ctx.dt * sublayer(norms.input(x))


def post(x, sublayer, norms, ctx):
  """x' = N(x + dt F(x))."""
  return norms.output(x + ctx.dt * sublayer(x))


def peri(x, sublayer, norms, ctx):
  """x' = x + dt N_out(F(N_in(x)))  (Peri-LN, also called Sandwich-LN)."""
  return x + ctx.dt * norms.output(sublayer(norms.input(x)))


def deepnorm(x, sublayer, norms, ctx):
  """x' = N(a x + dt F(x)) with a = (2T)^(1/4) for a decoder."""
  return norms.output(ctx.deepnorm_alpha * x + ctx.dt * sublayer(x))


def geonorm(x, sublayer, norms, ctx):
  """x' = exp_x(alpha_k * tangent(F(N(x)))): a geodesic step, |x'| == |x|."""
  sublayer_input = x if norms.input is None else norms.input(x)
  g = sublayer(sublayer_input)
  return norms_lib.geodesic_update(x, g, ctx.geo_step_size, ctx.geo_theta_max)


def simplenorm(x, sublayer, norms, ctx):
  """x' = x + dt F(x), where F normalises the output of each of its linear maps."""
  del norms
  return x + ctx.dt * sublayer(x)


def layernorm_scaling(x, sublayer, norms, ctx):
  """x' = x + dt F(N(x) / sqrt(l))  (LayerNorm Scaling)."""
  return x + ctx.dt * sublayer(norms.input(x) / math.sqrt(ctx.layer))


def ngpt(x, sublayer, norms, ctx):
  """x' = L2(x + |a| (L2(F(x)) - x)); the weights are L2-normalised after each step elsewhere."""
  del norms
  h = norms_lib.l2_normalize(sublayer(x))
  alpha = jnp.abs(ctx.ngpt_alpha).astype(x.dtype)
  return norms_lib.l2_normalize(x + alpha * (h - x))


def _always(layer, config):
  del layer, config
  return True


def _never(layer, config):
  del layer, config
  return False


def mixln_post_layers(config):
  """Mix-LN: Post-LN in the first floor(fraction * T) blocks."""
  return math.floor(config.mixln_fraction * config.num_layers)


def _mixln_is_post(layer, config):
  return layer <= mixln_post_layers(config)


def mixln(x, sublayer, norms, ctx):
  """Post-LN where the block has an output norm (early blocks), Pre-LN elsewhere."""
  return post(x, sublayer, norms, ctx) if norms.output is not None else pre(x, sublayer, norms, ctx)


def _geonorm_reads_norm(layer, config):
  del layer
  return config.geo_sublayer_input == "norm"


@dataclasses.dataclass(frozen=True)
class Placement:
  """How one placement wires its norms; `has_input_norm(layer, model_config)` etc. are per block."""
  name: str
  update: Callable
  has_input_norm: Callable = _never
  has_output_norm: Callable = _never
  final_norm: bool = True
  norm_after_every_linear: bool = False  # SimpleNorm
  stream_norm: str = "norm"  # norm | dyt: what N is for this placement
  # What the embedding output (tokens + positions) becomes before block 1:
  #   none; sphere: radius sqrt(d) (GeoNorm); unit: L2-normalised (nGPT's stream is unit-norm);
  #   scaled: times a learnable scalar initialised to sqrt(d) (DyT's LLaMA recipe).
  embedding_output: str = "none"
  weight_decay: bool = True  # False: no decay at all (nGPT re-normalises its matrices instead)
  is_ngpt: bool = False


PLACEMENTS = {
    "pre": Placement("pre", pre, has_input_norm=_always),
    "post": Placement("post", post, has_output_norm=_always, final_norm=False),
    "peri": Placement("peri", peri, has_input_norm=_always, has_output_norm=_always),
    "deepnorm": Placement("deepnorm", deepnorm, has_output_norm=_always, final_norm=False),
    "geonorm": Placement("geonorm", geonorm, has_input_norm=_geonorm_reads_norm,
                         embedding_output="sphere"),
    "simplenorm": Placement("simplenorm", simplenorm, norm_after_every_linear=True),
    "lns": Placement("lns", layernorm_scaling, has_input_norm=_always),
    "mixln": Placement("mixln", mixln, has_input_norm=lambda l, c: not _mixln_is_post(l, c),
                       has_output_norm=_mixln_is_post),
    # NVIDIA/ngpt train.py: weight_decay = 0.0 when use_nGPT (the matrices are re-normalised).
    "ngpt": Placement("ngpt", ngpt, final_norm=False, embedding_output="unit", weight_decay=False,
                      is_ngpt=True),
    "dyt": Placement("dyt", pre, has_input_norm=_always, stream_norm="dyt",
                     embedding_output="scaled"),
}
ALIASES = {"sandwich": "peri"}


def valid_names():
  return sorted(PLACEMENTS) + sorted(ALIASES)


def get_placement(name):
  """The registry entry for a config string; an unknown name lists the valid ones."""
  resolved = ALIASES.get(name, name)
  if resolved not in PLACEMENTS:
    raise ValueError(f"model.placement={name!r} is unknown; valid: {', '.join(valid_names())}")
  return PLACEMENTS[resolved]


def geonorm_update_index(layer, sublayer_index, counter):
  """k of the step-size schedule: the block index, or the sublayer index 1..2T."""
  return layer if counter == "blocks" else 2 * (layer - 1) + sublayer_index


def geonorm_num_updates(num_layers, counter):
  return num_layers if counter == "blocks" else 2 * num_layers
