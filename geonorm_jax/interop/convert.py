"""Hugging Face GPT-2 and LLaMA checkpoints -> our Pre-LN `Transformer`; our parameters
between the unrolled and the `model.scan_layers` layout (`stack_layers`, `unstack_layers`).

    state_dict = convert.to_numpy(hf_model.state_dict())
    config, model = convert.from_hf_llama(state_dict, hf_model.config)

Each converter first turns the HF config into ours and refuses every HF option our model
does not implement (a silently different architecture is worse than an error). Then every
one of our parameters is filled from exactly one HF tensor: a missing key, a shape mismatch
or a left-over HF tensor raises, naming the HF key. The model is assembled from the abstract
parameter tree, so no random weights are drawn (or allocated twice) for a large checkpoint.
"""
import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn.spec import resolve
from geonorm_jax.training import config as config_lib

# GPT-2 activations that are all the tanh approximation of GELU (our MLP's only GELU).
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def to_numpy(state_dict):
  """{name: torch tensor or array} -> {name: numpy array}; floating tensors become float32.

  float32 because numpy has no bfloat16 and our parameters are float32 anyway.
  """
  arrays = {}
  for name, value in state_dict.items():
    if hasattr(value, "detach"):  # a torch tensor; duck-typed so this module never imports torch
      value = value.detach().cpu()
      if value.is_floating_point():
        value = value.float()
      value = value.numpy()
    arrays[name] = np.asarray(value)
  return arrays


# --- Where each of our parameters comes from -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
  """One HF tensor and how it lays out onto one of our parameters.

  layout: `same`; `transposed` (torch nn.Linear stores (out, in), our kernels are (in, out));
  `fused` (slice `part` of `parts` equal slices along the last axis: GPT-2's c_attn packs
  q, k and v side by side).
  """
  key: str
  layout: str = "same"
  part: int = 0
  parts: int = 1

  def hf_shape(self, our_shape):
    """The shape the HF tensor must have for our parameter to have `our_shape`."""
    our_shape = tuple(our_shape)
    if self.layout == "transposed":
      return our_shape[::-1]
    if self.layout == "fused":
      return our_shape[:-1] + (our_shape[-1] * self.parts,)
    return our_shape

  def take(self, array):
    if self.layout == "transposed":
      return array.T
    if self.layout == "fused":
      width = array.shape[-1] // self.parts
      return array[..., self.part * width:(self.part + 1) * width]
    return array


def _gpt2_sources(spec):
  sources = {("embed",): _Source("wte.weight"), ("positions",): _Source("wpe.weight")}
  for i in range(spec.num_layers):
    hf, ours = f"h.{i}", ("blocks", i)
    for norm_hf, norm_ours in (("ln_1", "attn_in_norm"), ("ln_2", "mlp_in_norm")):
      sources[ours + (norm_ours, "gain")] = _Source(f"{hf}.{norm_hf}.weight")
      sources[ours + (norm_ours, "bias")] = _Source(f"{hf}.{norm_hf}.bias")
    for part, name in enumerate(("q", "k", "v")):
      for param in ("kernel", "bias"):
        hf_param = "weight" if param == "kernel" else "bias"
        sources[ours + ("attn", name, param)] = _Source(
            f"{hf}.attn.c_attn.{hf_param}", "fused", part=part, parts=3)
    # Conv1D already stores (in, out), the layout of our kernels.
    for hf_linear, ours_linear in (("attn.c_proj", ("attn", "o")), ("mlp.c_fc", ("mlp", "up")),
                                   ("mlp.c_proj", ("mlp", "down"))):
      sources[ours + ours_linear + ("kernel",)] = _Source(f"{hf}.{hf_linear}.weight")
      sources[ours + ours_linear + ("bias",)] = _Source(f"{hf}.{hf_linear}.bias")
  sources[("final_norm", "gain")] = _Source("ln_f.weight")
  sources[("final_norm", "bias")] = _Source("ln_f.bias")
  if not spec.tie_embeddings:
    sources[("head",)] = _Source("lm_head.weight", "transposed")
  return sources


def _llama_sources(spec):
  sources = {("embed",): _Source("embed_tokens.weight")}
  for i in range(spec.num_layers):
    hf, ours = f"layers.{i}", ("blocks", i)
    sources[ours + ("attn_in_norm", "gain")] = _Source(f"{hf}.input_layernorm.weight")
    sources[ours + ("mlp_in_norm", "gain")] = _Source(f"{hf}.post_attention_layernorm.weight")
    for name in ("q", "k", "v", "o"):
      sources[ours + ("attn", name, "kernel")] = _Source(
          f"{hf}.self_attn.{name}_proj.weight", "transposed")
    for name in ("gate", "up", "down"):
      sources[ours + ("mlp", name, "kernel")] = _Source(
          f"{hf}.mlp.{name}_proj.weight", "transposed")
  sources[("final_norm", "gain")] = _Source("norm.weight")
  if not spec.tie_embeddings:
    sources[("head",)] = _Source("lm_head.weight", "transposed")
  return sources


