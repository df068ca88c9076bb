"""Residual placements: one pure function per placement, and a registry keyed by config string.

Every update has the signature `update(x, sublayer, norms, ctx) -> x_next` where
  x         the residual stream (..., D),
  sublayer  F, a function of arrays (attention or MLP, its parameters closed over),
  norms     SublayerNorms: `input` and `output` callables (None where the placement has none),
  ctx       ResidualContext: the block index, dt, and the placement's own per-sublayer
            constants and learnable parameters (as arrays).
A registry entry declares everything else the placement needs: which norms exist, its config
fields (`options`, added to config.model), its per-sublayer constants and parameters, and
hooks on the embedding and after each optimizer step. A new placement is one entry here.
"""
import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
from flax import nnx

from geonorm_jax.nn import init_rules
from geonorm_jax.nn import norms as norms_lib
from geonorm_jax.nn.layers import NgptScale

Array = Any
Norm = Callable[[Array], Array]


@dataclasses.dataclass(frozen=True)
class SublayerNorms:
  input: Optional[Norm] = None
  output: Optional[Norm] = None


@dataclasses.dataclass(frozen=True)
class ResidualContext:
  layer: Any  # 1-based block index l (an int32 array under model.scan_layers)
  num_layers: int  # T
  dt: float = 1.0  # residual step of additive placements
  constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # Placement.constants
  params: Mapping[str, Array] = dataclasses.field(default_factory=dict)  # Placement.sublayer_params


@dataclasses.dataclass(frozen=True)
class Option:
  """A config.model field that a placement adds: its default, what it means, and its checks.

  `check(value)` returns an error text (or None); `resolve(value, model_config)` turns an
  `auto`-style default into the value the model uses.
  """
  default: Any
  help: str
  check: Callable[[Any], Optional[str]] = lambda value: None
  resolve: Callable[[Any, Any], Any] = lambda value, model_config: value


def positive(value):
  return None if value > 0 else "must be positive"


def non_negative(value):
  return None if value >= 0 else "must be >= 0"


def one_of(*valid):
  return lambda value: None if value in valid else f"is unknown; valid: {', '.join(valid)}"


def pre(x, sublayer, norms, ctx):
  """x' = x + dt F(N(x))."""
  return x + ctx.dt * sublayer(norms.input(x))


def post(x, sublayer, norms, ctx):
  """x' = N(x + dt F(x))."""
  return norms.output(x + ctx.dt * sublayer(x))


def peri(x, sublayer, norms, ctx):
  """x' = x + dt N_out(F(N_in(x)))  (Peri-LN, also called Sandwich-LN)."""
  return x + ctx.dt * norms.output(sublayer(norms.input(x)))


def reordered(x, sublayer, norms, ctx):
  """x' = x + dt N(F(x))  (OLMo 2's reordered norm: a norm on F's output, none on its input)."""
  return x + ctx.dt * norms.output(sublayer(x))


def deepnorm(x, sublayer, norms, ctx):
  """x' = N(a x + dt F(x)) with a = (2T)^(1/4) for a decoder."""
  return norms.output(ctx.constants["alpha"] * x + ctx.dt * sublayer(x))


def geonorm(x, sublayer, norms, ctx):
  """x' = exp_x(alpha_k * tangent(F(N(x)))): a geodesic step, |x'| == |x|."""
  sublayer_input = x if norms.input is None else norms.input(x)
  g = sublayer(sublayer_input)
  return norms_lib.geodesic_update(x, g, ctx.constants["step_size"], ctx.constants["theta_max"])


def simplenorm(x, sublayer, norms, ctx):
  """x' = x + dt F(x), where F normalises the output of each of its linear maps."""
  del norms
  return x + ctx.dt * sublayer(x)


def layernorm_scaling(x, sublayer, norms, ctx):
  """x' = x + dt F(N(x) / sqrt(l))  (LayerNorm Scaling)."""
  h = norms.input(x)
  # jnp, not math: under model.scan_layers the block index l is a scanned array.
  return x + ctx.dt * sublayer(h / jnp.sqrt(jnp.asarray(ctx.layer, jnp.float32)).astype(h.dtype))


def ngpt(x, sublayer, norms, ctx):
  """x' = L2(x + |a| (L2(F(x)) - x)); the weights are L2-normalised after each step elsewhere."""
  del norms
  h = norms_lib.l2_normalize(sublayer(x))
  alpha = jnp.abs(ctx.params["alpha"]).astype(x.dtype)
  return norms_lib.l2_normalize(x + alpha * (h - x))


