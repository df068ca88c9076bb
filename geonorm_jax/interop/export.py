"""Our Pre-LN checkpoints -> Hugging Face `transformers` folders: config.json + model.safetensors.

    python -m geonorm_jax export --workdir=RUN [--step=S] --out=DIR
    model = transformers.AutoModelForCausalLM.from_pretrained(DIR)

The inverse of convert.py, on the same table (hf_layout.py): `pre` on the gpt2 backbone is
GPT2LMHeadModel, `pre` on llama is LlamaForCausalLM (grouped-query attention included).
`check` refuses every other placement and every model option the HF class cannot express,
in one line naming the fields, before the checkpoint is read. The folder is written next to
DIR and renamed into place, so a failure leaves no half-written DIR; a non-empty DIR is
refused. The safetensors file is written with numpy alone, so the core install needs neither
torch nor the safetensors package.
"""
import dataclasses
import functools
import json
import os
import secrets
import shutil
import struct

import jax
import numpy as np
from flax import nnx

from geonorm_jax.data import sources as data_sources
from geonorm_jax.interop import convert, hf_layout
from geonorm_jax.interop.hf_layout import path_name
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import placements
from geonorm_jax.nn.spec import resolve
from geonorm_jax.training import train

CONFIG_FILENAME = "config.json"
WEIGHTS_FILENAME = "model.safetensors"
_PRE_LN = "x' = x + F(N(x))"


# --- What Hugging Face can express -----------------------------------------------------------


def _placement_problem(placement):
  if placement.name == "pre":
    return None
  if placement.update is not placements.pre:
    doc = (placement.update.__doc__ or "").strip().splitlines()
    how = f"its update is {doc[0].rstrip('.')}" if doc else "its update is not Pre-LN's"
  elif placement.stream_norm != "norm":
    how = f"its stream norm is {placement.stream_norm}, not LayerNorm or RMSNorm"
  else:
    how = "its wiring is not Pre-LN's"
  return (f"model.placement={placement.name!r}: {how}, while GPT2LMHeadModel and "
          f"LlamaForCausalLM are Pre-LN, {_PRE_LN} (only placement=pre exports)")


@functools.lru_cache(maxsize=16)  # save() checks through each of its steps; specs hash
def problems(spec):
  """What keeps `spec` from being its backbone's HF class: one text per field, naming it."""
  architecture = hf_layout.ARCHITECTURES[spec.backbone]
  hf_class, family = architecture.model_class, architecture.family
  found = [_placement_problem(spec.placement)]
  if spec.backbone == "gpt2":
    found += [
        spec.norm_kind != "layernorm" and f"model.norm_kind={spec.norm_kind}: {family}'s norms "
        "are LayerNorm",
        not spec.norm_bias and f"model.norm_bias=false: {family}'s LayerNorm has a bias",
        spec.num_kv_heads != spec.num_heads and f"model.num_kv_heads={spec.num_kv_heads}: "
        f"{family}'s attention has as many key/value heads as query heads "
        f"(model.num_heads={spec.num_heads})",
    ]
  else:
    found += [
        spec.norm_kind != "rmsnorm" and f"model.norm_kind={spec.norm_kind}: {family}'s norms "
        "are RMSNorm",
        spec.norm_bias and f"model.norm_bias=true: {family}'s RMSNorm has no bias",
    ]
  found += [
      not spec.norm_gain and f"model.norm_gain=false: {hf_class}'s norms always have a gain",
      spec.qk_norm and f"model.qk_norm=true: {hf_class} has no norm on queries and keys",
      spec.dt != 1.0 and f"model.dt={spec.dt:g}: {hf_class} adds each sublayer's output with "
      "step 1",
      spec.embed_norm and f"model.embed_norm=true: {hf_class} has no norm after the embedding",
  ]
  found = tuple(problem for problem in found if problem)
  if not found:
    # The safety net for an option not named above: every parameter needs its HF tensor.
    _, abstract = model_lib.abstract_params(dataclasses.replace(spec, scan_layers=False))
    sources = architecture.sources(spec)
    found = tuple(f"our parameter {path_name(path)} has no place in {hf_class}"
                  for path, _ in nnx.to_flat_state(abstract) if path not in sources)
  return found


def check(spec):
  """spec's HF Architecture; a ValueError (one line, every problem) if it has none."""
  found = problems(spec)
  if found:
    raise ValueError(f"cannot export to Hugging Face: {'; '.join(found)}")
  return hf_layout.ARCHITECTURES[spec.backbone]


# --- The folder's contents -------------------------------------------------------------------


