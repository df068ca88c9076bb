"""ModelSpec: config.model with every `auto` resolved and every field checked, before any JAX op.

The model reads only a ModelSpec, so one validation covers every entry point (train, eval,
sample, hessian, conversion from Hugging Face).
"""
import dataclasses
import math

from geonorm_jax.nn import placements

BACKBONES = ("gpt2", "llama")
NORM_KINDS = ("layernorm", "rmsnorm")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "dense", "blocked", "cudnn")
QK_NORM_SCOPES = ("head", "full")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  backbone: str
  # The resolved registry entry (placements.Placement): the model reads its wiring from here,
  # spec.placement.name is the config's string (aliases resolved).
  placement: placements.Placement
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
  attention: str
  scan_layers: bool
  # Every placement's own fields (placements.Option), resolved: ((name, value), ...).
  options: tuple = ()
  # Sequence slices the head + cross-entropy run in (losses.chunked_loss_terms).
  loss_chunks: int = 1
  # With qk_norm: head (RMSNorm over each head's head_dim) | full (over the whole projected
  # width of q and of k, before the split into heads).
  qk_norm_scope: str = "head"
  # PaLM's z-loss coefficient: the training objective adds z_loss * mean(log(Z)^2) (losses.py).
  z_loss: float = 0.0

  def option(self, name):
    """A placement field's resolved value, e.g. spec.option("geo_alpha")."""
    for key, value in self.options:
      if key == name:
        return value
    raise KeyError(f"model.{name} is not a field of any placement")

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


def llama_ffn_width(d_model, multiple_of):
  """LLaMA's SwiGLU hidden width: 2/3 of 4d, rounded up to a multiple (4096 -> 11008)."""
  hidden = int(2 * 4 * d_model / 3)
  return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def resolve(model_config):
  """Check config.model and return the ModelSpec; every error names the offending field."""
  c = model_config
  backbone = _choice("backbone", c.backbone, BACKBONES)
  placement = placements.get_placement(c.placement)
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
  _choice("dtype", c.dtype, DTYPES)
  _choice("attention", c.attention, ATTENTION_IMPLS)
  _choice("qk_norm_scope", c.qk_norm_scope, QK_NORM_SCOPES)
  if not (math.isfinite(c.z_loss) and c.z_loss >= 0):  # NaN and inf too
    raise ValueError(f"model.z_loss={c.z_loss} must be a finite number >= 0 (0 = off)")
  options = []
  for name, option in placements.all_options().items():
    problem = option.check(c[name])
    if problem:
      raise ValueError(f"model.{name}={c[name]!r} {problem}")
    options.append((name, option.resolve(c[name], c)))
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
  spec = ModelSpec(
      backbone=backbone, placement=placement,
      num_layers=c.num_layers, d_model=c.d_model, num_heads=c.num_heads, num_kv_heads=kv_heads,
      d_ff=d_ff, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len, norm_kind=norm_kind,
      norm_eps=float(c.norm_eps), norm_gain=bool(c.norm_gain),
      norm_bias=_auto_bool("norm_bias", c.norm_bias, norm_kind == "layernorm" and backbone == "gpt2"),
      tie_embeddings=_auto_bool("tie_embeddings", c.tie_embeddings, backbone == "gpt2"),
      rope_theta=float(c.rope_theta), qk_norm=bool(c.qk_norm), dt=float(c.dt),
      embed_norm=bool(c.embed_norm), init_std=float(c.init_std), dtype=c.dtype,
      remat=bool(c.remat), scan_layers=bool(c.scan_layers),
      attention=c.attention, options=tuple(options),
      loss_chunks=_positive("loss_chunks", int(c.loss_chunks)),
      qk_norm_scope=c.qk_norm_scope, z_loss=float(c.z_loss))
  if spec.scan_layers:
    _check_uniform_blocks(spec)
  return spec


def _check_uniform_blocks(spec):
  """A scan runs one block definition T times: every block must have the same norms."""
  placement = spec.placement
  def structure(layer):
    return (placement.has_input_norm(layer, spec), placement.has_output_norm(layer, spec))
  kinds = [structure(layer) for layer in range(1, spec.num_layers + 1)]
  if len(set(kinds)) > 1:
    first_change = next(l for l in range(2, spec.num_layers + 1) if kinds[l - 1] != kinds[0])
    raise ValueError(
        f"model.scan_layers=true needs every block to have the same norms, but "
        f"model.placement={spec.placement.name} gives blocks 1-{first_change - 1} other norms than "
        f"block {first_change} (e.g. Mix-LN's Post-LN blocks); set model.scan_layers=false")