def _always(layer, config):
  del layer, config
  return True


def _never(layer, config):
  del layer, config
  return False


def mixln_post_layers(spec):
  """Mix-LN: Post-LN in the first floor(fraction * T) blocks."""
  return math.floor(spec.option("mixln_fraction") * spec.num_layers)


def _mixln_is_post(layer, spec):
  return layer <= mixln_post_layers(spec)


def mixln(x, sublayer, norms, ctx):
  """Post-LN where the block has an output norm (early blocks), Pre-LN elsewhere."""
  return post(x, sublayer, norms, ctx) if norms.output is not None else pre(x, sublayer, norms, ctx)


def _geonorm_reads_norm(layer, spec):
  del layer
  return spec.option("geo_sublayer_input") == "norm"


def geonorm_update_index(layer, sublayer_index, counter):
  """k of the step-size schedule: the block index, or the sublayer index 1..2T."""
  return layer if counter == "blocks" else 2 * (layer - 1) + sublayer_index


def geonorm_num_updates(num_layers, counter):
  return num_layers if counter == "blocks" else 2 * num_layers


def _geonorm_constants(spec, layer, sublayer_index):
  counter = spec.option("geo_counter")
  k = geonorm_update_index(layer, sublayer_index, counter)
  total = geonorm_num_updates(spec.num_layers, counter)
  return {"step_size": norms_lib.geonorm_step_size(k, total, spec.option("geo_alpha"),
                                                   spec.option("geo_schedule")),
          "theta_max": spec.option("geo_theta_max") or None}


GEONORM_OPTIONS = {
    "geo_alpha": Option(1.0, "alpha of the step-size schedule", positive),
    "geo_schedule": Option("harmonic", "alpha_k over depth: constant | harmonic (alpha/k) | "
                           "sqrt (alpha/sqrt(k)) | linear (alpha (T-k+1)/T) | linear_paper "
                           "(alpha (T-k)/T)", one_of(*norms_lib.SCHEDULES)),
    "geo_counter": Option("blocks", "what k counts: blocks (k=l) | sublayers (k=1..2T)",
                          one_of("blocks", "sublayers")),
    "geo_theta_max": Option(0.0, "clamp on the geodesic angle; 0 = none", non_negative),
    "geo_sublayer_input": Option("norm", "norm: F reads N(x) | raw: F reads x",
                                 one_of("norm", "raw")),
    "geo_radius": Option("sqrt_d", "sqrt_d: the embedding is put on the sqrt(d) sphere | "
                         "embedding: keep |e|", one_of("sqrt_d", "embedding")),
}


def _deepnorm_constants(spec, layer, sublayer_index):
  del layer, sublayer_index
  return {"alpha": norms_lib.deepnorm_alpha(spec.num_layers)}


def _ngpt_params(spec, layer):
  del layer
  d = spec.d_model
  return {"alpha": NgptScale(d, spec.option("ngpt_alpha_init"), d ** -0.5, "embed")}


# DyT's alpha_0 as (attention, other) by model width and depth, from Zhu, Chen, He, LeCun, Liu,
# "Transformers without Normalization" (arXiv 2503.10622), Section 7.2 "Initialization of alpha
# for LLMs": the table "Optimal alpha_0 (attention / other) across model widths and depths in
# LLaMA training" (Table 12 in the first arXiv HTML version, Table 11 in a later one) gives
# every cell of widths 1024..8192 x depths 8..64; the per-model table ("Optimal alpha_0 for
# different LLaMA models", Table 11 / 10) adds LLaMA 13B (width 5120, depth 40: 0.6/0.15) and
# repeats 7B (4096 x 32: 0.8/0.2) and 34B/70B (width printed 8196, i.e. 8192: 0.2/0.05), as
# the authors' commands do (jiachenzhu/DyT other_tasks/LLaMA/README.md). "attention" is the DyT
# before attention; "other" is the DyT before the FFN and the final DyT before the head.
# The paper finds depth has negligible influence: every row is constant along depth.
DYT_ALPHA_BY_WIDTH_DEPTH = {
    1024: {8: (1.0, 1.0), 16: (1.0, 1.0), 32: (1.0, 1.0), 64: (1.0, 1.0)},
    2048: {8: (1.0, 0.5), 16: (1.0, 0.5), 32: (1.0, 0.5), 64: (1.0, 0.5)},
    4096: {8: (0.8, 0.2), 16: (0.8, 0.2), 32: (0.8, 0.2), 64: (0.8, 0.2)},
    5120: {40: (0.6, 0.15)},
    8192: {8: (0.2, 0.05), 16: (0.2, 0.05), 32: (0.2, 0.05), 64: (0.2, 0.05)},
}


