"""Where each parameter of our Pre-LN model sits in a Hugging Face GPT-2 or LLaMA checkpoint.

One table per architecture, read in both directions: convert.py fills our parameters from HF
tensors (`Source.take`), export.py writes HF tensors from our parameters (`assemble`, the
inverse), and the config fields that name the same dimension on both sides are one list
(`Architecture.config_fields`). Keys are those of the base model (`h.0.attn.c_attn.weight`);
`Architecture.full_key` adds the *LMHeadModel / *ForCausalLM prefix.
"""
import collections
import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Source:
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
    """Our parameter from the HF tensor."""
    if self.layout == "transposed":
      return array.T
    if self.layout == "fused":
      width = array.shape[-1] // self.parts
      return array[..., self.part * width:(self.part + 1) * width]
    return array


def path_name(path):
  """("blocks", 0, "attn", "q", "kernel") -> "blocks.0.attn.q.kernel"."""
  return ".".join(str(part) for part in path)


def assemble(sources, arrays):
  """{HF key: tensor} from {our path: array}: the inverse of Source.take over a whole table.

  `arrays` must hold exactly the table's parameters, so no HF tensor is written short (a
  fused one with a part missing) and none of ours is dropped.
  """
  missing = [path_name(path) for path in sources if path not in arrays]
  if missing:
    raise ValueError(f"missing our {', '.join(missing)} (each part of a Hugging Face tensor)")
  by_key = collections.defaultdict(list)
  for path, array in arrays.items():
    if path not in sources:
      raise ValueError(f"our parameter {path_name(path)} has no Hugging Face tensor")
    by_key[sources[path].key].append((sources[path], np.asarray(array)))
  tensors = {}
  for key, parts in by_key.items():
    source = parts[0][0]
    if source.layout == "fused":
      # Slices of equal width along the last axis, part 0 first (the table has each once).
      tensors[key] = np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0].part)],
                                    axis=-1)
    else:
      tensors[key] = parts[0][1].T if source.layout == "transposed" else parts[0][1]
  return tensors


def _gpt2_sources(spec):
  sources = {("embed",): Source("wte.weight"), ("positions",): Source("wpe.weight")}
  for i in range(spec.num_layers):
    hf, ours = f"h.{i}", ("blocks", i)
    for norm_hf, norm_ours in (("ln_1", "attn_in_norm"), ("ln_2", "mlp_in_norm")):
      sources[ours + (norm_ours, "gain")] = Source(f"{hf}.{norm_hf}.weight")
      sources[ours + (norm_ours, "bias")] = Source(f"{hf}.{norm_hf}.bias")
    for part, name in enumerate(("q", "k", "v")):
      for param in ("kernel", "bias"):
        hf_param = "weight" if param == "kernel" else "bias"
        sources[ours + ("attn", name, param)] = Source(
            f"{hf}.attn.c_attn.{hf_param}", "fused", part=part, parts=3)
    # Conv1D already stores (in, out), the layout of our kernels.
    for hf_linear, ours_linear in (("attn.c_proj", ("attn", "o")), ("mlp.c_fc", ("mlp", "up")),
                                   ("mlp.c_proj", ("mlp", "down"))):
      sources[ours + ours_linear + ("kernel",)] = Source(f"{hf}.{hf_linear}.weight")
      sources[ours + ours_linear + ("bias",)] = Source(f"{hf}.{hf_linear}.bias")
  sources[("final_norm", "gain")] = Source("ln_f.weight")
  sources[("final_norm", "bias")] = Source("ln_f.bias")
  if not spec.tie_embeddings:
    sources[("head",)] = Source("lm_head.weight", "transposed")
  return sources


def _llama_sources(spec):
  sources = {("embed",): Source("embed_tokens.weight")}
  for i in range(spec.num_layers):
    hf, ours = f"layers.{i}", ("blocks", i)
    sources[ours + ("attn_in_norm", "gain")] = Source(f"{hf}.input_layernorm.weight")
    sources[ours + ("mlp_in_norm", "gain")] = Source(f"{hf}.post_attention_layernorm.weight")
    for name in ("q", "k", "v", "o"):
      sources[ours + ("attn", name, "kernel")] = Source(
          f"{hf}.self_attn.{name}_proj.weight", "transposed")
    for name in ("gate", "up", "down"):
      sources[ours + ("mlp", name, "kernel")] = Source(
          f"{hf}.mlp.{name}_proj.weight", "transposed")
  sources[("final_norm", "gain")] = Source("norm.weight")
  if not spec.tie_embeddings:
    sources[("head",)] = Source("lm_head.weight", "transposed")
  return sources


def _gpt2_ignorable(short_key):
  # Causal-mask buffers of older transformers versions; the tied head is our `embed`.
  return short_key.endswith((".attn.bias", ".attn.masked_bias")) or short_key == "lm_head.weight"


def _llama_ignorable(short_key):
  # Rotary tables are recomputed; a tied head is our `embed`.
  return short_key.endswith("rotary_emb.inv_freq") or short_key == "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One HF architecture our `pre` model is, on one backbone.

  sources(spec) -> {our parameter path (unrolled layout): Source}; ignorable(key) names HF
  tensors an import may leave unused (buffers, a tied head); config_fields: (our config.model
  field, the HF config field) pairs that hold the same number. An HF None there is HF's
  default, which our 0 means too (n_inner: 4d; num_key_value_heads: num_heads).
  """
  backbone: str  # our model.backbone
  family: str  # for messages: "GPT-2"
  model_type: str  # the HF config's model_type
  model_class: str  # the HF class with the LM head: config.json's `architectures`
  prefix: str  # the base model's prefix inside model_class's state dict
  sources: Callable
  ignorable: Callable
  config_fields: tuple

  def full_key(self, short_key):
    """The key in model_class's state dict: the LM head sits outside the base model."""
    return short_key if short_key.startswith("lm_head.") else self.prefix + short_key


GPT2 = Architecture(
    backbone="gpt2", family="GPT-2", model_type="gpt2", model_class="GPT2LMHeadModel",
    prefix="transformer.", sources=_gpt2_sources, ignorable=_gpt2_ignorable,
    config_fields=(("num_layers", "n_layer"), ("d_model", "n_embd"), ("num_heads", "n_head"),
                   ("d_ff", "n_inner"), ("vocab_size", "vocab_size"),
                   ("max_seq_len", "n_positions"), ("norm_eps", "layer_norm_epsilon")))
LLAMA = Architecture(
    backbone="llama", family="LLaMA", model_type="llama", model_class="LlamaForCausalLM",
    prefix="model.", sources=_llama_sources, ignorable=_llama_ignorable,
    config_fields=(("num_layers", "num_hidden_layers"), ("d_model", "hidden_size"),
                   ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                   ("d_ff", "intermediate_size"), ("vocab_size", "vocab_size"),
                   ("max_seq_len", "max_position_embeddings"), ("norm_eps", "rms_norm_eps")))
ARCHITECTURES = {a.backbone: a for a in (GPT2, LLAMA)}
