"""`export`: our Pre-LN checkpoints as Hugging Face folders that `transformers` loads.

Two tiny runs are trained a few steps (at a high learning rate, so that gains are not 1 and
biases not 0: a swapped gain and bias or a transposed square matrix would show), one per
backbone: GPT-2 with a tied head, LLaMA with grouped-query attention, an untied head, a
non-default RoPE theta, RMSNorm eps and SwiGLU width, in the scan_layers layout. Each is
exported through the command's code path, loaded with `from_pretrained`, and compared with
our model: logits to 1e-5 in float32, and every parameter bitwise after importing the folder
back with convert.py. The other head/GQA cases run on perturbed untrained models.
"""
import dataclasses
import json
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.interop import convert, export, hf_layout
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn.spec import resolve
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5  # max abs logit difference, float32 on both sides
SHAPE = "num_layers=2,d_model=32,seq_len=16,max_seq_len=16,batch_size=8"
TRAIN = ("steps=4,lr=3e-2,warmup_steps=1,train.log_every=1,train.eval_every=4,"
         "train.eval_batches=1,train.progress_bar=false,train.layer_stats_every=0,"
         "checkpoint.every=4")
RUNS = {
    "gpt2_tied": f"tiny,{SHAPE},num_heads=2,norm_eps=1e-3",
    "llama_gqa_untied_scan": (f"tiny_llama,{SHAPE},num_heads=4,num_kv_heads=2,d_ff=40,"
                              "rope_theta=500.0,norm_eps=1e-4,scan_layers=true"),
}