def hf_config(spec, data_config):
  """config.json's contents: the dimensions from the shared field table, and every HF switch
  set to what our model computes (no dropout: ours has none)."""
  architecture = check(spec)
  # The run's tokenizer decides the special tokens: GPT-2 BPE has <|endoftext|>, the byte
  # tokenizer none (HF's defaults, 50256 and LLaMA's 1/2, would be wrong ids for bytes).
  end_of_text = data_sources.GPT2_END_OF_TEXT if data_config.tokenizer == "gpt2" else None
  fields = {
      "architectures": [architecture.model_class], "model_type": architecture.model_type,
      **{hf: getattr(spec, ours) for ours, hf in architecture.config_fields},
      "tie_word_embeddings": spec.tie_embeddings, "initializer_range": spec.init_std,
      "bos_token_id": end_of_text, "eos_token_id": end_of_text, "use_cache": True,
      "dtype": "float32",  # our parameters are float32 whatever model.dtype computed in
  }
  if spec.backbone == "gpt2":
    fields.update(activation_function=convert.TANH_GELUS[0], resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, add_cross_attention=False)
  else:
    # rope_parameters is how transformers 5 reads theta, rope_theta how 4 does.
    fields.update(head_dim=spec.head_dim, hidden_act="silu", attention_bias=False,
                  mlp_bias=False, attention_dropout=0.0, pretraining_tp=1,
                  rope_theta=spec.rope_theta,
                  rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
  return fields


def hf_tensors(spec, params):
  """{HF state-dict key: float32 numpy array} from our parameters (either layout)."""
  architecture = check(spec)
  if spec.scan_layers:
    params = convert.unstack_layers(params)
  arrays = {path: np.asarray(jax.device_get(variable[...]), np.float32)
            for path, variable in nnx.to_flat_state(params)}
  tensors = hf_layout.assemble(architecture.sources(spec), arrays)
  return {architecture.full_key(key): tensor for key, tensor in tensors.items()}


_SAFETENSORS_DTYPES = {np.dtype(np.float32): ("F32", "<f4")}


def write_safetensors(path, tensors, metadata=None):
  """The safetensors format: an 8-byte little-endian header length, a JSON header naming each
  tensor's dtype, shape and byte range, then the raw little-endian buffers back to back."""
  header, offset = {}, 0
  names = sorted(tensors)
  for name in names:
    array = tensors[name]
    if array.dtype not in _SAFETENSORS_DTYPES:
      raise ValueError(f"tensor {name!r} is {array.dtype}; only float32 is written")
    header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype][0], "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
  if metadata:
    header["__metadata__"] = metadata
  text = json.dumps(header, separators=(",", ":")).encode("utf-8")
  text += b" " * (-len(text) % 8)  # buffers start 8-byte aligned, as the safetensors library has it
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name in names:
      np.ascontiguousarray(tensors[name], _SAFETENSORS_DTYPES[tensors[name].dtype][1]).tofile(f)


# --- The command -----------------------------------------------------------------------------


def _check_out(out):
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out={out} is a file; export writes a new (or empty) folder")
  if os.path.isdir(out) and os.listdir(out):
    raise ValueError(f"--out={out} is not empty; export writes a new (or empty) folder and "
                     "never overwrites one")


def save(out, config, params):
  """Write the model of `config` with `params` (an nnx.State, either layout) to the folder
  `out`. Both files go into a hidden folder beside `out`, renamed onto it at the end: `out`
  never holds a partial export, and the rename fails rather than replace a folder that
  filled up meanwhile."""
  spec = resolve(config.model)
  check(spec)
  _check_out(out)
  out = os.path.abspath(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  partial = os.path.join(parent, f".{os.path.basename(out)}.partial-{secrets.token_hex(4)}")
  os.mkdir(partial)
  try:
    write_safetensors(os.path.join(partial, WEIGHTS_FILENAME), hf_tensors(spec, params),
                      metadata={"format": "pt"})  # transformers refuses files without it
    with open(os.path.join(partial, CONFIG_FILENAME), "w") as f:
      json.dump(hf_config(spec, config.data), f, indent=2, sort_keys=True)
      f.write("\n")
    os.rename(partial, out)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def export(workdir, out, step=None):
  """Write checkpoint `step` (None: the latest) of the run in `workdir` to `out` as a
  transformers folder; returns a summary. Every refusal comes before the checkpoint is read."""
  config = train.config_from_workdir(workdir)
  architecture = check(resolve(config.model))
  _check_out(out)
  config, _, state = train.restore_params(workdir, step, config)
  save(out, config, state["params"])
  return {"step": int(state["step"]), "out": out, "architecture": architecture.model_class,
          "parameters": model_lib.count_params(state["params"])}
