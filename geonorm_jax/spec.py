"""ModelSpec: config.model with every `auto` resolved and every field checked, before any JAX op.

The model reads only a ModelSpec, so one validation covers every entry point (train, eval,
sample, hessian, conversion from Hugging Face).
"""
import dataclasses

from geonorm_jax import norms, placements

BACKBONES = ("gpt2", "llama")
NORM_KINDS = ("layernorm", "rmsnorm")
DTYPES = ("float32", "bfloat16", "float16")
GEO_COUNTERS = ("blocks", "sublayers")
GEO_INPUTS = ("norm", "raw")
GEO_RADII = ("sqrt_d", "embedding")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  backbone: str
  placement: str
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  d_ff: int
  vocab_size: int
  max_seq_len: int
  norm_kind: str
  norm_eps: float
  norm_gain: bool
  norm_bias: bool
  tie_embeddings: bool
  rope_theta: float
  qk_norm: bool
  dt: float
  embed_norm: bool
  init_std: float
  dtype: str
  remat: bool
  geo_alpha: float
  geo_schedule: str
  geo_counter: str
  geo_theta_max: float
  geo_sublayer_input: str
  geo_radius: str
  mixln_fraction: float
  ngpt_alpha_init: float
  dyt_alpha_attn: float
  dyt_alpha_ffn: float
  dyt_alpha_final: float

  @property
  def head_dim(self):
    return self.d_model // self.num_heads

  @property
  def uses_rope(self):
    return self.backbone == "llama"

  @property
  def gated_mlp(self):
    return self.backbone == "llama"

  @property
  def has_bias(self):
    """Linear-layer biases: GPT-2 has them, LLaMA does not."""
    return self.backbone == "gpt2"


def _choice(field, value, valid):
  if value not in valid:
    raise ValueError(f"model.{field}={value!r} is unknown; valid: {', '.join(valid)}")
  return value


def _auto_bool(field, value, auto_value):
  if value == "auto":
    return auto_value
  if isinstance(value, bool):
    return value
  if str(value).lower() in ("true", "false"):
    return str(value).lower() == "true"
  raise ValueError(f"model.{field}={value!r}; valid: auto, true, false")


def _positive(field, value):
  if value <= 0:
    raise ValueError(f"model.{field}={value} must be positive")
  return value


# DyT's alpha at init for (attention-input, MLP-input, final) DyT by model width, from the
# authors' LLaMA commands (jiachenzhu/DyT, other_tasks/LLaMA/README.md: 7B d=4096 0.8/0.2/0.2,
# 13B d=5120 0.6/0.15/0.15, 34B and 70B d=8192 0.2/0.05/0.05). Narrower models: no published
# value (open); they take the 7B row.
DYT_ALPHA_BY_WIDTH = ((4096, (0.8, 0.2, 0.2)), (5120, (0.6, 0.15, 0.15)),
                      (float("inf"), (0.2, 0.05, 0.05)))


def dyt_alphas(c):
  """(attention, ffn, final) alpha_0: the config's where set (> 0), else the authors' table."""
  table = next(row for width, row in DYT_ALPHA_BY_WIDTH if c.d_model <= width)
  fields = ("dyt_alpha_attn", "dyt_alpha_ffn", "dyt_alpha_final")
  values = []
  for field, default in zip(fields, table):
    value = getattr(c, field)
    if value < 0:
      raise ValueError(f"model.{field}={value} must be positive (or 0 for the authors' value)")
    values.append(float(value) or default)
  return tuple(values)


def llama_ffn_width(d_model, multiple_of):
  """LLaMA's SwiGLU hidden width: 2/3 of 4d, rounded up to a multiple (4096 -> 11008)."""
  hidden = int(2 * 4 * d_model / 3)
  return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def resolve(model_config):
  """Check config.model and return the ModelSpec; every error names the offending field."""
  c = model_config
  backbone = _choice("backbone", c.backbone, BACKBONES)
  placements.get_placement(c.placement)
  for field in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len"):
    _positive(field, getattr(c, field))
  for field in ("norm_eps", "init_std", "dt"):
    _positive(field, getattr(c, field))
  if c.num_kv_heads < 0 or c.d_ff < 0:
    field = "num_kv_heads" if c.num_kv_heads < 0 else "d_ff"
    raise ValueError(f"model.{field}={getattr(c, field)} must be positive (or 0 for the default)")
  if c.d_model % c.num_heads:
    raise ValueError(f"model.d_model={c.d_model} is not divisible by model.num_heads={c.num_heads}")
  kv_heads = c.num_kv_heads or c.num_heads
  if c.num_heads % kv_heads:
    raise ValueError(f"model.num_kv_heads={kv_heads} does not divide model.num_heads={c.num_heads}")
  if backbone == "llama" and (c.d_model // c.num_heads) % 2:
    raise ValueError(f"RoPE needs an even head dimension; model.d_model/model.num_heads="
                     f"{c.d_model // c.num_heads}")
  _choice("geo_schedule", c.geo_schedule, norms.SCHEDULES)
  _choice("geo_counter", c.geo_counter, GEO_COUNTERS)
  _choice("geo_sublayer_input", c.geo_sublayer_input, GEO_INPUTS)
  _choice("geo_radius", c.geo_radius, GEO_RADII)
  _choice("dtype", c.dtype, DTYPES)
  if not 0.0 <= c.mixln_fraction <= 1.0:
    raise ValueError(f"model.mixln_fraction={c.mixln_fraction} must lie in [0, 1]")
  if c.geo_theta_max < 0:
    raise ValueError(f"model.geo_theta_max={c.geo_theta_max} must be >= 0 (0 = no clamp)")
  norm_kind = c.norm_kind
  if norm_kind == "auto":
    norm_kind = "layernorm" if backbone == "gpt2" else "rmsnorm"
  _choice("norm_kind", norm_kind, NORM_KINDS + ("auto",))
  if c.d_ff:
    d_ff = c.d_ff
  elif backbone == "gpt2":
    d_ff = 4 * c.d_model
  else:
    d_ff = llama_ffn_width(c.d_model, _positive("ffn_multiple_of", c.ffn_multiple_of))
  return ModelSpec(
      backbone=backbone, placement=placements.ALIASES.get(c.placement, c.placement),
      num_layers=c.num_layers, d_model=c.d_model, num_heads=c.num_heads, num_kv_heads=kv_heads,
      d_ff=d_ff, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len, norm_kind=norm_kind,
      norm_eps=float(c.norm_eps), norm_gain=bool(c.norm_gain),
      norm_bias=_auto_bool("norm_bias", c.norm_bias, norm_kind == "layernorm" and backbone == "gpt2"),
      tie_embeddings=_auto_bool("tie_embeddings", c.tie_embeddings, backbone == "gpt2"),
      rope_theta=float(c.rope_theta), qk_norm=bool(c.qk_norm), dt=float(c.dt),
      embed_norm=bool(c.embed_norm), init_std=float(c.init_std), dtype=c.dtype,
      remat=bool(c.remat), geo_alpha=float(c.geo_alpha), geo_schedule=c.geo_schedule,
      geo_counter=c.geo_counter, geo_theta_max=float(c.geo_theta_max),
      geo_sublayer_input=c.geo_sublayer_input, geo_radius=c.geo_radius,
      mixln_fraction=float(c.mixln_fraction),
      ngpt_alpha_init=float(c.ngpt_alpha_init),
      **dict(zip(("dyt_alpha_attn", "dyt_alpha_ffn", "dyt_alpha_final"), dyt_alphas(c))))