def _table_entry(entries, value):
  """The smallest table entry >= value; past the last entry, the last (an extrapolation)."""
  return next((e for e in sorted(entries) if value <= e), max(entries))


def dyt_authors_alphas(d_model, num_layers=None):
  """(attention-input, MLP-input, final) DyT alpha_0 for a model of this width and depth.

  The row is the smallest table width >= d_model, the column the smallest table depth >=
  num_layers in that row: a width or depth between two entries takes the next larger entry
  (for width, the smaller and, per Section 7.1, more stable alpha_0), one below the table
  its first entry (every width < 1024, e.g. our tiny d=128, takes 1.0/1.0: the paper trains
  nothing narrower, so that is an extrapolation), one above it its last (8192, 64).
  num_layers=None: the row's first column (the values do not depend on depth).

  The embedding (Appendix A, "Large Language Models"): the authors multiply the embedding
  output by a learnable scalar initialised to sqrt(d), because without it "the magnitudes of
  model activations at the beginning of training are too small, and the training struggles to
  progress". Our `dyt` placement does the same (embedding_output="scaled": the Transformer's
  `embed_scale`, a learnable scalar initialised to sqrt(d_model), multiplies tokens (+ learned
  positions on gpt2) before block 1), on both backbones; the embedding itself keeps the
  N(0, init_std^2) init, so the stream entering block 1 has rms about init_std * sqrt(d).
  """
  row = DYT_ALPHA_BY_WIDTH_DEPTH[_table_entry(DYT_ALPHA_BY_WIDTH_DEPTH, d_model)]
  depth = min(row) if num_layers is None else _table_entry(row, num_layers)
  attention, other = row[depth]
  return attention, other, other


def _dyt_alpha(index, site):
  return Option(0.0, f"DyT's alpha at init for the {site} DyT; 0 = the authors' value for "
                "this width and depth", non_negative,
                lambda value, c: float(value) or dyt_authors_alphas(c.d_model,
                                                                    c.num_layers)[index])


def _scaled_pre(x, sublayer, norms, ctx):
  """x' = x + dt s F(N(x)), s a learnable scalar per sublayer."""
  return x + ctx.dt * ctx.params["scale"].astype(x.dtype) * sublayer(norms.input(x))


def _scaled_pre_params(spec, layer):
  del layer
  return {"scale": nnx.Param(jnp.full((), spec.option("scaled_pre_init"), jnp.float32),
                             logical_axes=())}


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """How one placement wires its norms; `has_input_norm(layer, spec)` etc. are per block.

  A ModelSpec holds its resolved entry (`spec.placement`), and a spec is static data of the
  model's graph (hashed, compared), so an entry compares and hashes by its name: the
  registry holds one entry per name."""
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
  options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
  # (spec, layer, sublayer_index 1|2) -> dict of constants, passed as ctx.constants
  constants: Optional[Callable] = None
  # (spec, layer) -> {name: nnx.Param or module}; built once per sublayer, passed (as arrays)
  # as ctx.params; stored on the block as `attn_<name>` and `mlp_<name>`.
  sublayer_params: Optional[Callable] = None
  # (spec, role, layer) -> the std of the normal init of that weight (init_rules.py)
  init_std: Callable = init_rules.default_std
  # params -> params, applied at init and after every optimizer step (nGPT's projection)
  after_update: Optional[Callable] = None
  is_ngpt: bool = False  # nGPT's attention and MLP internals (model.py)

  def __eq__(self, other):
    return isinstance(other, Placement) and other.name == self.name

  def __hash__(self):
    return hash(("Placement", self.name))

  def __str__(self):
    return self.name