# --- Loading ---------------------------------------------------------------------------------


def _strip_prefix(state_dict, prefix):
  """Accept both *LMHeadModel / *ForCausalLM and bare-model state dicts: {short: full key}."""
  return {(key[len(prefix):] if key.startswith(prefix) else key): key for key in state_dict}


def _path_name(path):
  return ".".join(str(part) for part in path)


def _load(config, state_dict, sources, prefix, ignorable):
  """Our model with every parameter taken from `state_dict` as `sources` says.

  Keys in `sources` omit the base-model `prefix`; ignorable(short_key) names HF tensors that
  are fine to leave unused (buffers, a tied head).
  """
  full_keys = _strip_prefix(state_dict, prefix)
  graphdef, abstract_state = model_lib.abstract_params(config.model)
  loaded, used = [], set()
  for path, variable in nnx.to_flat_state(abstract_state):
    if path not in sources:
      raise ValueError(f"no Hugging Face tensor maps to our parameter {_path_name(path)}")
    source = sources[path]
    if source.key not in full_keys:
      raise ValueError(f"Hugging Face key {source.key!r} is missing from the state dict "
                       f"(needed for our {_path_name(path)})")
    full_key = full_keys[source.key]
    array = np.asarray(state_dict[full_key])
    expected = source.hf_shape(variable.shape)
    if array.shape != expected:
      raise ValueError(f"Hugging Face key {full_key!r} has shape {array.shape}, but our "
                       f"{_path_name(path)} {tuple(variable.shape)} needs {expected}")
    loaded.append((path, variable.replace(jnp.asarray(source.take(array), jnp.float32))))
    used.add(source.key)
  unused = sorted(full_keys[k] for k in full_keys if k not in used and not ignorable(k))
  if unused:
    raise ValueError(f"Hugging Face tensors with no place in our model: {', '.join(unused)}")
  return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _our_config(**model_fields):
  """The base config, Pre-LN, with the HF architecture written into config.model."""
  config = config_lib.get_base_config()
  config.model.placement = "pre"
  for name, value in model_fields.items():
    config.model[name] = value
  config.data.seq_len = min(config.data.seq_len, config.model.max_seq_len)
  return config


def _unsupported(family, problems):
  if problems:
    raise ValueError(f"this Hugging Face {family} config uses options our model does not "
                     f"implement: {'; '.join(problems)}")


def _bool_text(flag):
  # tie_embeddings is an "auto | true | false" string field of the config.
  return "true" if flag else "false"


# --- GPT-2 -----------------------------------------------------------------------------------


def gpt2_config(hf_config):
  """Our config for an HF GPT2Config; raises on the options we do not implement."""
  c = hf_config
  problems = []
  if getattr(c, "model_type", "gpt2") != "gpt2":
    problems.append(f"model_type={c.model_type!r} (expected 'gpt2')")
  if c.activation_function not in _TANH_GELUS:
    problems.append(f"activation_function={c.activation_function!r} (our GELU is the tanh "
                    f"approximation: {', '.join(_TANH_GELUS)})")
  if not getattr(c, "scale_attn_weights", True):
    problems.append("scale_attn_weights=False (we always scale scores by 1/sqrt(head_dim))")
  if getattr(c, "scale_attn_by_inverse_layer_idx", False):
    problems.append("scale_attn_by_inverse_layer_idx=True")
  if getattr(c, "add_cross_attention", False):
    problems.append("add_cross_attention=True")
  _unsupported("GPT-2", problems)
  return _our_config(
      backbone="gpt2", num_layers=c.n_layer, d_model=c.n_embd, num_heads=c.n_head,
      d_ff=c.n_inner or 0, vocab_size=c.vocab_size, max_seq_len=c.n_positions,
      norm_kind="layernorm", norm_eps=float(c.layer_norm_epsilon),
      tie_embeddings=_bool_text(getattr(c, "tie_word_embeddings", True)))


def _gpt2_ignorable(short_key):
  # Causal-mask buffers of older transformers versions; the tied head is our `embed`.
  return short_key.endswith((".attn.bias", ".attn.masked_bias")) or short_key == "lm_head.weight"


def from_hf_gpt2(state_dict, hf_config):
  """(config, model) from an HF GPT-2 state dict (numpy arrays, see to_numpy) and GPT2Config."""
  config = gpt2_config(hf_config)
  sources = _gpt2_sources(resolve(config.model))
  return config, _load(config, state_dict, sources, "transformer.", _gpt2_ignorable)


# --- LLaMA -----------------------------------------------------------------------------------