def _hf():
  import torch  # pylint: disable=g-import-not-at-top  (test extras; only the slow tests)
  import transformers  # pylint: disable=g-import-not-at-top
  return torch, transformers


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{name: workdir} of the two trained runs."""
  root = tmp_path_factory.mktemp("export_runs")
  workdirs = {}
  for name, arg in RUNS.items():
    workdirs[name] = str(root / name)
    summary = train.train(config_lib.get_config(f"{arg},{TRAIN}"), workdirs[name])
    assert summary["final_step"] == 4
  return workdirs


def _flat(params):
  """{dotted name: numpy array} of an nnx.State in the unrolled layout."""
  return {".".join(map(str, path)): np.asarray(variable[...])
          for path, variable in nnx.to_flat_state(params)}


def _load_hf(out):
  torch, transformers = _hf()
  hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(out,
                                                                     output_loading_info=True)
  # transformers fills a missing tensor with random numbers and only warns: none may be.
  assert not any(info.values()), info
  assert hf_model.dtype == torch.float32
  return hf_model.eval()


def _max_logit_difference(hf_model, our_model, vocab_size, length=16):
  torch, _ = _hf()
  tokens = np.random.default_rng(0).integers(0, vocab_size, (2, length))
  with torch.no_grad():
    hf_logits = hf_model(torch.from_numpy(tokens)).logits.numpy()
  our_logits = np.asarray(our_model(jnp.asarray(tokens, jnp.int32)))
  assert our_logits.dtype == hf_logits.dtype == np.float32
  assert our_logits.shape == hf_logits.shape
  return float(np.max(np.abs(our_logits - hf_logits)))


@pytest.mark.slow  # loads torch and transformers
@pytest.mark.parametrize("name", sorted(RUNS))
def test_trained_run_exports_to_transformers_with_the_same_logits(runs, tmp_path, name):
  out = tmp_path / "hf"
  out.mkdir()  # an existing empty folder is fine
  summary = export.export(runs[name], str(out))
  config, model = train.load_model(runs[name])
  spec = resolve(config.model)
  assert summary["step"] == 4 and summary["parameters"] == model_lib.count_params(
      nnx.state(model, nnx.Param))
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no partial folder left
  hf_model = _load_hf(str(out))
  expected_class = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[spec.backbone]
  assert type(hf_model).__name__ == summary["architecture"] == expected_class
  if spec.backbone == "llama":
    c = hf_model.config
    assert (c.num_key_value_heads, c.intermediate_size, c.rope_parameters["rope_theta"],
            c.rms_norm_eps, c.tie_word_embeddings) == (2, 40, 500.0, 1e-4, False)
  assert _max_logit_difference(hf_model, model, spec.vocab_size) < TOLERANCE


@pytest.mark.slow  # loads torch and transformers
@pytest.mark.parametrize("name", sorted(RUNS))
def test_export_then_import_round_trips_every_parameter_bitwise(runs, tmp_path, name):
  import safetensors.numpy  # pylint: disable=g-import-not-at-top  (transformers' dependency)
  out = str(tmp_path / "hf")
  export.export(runs[name], out)
  config, _, state = train.restore_params(runs[name])
  ours = state["params"]
  spec = resolve(config.model)
  if spec.scan_layers:
    ours = convert.unstack_layers(ours)
  # The file as the safetensors library reads it is what we meant to write, bit for bit.
  written = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
  expected = export.hf_tensors(spec, state["params"])
  assert written.keys() == expected.keys()
  for key, tensor in expected.items():
    assert written[key].dtype == np.float32
    np.testing.assert_array_equal(written[key], tensor, err_msg=key)
  # ... and importing transformers' model of it gives back every parameter exactly.
  hf_model = _load_hf(out)
  from_hf = convert.from_hf_llama if spec.backbone == "llama" else convert.from_hf_gpt2
  imported_config, imported = from_hf(convert.to_numpy(hf_model.state_dict()), hf_model.config)
  imported_spec = resolve(imported_config.model)
  for field in ("backbone", "num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff",
                "vocab_size", "max_seq_len", "norm_kind", "norm_eps", "norm_bias",
                "tie_embeddings", "rope_theta"):
    assert getattr(imported_spec, field) == getattr(spec, field), field
  before, after = _flat(ours), _flat(nnx.state(imported, nnx.Param))
  assert before.keys() == after.keys()
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=key)


def _perturbed(arg, seed=0):
  """(config, model, params) of an untrained model with every parameter nudged by noise."""
  config = config_lib.get_config(arg)
  model = model_lib.build(config.model, seed=seed)
  params = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  params = jax.tree.unflatten(treedef, [leaf + 0.05 * jax.random.normal(key, leaf.shape)
                                        for leaf, key in zip(leaves, keys)])
  nnx.update(model, params)
  return config, model, params


@pytest.mark.slow  # loads torch and transformers
@pytest.mark.parametrize("arg", [
    f"tiny,{SHAPE},num_heads=2,tie_embeddings=false,data.tokenizer=gpt2,vocab_size=50304",
    f"tiny_llama,{SHAPE},num_heads=4,tie_embeddings=true",
    f"tiny_llama,{SHAPE},num_heads=4,num_kv_heads=1,d_ff=24",  # multi-query attention
], ids=["gpt2_untied", "llama_tied", "llama_mqa"])
def test_other_heads_and_kv_head_counts_match_too(tmp_path, arg):
  config, model, params = _perturbed(arg)
  out = str(tmp_path / "hf")
  export.save(out, config, params)
  hf_model = _load_hf(out)
  spec = resolve(config.model)
  assert hf_model.config.tie_word_embeddings == spec.tie_embeddings
  # The run's tokenizer decides the special tokens: GPT-2's <|endoftext|>, or none for bytes.
  eot = 50256 if config.data.tokenizer == "gpt2" else None
  assert hf_model.config.eos_token_id == hf_model.config.bos_token_id == eot
  assert _max_logit_difference(hf_model, model, spec.vocab_size) < TOLERANCE


@pytest.mark.parametrize("name", sorted(RUNS))
def test_assemble_is_the_inverse_of_take_for_every_parameter(name):
  spec = resolve(config_lib.get_config(RUNS[name].replace("scan_layers=true", "")).model)
  sources = hf_layout.ARCHITECTURES[spec.backbone].sources(spec)
  rng = np.random.default_rng(0)
  _, abstract = model_lib.abstract_params(spec)
  arrays = {path: rng.standard_normal(variable.shape).astype(np.float32)
            for path, variable in nnx.to_flat_state(abstract)}
  tensors = hf_layout.assemble(sources, arrays)
  assert {source.key for source in sources.values()} == tensors.keys()
  for path, array in arrays.items():
    source = sources[path]
    assert tensors[source.key].shape == source.hf_shape(array.shape)
    np.testing.assert_array_equal(source.take(tensors[source.key]), array)
  del arrays[("blocks", 1, "attn", "k", "kernel")]
  with pytest.raises(ValueError, match=r"missing our blocks\.1\.attn\.k\.kernel"):
    hf_layout.assemble(sources, arrays)


def test_safetensors_layout_read_back_by_hand(tmp_path):
  """The format, parsed here from its definition: u64 header length, JSON, buffers."""
  tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3),
             "a": np.asarray([[1.5], [-2.0]], np.float32).T,  # not contiguous: written as laid out
             "c": np.zeros((0, 4), np.float32)}
  path = tmp_path / "t.safetensors"
  export.write_safetensors(str(path), tensors, metadata={"format": "pt"})
  data = path.read_bytes()
  (length,) = struct.unpack("<Q", data[:8])
  assert (8 + length) % 8 == 0  # the buffers start aligned
  header = json.loads(data[8:8 + length])
  assert header.pop("__metadata__") == {"format": "pt"}
  body = data[8 + length:]
  ends = []
  for name, tensor in tensors.items():
    entry = header[name]
    start, end = entry["data_offsets"]
    assert entry["dtype"] == "F32" and entry["shape"] == list(tensor.shape)
    got = np.frombuffer(body[start:end], "<f4").reshape(tensor.shape)
    np.testing.assert_array_equal(got, tensor)
    ends.append((start, end))
  # Back to back, covering the whole body: what the safetensors library checks on load.
  ends.sort()
  assert ends[0][0] == 0 and ends[-1][1] == len(body)
  assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
  with pytest.raises(ValueError, match="'i'.*int32"):
    export.write_safetensors(str(tmp_path / "u.safetensors"), {"i": np.zeros(2, np.int32)})


@pytest.mark.parametrize("arg, field", [
    ("placement=post", "model.placement='post'"),
    ("placement=geonorm", "model.placement='geonorm'"),
    ("placement=dyt", "model.placement='dyt'"),
    ("placement=scaled_pre", "model.placement='scaled_pre'"),
    ("placement=sandwich", "model.placement='peri'"),
    ("qk_norm=true", "model.qk_norm=true"),
    ("dt=0.5", "model.dt=0.5"),
    ("norm_gain=false", "model.norm_gain=false"),
    ("embed_norm=true", "model.embed_norm=true"),
    ("norm_bias=false", "model.norm_bias=false"),
    ("norm_kind=rmsnorm", "model.norm_kind=rmsnorm"),
    ("num_kv_heads=1", "model.num_kv_heads=1"),
    ("backbone=llama,norm_kind=layernorm", "model.norm_kind=layernorm"),
    ("backbone=llama,norm_bias=true", "model.norm_bias=true"),
])
def test_what_hugging_face_cannot_express_is_refused_naming_the_field(arg, field):
  config = config_lib.get_config(f"tiny,{SHAPE},num_heads=2,{arg}")
  with pytest.raises(ValueError) as info:
    export.check(resolve(config.model))
  message = str(info.value)
  assert message.startswith("cannot export to Hugging Face: ") and field in message
  assert "\n" not in message


def test_every_refusal_lists_each_problem_once():
  config = config_lib.get_config(f"tiny,{SHAPE},num_heads=2,placement=post,qk_norm=true")
  found = export.problems(resolve(config.model))
  assert len(found) == 2
  assert "x' = N(x + dt F(x))" in found[0] and "Pre-LN" in found[0]
  assert found[1].startswith("model.qk_norm=true")
  assert export.problems(resolve(config_lib.get_config(f"tiny_llama,{SHAPE}").model)) == ()


def _config_only_workdir(path, arg):
  """A run folder with its config.json and no checkpoint: a refusal that needs the
  checkpoint would fail on reading it instead."""
  path.mkdir()
  checkpoint_lib.save_config_json(str(path), config_lib.get_config(arg))
  return str(path)


def test_non_empty_out_is_refused_before_the_checkpoint_is_read(tmp_path):
  workdir = _config_only_workdir(tmp_path / "run", f"tiny,{SHAPE},num_heads=2")
  out = tmp_path / "hf"
  out.mkdir()
  (out / "keep.txt").write_text("precious")
  with pytest.raises(ValueError, match=r"--out=.*hf is not empty"):
    export.export(workdir, str(out))
  assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    export.export(workdir, str(tmp_path / "a_file"))


def test_a_failed_write_leaves_no_folder_behind(tmp_path, monkeypatch):
  config, _, params = _perturbed(f"tiny,{SHAPE},num_heads=2")

  def fail(*args, **kwargs):
    raise OSError("disk full")
  monkeypatch.setattr(export, "write_safetensors", fail)
  with pytest.raises(OSError, match="disk full"):
    export.save(str(tmp_path / "hf"), config, params)
  assert os.listdir(tmp_path) == []


@pytest.mark.slow  # subprocess
def test_cli_refuses_an_unsupported_placement_in_one_line_and_writes_nothing(tmp_path):
  workdir = _config_only_workdir(tmp_path / "run", f"tiny,{SHAPE},num_heads=2,placement=geonorm")
  out = tmp_path / "hf"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "geonorm_jax", "export", f"--workdir={workdir}", f"--out={out}"],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("geonorm_jax export: error: cannot export to Hugging Face: "
                             "model.placement='geonorm': its update is x' = exp_x(")
  assert "only placement=pre exports" in lines[0]
  assert not out.exists() and sorted(os.listdir(tmp_path)) == ["run"]


def test_a_parameter_without_a_hugging_face_tensor_is_refused(monkeypatch):
  """The safety net behind the named checks: a table that lost a parameter refuses it."""
  gpt2 = hf_layout.GPT2
  without_positions = lambda spec: {path: source for path, source in gpt2.sources(spec).items()
                                    if path != ("positions",)}
  monkeypatch.setitem(hf_layout.ARCHITECTURES, "gpt2",
                      dataclasses.replace(gpt2, sources=without_positions))
  export.problems.cache_clear()
  try:
    spec = resolve(config_lib.get_config(f"tiny,{SHAPE},num_heads=2").model)
    assert export.problems(spec) == ("our parameter positions has no place in GPT2LMHeadModel",)
  finally:
    export.problems.cache_clear()