PLACEMENTS = {
    "pre": Placement("pre", pre, has_input_norm=_always),
    "post": Placement("post", post, has_output_norm=_always, final_norm=False),
    "peri": Placement("peri", peri, has_input_norm=_always, has_output_norm=_always),
    # OLMo 2 and 3's block, allenai/OLMo-core src/olmo_core/nn/transformer/block.py,
    # ReorderedNormTransformerBlock: `h = x + attention_norm(attention(x))`, then
    # `h + feed_forward_norm(feed_forward(h))`: Peri-LN without its input norm, so F reads the
    # raw stream and the stream keeps growing (unlike Post-LN, whose norm is on the sum).
    # TransformerConfig.llama_like (nn/transformer/config.py), which every olmo2_*/olmo3_*
    # preset builds on: a final RMSNorm before the head (LMHeadConfig(layer_norm=...)), no
    # embedding norm (embedding_norm stays None). Those presets also set qk_norm=True with
    # use_head_qk_norm=False: one RMSNorm over the whole projected q and one over k, before
    # RoPE, i.e. our model.qk_norm=true,qk_norm_scope=full; it stays that separate switch so
    # the placement can be compared alone. Not copied: OLMo's init (InitMethod.normal: every
    # linear and embedding weight truncated N(0, 0.02), no depth scaling); we keep the shared rule, whose W_o and
    # W_down / sqrt(2T) the output norm cancels in the forward pass at init (zero biases; up
    # to eps).
    "reordered": Placement("reordered", reordered, has_output_norm=_always),
    "deepnorm": Placement("deepnorm", deepnorm, has_output_norm=_always, final_norm=False,
                          constants=_deepnorm_constants, init_std=init_rules.deepnorm_std),
    "geonorm": Placement("geonorm", geonorm, has_input_norm=_geonorm_reads_norm,
                         embedding_output="sphere", options=GEONORM_OPTIONS,
                         constants=_geonorm_constants),
    "simplenorm": Placement("simplenorm", simplenorm, norm_after_every_linear=True,
                            init_std=init_rules.simplenorm_std),
    "lns": Placement("lns", layernorm_scaling, has_input_norm=_always),
    "mixln": Placement("mixln", mixln, has_input_norm=lambda l, c: not _mixln_is_post(l, c),
                       has_output_norm=_mixln_is_post, options={"mixln_fraction": Option(
                           0.25, "Mix-LN: Post-LN in the first floor(fraction T) blocks",
                           lambda v: None if 0.0 <= v <= 1.0 else "must lie in [0, 1]")}),
    # NVIDIA/ngpt train.py: weight_decay = 0.0 when use_nGPT (the matrices are re-normalised).
    "ngpt": Placement("ngpt", ngpt, final_norm=False, embedding_output="unit", weight_decay=False,
                      options={"ngpt_alpha_init": Option(
                          0.05, "nGPT's eigen learning rate alpha at init", positive)},
                      sublayer_params=_ngpt_params, after_update=init_rules.normalize_ngpt_weights,
                      is_ngpt=True),
    "dyt": Placement("dyt", pre, has_input_norm=_always, stream_norm="dyt",
                     embedding_output="scaled",
                     options={"dyt_alpha_attn": _dyt_alpha(0, "attention-input"),
                              "dyt_alpha_ffn": _dyt_alpha(1, "MLP-input"),
                              "dyt_alpha_final": _dyt_alpha(2, "final")}),
    # Pre-LN with a learnable scalar on each sublayer's output (a scalar LayerScale/ReZero gate
    # that keeps the pre-norm): the example of a placement added in this file alone.
    "scaled_pre": Placement("scaled_pre", _scaled_pre, has_input_norm=_always,
                            options={"scaled_pre_init": Option(
                                1.0, "scaled_pre: the sublayer scale s at init", non_negative)},
                            sublayer_params=_scaled_pre_params),
}
ALIASES = {"sandwich": "peri"}


def all_options():
  """Every placement's config fields (a name may belong to one placement only)."""
  options = {}
  for placement in PLACEMENTS.values():
    for name, option in placement.options.items():
      if name in options:
        raise ValueError(f"config field model.{name} is declared by two placements")
      options[name] = option
  return options


def valid_names():
  return sorted(PLACEMENTS) + sorted(ALIASES)


def get_placement(name):
  """The registry entry for a config string; an unknown name lists the valid ones."""
  resolved = ALIASES.get(name, name)
  if resolved not in PLACEMENTS:
    raise ValueError(f"model.placement={name!r} is unknown; valid: {', '.join(valid_names())}")
  return PLACEMENTS[resolved]