def _llama_rope_theta(hf_config):
  """rope_theta from transformers 5's rope_parameters or 4's rope_theta; no scaling allowed."""
  rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
  rope = dict(rope or {})
  rope_type = rope.pop("rope_type", rope.pop("type", "default"))
  theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", None))
  if rope_type != "default" or rope:
    raise ValueError(f"this Hugging Face LLaMA config uses RoPE scaling (rope_type={rope_type!r}"
                     f"{', ' + str(rope) if rope else ''}); our model implements plain RoPE only")
  if theta is None:
    raise ValueError("the Hugging Face LLaMA config has no rope_theta")
  return float(theta)


def llama_config(hf_config):
  """Our config for an HF LlamaConfig; raises on the options we do not implement."""
  c = hf_config
  problems = []
  if getattr(c, "model_type", "llama") != "llama":
    problems.append(f"model_type={c.model_type!r} (expected 'llama')")
  if c.hidden_act != "silu":
    problems.append(f"hidden_act={c.hidden_act!r} (our gated MLP is SwiGLU: 'silu')")
  if getattr(c, "attention_bias", False):
    problems.append("attention_bias=True")
  if getattr(c, "mlp_bias", False):
    problems.append("mlp_bias=True")
  head_dim = getattr(c, "head_dim", None)
  if head_dim and head_dim * c.num_attention_heads != c.hidden_size:
    problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads")
  _unsupported("LLaMA", problems)
  return _our_config(
      backbone="llama", num_layers=c.num_hidden_layers, d_model=c.hidden_size,
      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or 0,
      d_ff=c.intermediate_size, vocab_size=c.vocab_size, max_seq_len=c.max_position_embeddings,
      norm_kind="rmsnorm", norm_eps=float(c.rms_norm_eps), rope_theta=_llama_rope_theta(c),
      tie_embeddings=_bool_text(getattr(c, "tie_word_embeddings", False)))


def _llama_ignorable(short_key):
  # Rotary tables are recomputed; a tied head is our `embed`.
  return short_key.endswith("rotary_emb.inv_freq") or short_key == "lm_head.weight"


def from_hf_llama(state_dict, hf_config):
  """(config, model) from an HF LLaMA state dict (numpy arrays, see to_numpy) and LlamaConfig."""
  config = llama_config(hf_config)
  sources = _llama_sources(resolve(config.model))
  return config, _load(config, state_dict, sources, "model.", _llama_ignorable)


# --- Our two layouts (model.scan_layers) -----------------------------------------------------


def _is_stacked(variable):
  return tuple(variable.get_metadata().get("logical_axes") or ())[:1] == ("layers",)


def stack_layers(state):
  """The unrolled layout (`blocks.<i>.attn.q.kernel`) -> the scan_layers one
  (`blocks.attn.q.kernel`, block i at index i of a leading `layers` axis).

  Takes any nnx.State laid out like the parameters (Adam's moments too), inside jit or not;
  `nnx.merge(graphdef_of_a_scan_layers_model, stack_layers(params))` is the same model.
  """
  per_name, others = collections.defaultdict(dict), []
  for path, variable in nnx.to_flat_state(state):
    if path[0] != "blocks":
      others.append((path, variable))
    elif _is_stacked(variable):
      raise ValueError(f"{_path_name(path)} is already stacked along `layers`: the state is in "
                       "the scan_layers layout")
    else:
      per_name[path[2:]][int(path[1])] = variable
  counts = {len(layers) for layers in per_name.values()}
  if len(counts) > 1:
    raise ValueError("the blocks hold different parameters, so they cannot be stacked (is this "
                     "a Mix-LN model? its blocks differ)")
  stacked = []
  for rest, layers in per_name.items():
    if sorted(layers) != list(range(len(layers))):
      raise ValueError(f"blocks.*.{_path_name(rest)}: block indices {sorted(layers)} are not "
                       "0..T-1")
    first = layers[0]
    axes = tuple(first.get_metadata().get("logical_axes") or ())
    value = jnp.stack([layers[i][...] for i in range(len(layers))])
    stacked.append((("blocks",) + rest, first.replace(value, logical_axes=("layers",) + axes)))
  return nnx.from_flat_state(others + stacked)


def unstack_layers(state):
  """The scan_layers layout -> the unrolled one: the inverse of stack_layers."""
  out = []
  for path, variable in nnx.to_flat_state(state):
    if path[0] != "blocks":
      out.append((path, variable))
      continue
    if not _is_stacked(variable):
      raise ValueError(f"{_path_name(path)} has no leading `layers` axis: the state is not in "
                       "the scan_layers layout")
    axes = tuple(variable.get_metadata()["logical_axes"])[1:]
    value = variable[...]
    for index in range(value.shape[0]):
      out.append((("blocks", index) + path[1:],
                  variable.replace(value[index], logical_axes=axes)))
  return nnx.from_flat_state(out)
