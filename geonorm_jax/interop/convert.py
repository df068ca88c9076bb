"""Hugging Face GPT-2 and LLaMA checkpoints -> our Pre-LN `Transformer`; our parameters
between the unrolled and the `model.scan_layers` layout (`stack_layers`, `unstack_layers`).

    state_dict = convert.to_numpy(hf_model.state_dict())
    config, model = convert.from_hf_llama(state_dict, hf_model.config)

Each converter first turns the HF config into ours and refuses every HF option our model
does not implement (a silently different architecture is worse than an error). Then every
one of our parameters is filled from exactly one HF tensor, as hf_layout's table says (the
table export.py reads the other way): a missing key, a shape mismatch or a left-over HF
tensor raises, naming the HF key. The model is assembled from the abstract
parameter tree, so no random weights are drawn (or allocated twice) for a large checkpoint.
"""
import collections

import jax.numpy as jnp
import numpy as np
from flax import nnx

from geonorm_jax.interop import hf_layout
from geonorm_jax.interop.hf_layout import path_name
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn.spec import resolve
from geonorm_jax.training import config as config_lib

# GPT-2 activations that are all the tanh approximation of GELU (our MLP's only GELU).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


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


# --- Loading ---------------------------------------------------------------------------------


def _strip_prefix(state_dict, prefix):
  """Accept both *LMHeadModel / *ForCausalLM and bare-model state dicts: {short: full key}."""
  return {(key[len(prefix):] if key.startswith(prefix) else key): key for key in state_dict}


def _load(config, state_dict, architecture):
  """Our model with every parameter taken from `state_dict` as the architecture's table says.

  The table's keys omit the base-model prefix; architecture.ignorable(short_key) names HF
  tensors that are fine to leave unused (buffers, a tied head).
  """
  sources = architecture.sources(resolve(config.model))
  full_keys = _strip_prefix(state_dict, architecture.prefix)
  graphdef, abstract_state = model_lib.abstract_params(config.model)
  loaded, used = [], set()
  for path, variable in nnx.to_flat_state(abstract_state):
    if path not in sources:
      raise ValueError(f"no Hugging Face tensor maps to our parameter {path_name(path)}")
    source = sources[path]
    if source.key not in full_keys:
      raise ValueError(f"Hugging Face key {source.key!r} is missing from the state dict "
                       f"(needed for our {path_name(path)})")
    full_key = full_keys[source.key]
    array = np.asarray(state_dict[full_key])
    expected = source.hf_shape(variable.shape)
    if array.shape != expected:
      raise ValueError(f"Hugging Face key {full_key!r} has shape {array.shape}, but our "
                       f"{path_name(path)} {tuple(variable.shape)} needs {expected}")
    loaded.append((path, variable.replace(jnp.asarray(source.take(array), jnp.float32))))
    used.add(source.key)
  unused = sorted(full_keys[k] for k in full_keys
                  if k not in used and not architecture.ignorable(k))
  if unused:
    raise ValueError(f"Hugging Face tensors with no place in our model: {', '.join(unused)}")
  return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _our_config(architecture, hf_config, **model_fields):
  """The base config, Pre-LN on the architecture's backbone, with the HF config's dimensions
  (architecture.config_fields) and `model_fields` written into config.model."""
  config = config_lib.get_base_config()
  config.model.placement = "pre"
  config.model.backbone = architecture.backbone
  for ours, hf in architecture.config_fields:
    value = getattr(hf_config, hf)
    # An HF None is HF's default, which our 0 means too (hf_layout.Architecture).
    config.model[ours] = type(config.model[ours])(0 if value is None else value)
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
  if c.activation_function not in TANH_GELUS:
    problems.append(f"activation_function={c.activation_function!r} (our GELU is the tanh "
                    f"approximation: {', '.join(TANH_GELUS)})")
  if not getattr(c, "scale_attn_weights", True):
    problems.append("scale_attn_weights=False (we always scale scores by 1/sqrt(head_dim))")
  if getattr(c, "scale_attn_by_inverse_layer_idx", False):
    problems.append("scale_attn_by_inverse_layer_idx=True")
  if getattr(c, "add_cross_attention", False):
    problems.append("add_cross_attention=True")
  _unsupported("GPT-2", problems)
  return _our_config(hf_layout.GPT2, c, norm_kind="layernorm",
                     tie_embeddings=_bool_text(getattr(c, "tie_word_embeddings", True)))


def from_hf_gpt2(state_dict, hf_config):
  """(config, model) from an HF GPT-2 state dict (numpy arrays, see to_numpy) and GPT2Config."""
  config = gpt2_config(hf_config)
  return config, _load(config, state_dict, hf_layout.GPT2)


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
  return _our_config(hf_layout.LLAMA, c, norm_kind="rmsnorm", rope_theta=_llama_rope_theta(c),
                     tie_embeddings=_bool_text(getattr(c, "tie_word_embeddings", False)))


def from_hf_llama(state_dict, hf_config):
  """(config, model) from an HF LLaMA state dict (numpy arrays, see to_numpy) and LlamaConfig."""
  config = llama_config(hf_config)
  return config, _load(config, state_dict, hf_layout.LLAMA)


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
      raise ValueError(f"{path_name(path)} is already stacked along `layers`: the state is in "
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
      raise ValueError(f"blocks.*.{path_name(rest)}: block indices {sorted(layers)} are not "
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
      raise ValueError(f"{path_name(path)} has no leading `layers` axis: the state is not in "
                       "the scan_layers layout")
    axes = tuple(variable.get_metadata()["logical_axes"])[1:]
    value = variable[...]
    for index in range(value.shape[0]):
      out.append((("blocks", index) + path[1:],
                  variable.replace(value[index], logical_axes=axes)))
  return nnx.from_flat_state(out)
