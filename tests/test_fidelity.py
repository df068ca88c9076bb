"""Each placement's paper constants, pinned: init std per matrix, DyT's alpha_0 per site and
embedding scale, nGPT's unit stream and zero weight decay, GeoNorm's paper-linear schedule,
and the collapse diagnostics with the trainer's warning."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import collapse
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train


def _config(arg):
  return config_lib.get_config("tiny,num_layers=4,d_model=128,num_heads=4," + arg)


def _spec(arg):
  return spec_lib.resolve(_config(arg).model)


def _kernel_std(model, layer, module, role):
  return float(jnp.std(getattr(getattr(model.blocks[layer], module), role).kernel[...]))


def test_deepnorm_init_is_xavier_normal_with_the_deepnet_gains():
  model = model_lib.build(_config("placement=deepnorm").model, seed=1)
  beta = (8 * 4) ** -0.25
  d, f = 128, 512
  expected = {("attn", "q"): math.sqrt(2 / (d + d)), ("attn", "k"): math.sqrt(2 / (d + d)),
              ("attn", "v"): beta * math.sqrt(2 / (d + d)),
              ("attn", "o"): beta * math.sqrt(2 / (d + d)),
              ("mlp", "up"): beta * math.sqrt(2 / (d + f)),
              ("mlp", "down"): beta * math.sqrt(2 / (f + d))}
  for (module, role), std in expected.items():
    for layer in (0, 3):
      assert _kernel_std(model, layer, module, role) == pytest.approx(std, rel=0.03), (module, role)


@pytest.mark.parametrize("backbone", ["gpt2", "llama"])
def test_simplenorm_init_scales_only_the_simplegpt_matrices(backbone):
  spec = _spec(f"placement=simplenorm,backbone={backbone}")
  for layer in (1, 3):
    scaled = 0.02 / math.sqrt(2 * layer)
    assert model_lib.init_std(spec, "q", layer) == 0.02
    assert model_lib.init_std(spec, "o", layer) == pytest.approx(scaled)
    assert model_lib.init_std(spec, "down", layer) == pytest.approx(scaled)
    if backbone == "gpt2":  # GELU MLP: W_1 is the first matrix, plain std
      assert model_lib.init_std(spec, "up", layer) == 0.02
    else:  # SwiGLU: W_1 (gate, through silu) plain, W_3 (up) depth-scaled
      assert model_lib.init_std(spec, "gate", layer) == 0.02
      assert model_lib.init_std(spec, "up", layer) == pytest.approx(scaled)
  assert model_lib.init_std(spec, "head") == pytest.approx(128 ** -0.5)
  assert model_lib.init_std(spec, "embed") == 1.0  # untied


def test_dyt_alpha_by_site_follows_the_authors_table():
  # jiachenzhu/DyT other_tasks/LLaMA/README.md: 7B 0.8/0.2/0.2, 13B 0.6/0.15/0.15, 70B 0.2/0.05;
  # narrower widths: the paper's width x depth table (tests/test_dyt_alpha.py), 1.0/1.0 <= 1024.
  for width, expected in [(4096, (0.8, 0.2, 0.2)), (5120, (0.6, 0.15, 0.15)),
                          (8192, (0.2, 0.05, 0.05)), (128, (1.0, 1.0, 1.0))]:
    spec = _spec(f"placement=dyt,d_model={width},num_heads=4")
    assert tuple(spec.option(f"dyt_alpha_{s}") for s in ("attn", "ffn", "final")) == expected
  spec = _spec("placement=dyt,dyt_alpha_attn=0.5,dyt_alpha_final=0.3")
  assert tuple(spec.option(f"dyt_alpha_{s}") for s in ("attn", "ffn", "final")) == (0.5, 1.0, 0.3)
  with pytest.raises(ValueError, match="model.dyt_alpha_ffn"):
    _spec("placement=dyt,dyt_alpha_ffn=-1")


@pytest.mark.parametrize("backbone,has_bias", [("gpt2", True), ("llama", False)])
def test_dyt_model_sites_embedding_scale_and_bias(backbone, has_bias):
  # Distinct alpha_0 per site (the table gives 1.0 at all three at this width).
  config = _config(f"placement=dyt,backbone={backbone},num_layers=2,d_model=32,"
                   "dyt_alpha_attn=0.8,dyt_alpha_ffn=0.2,dyt_alpha_final=0.1")
  model = model_lib.build(config.model)
  block = model.blocks[0]
  assert float(block.attn_in_norm.alpha[...]) == pytest.approx(0.8)
  assert float(block.mlp_in_norm.alpha[...]) == pytest.approx(0.2)
  assert float(model.final_norm.alpha[...]) == pytest.approx(0.1)
  assert (block.attn_in_norm.bias is not None) == has_bias  # no beta in the LLaMA variant
  assert float(model.embed_scale[...]) == pytest.approx(math.sqrt(32))
  tokens = jnp.arange(8)[None]
  raw = model.embed[...][tokens]
  if model.positions is not None:
    raw = raw + model.positions[...][:8]
  np.testing.assert_allclose(model.embed_tokens(tokens), math.sqrt(32) * raw, rtol=1e-6)


@pytest.mark.parametrize("backbone", ["gpt2", "llama"])
def test_ngpt_stream_entering_block_one_is_unit_norm(backbone):
  model = model_lib.build(_config(f"placement=ngpt,backbone={backbone},num_layers=2,d_model=32"
                                  ).model)
  _, streams = model(jnp.arange(16)[None], return_streams=True)
  for stream in streams:
    np.testing.assert_allclose(jnp.linalg.norm(stream, axis=-1), 1.0, rtol=1e-5)


def test_ngpt_trains_without_weight_decay():
  config = _config("placement=ngpt,num_layers=1,d_model=32,weight_decay=0.5,clip_norm=0")
  setup = train.make_setup(config, jax.devices()[:1])
  params = train.init_state(setup)["params"]
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = setup.optimizer.update(zero_grads, setup.optimizer.init(params), params)
  assert max(float(jnp.abs(u).max()) for u in jax.tree.leaves(updates)) == 0.0


def test_geonorm_paper_linear_schedule_freezes_the_last_block():
  model = model_lib.build(_config("placement=geonorm,geo_schedule=linear_paper,num_layers=3,"
                                  "d_model=32,init_std=0.3").model)
  _, streams = model(jnp.arange(16)[None], return_streams=True)
  np.testing.assert_allclose(streams[3], streams[2], rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(streams[2] - streams[1]).max()) > 1e-3


def test_collapse_diagnostics_against_closed_forms():
  rng = np.random.default_rng(0)
  h = rng.normal(size=(2, 5, 16))
  flat = h.reshape(10, 16)
  unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
  cosines = unit @ unit.T
  expected = (cosines.sum() - np.trace(cosines)) / (10 * 9)
  assert float(collapse.token_cosine(jnp.asarray(h))) == pytest.approx(expected, abs=1e-6)
  same = np.broadcast_to(h[0, 0], h.shape)
  assert float(collapse.token_cosine(jnp.asarray(same))) == pytest.approx(1.0, abs=1e-6)
  assert float(collapse.logit_spread(jnp.asarray(same))) == pytest.approx(0.0, abs=1e-6)
  # More tokens than int32 can count pairs of (a paper-scale batch): still 1 for equal tokens.
  assert float(collapse.token_cosine(jnp.ones((50_000, 2)))) == pytest.approx(1.0, abs=1e-4)
  assert float(collapse.logit_spread(jnp.asarray(h))) == pytest.approx(flat.std(0).mean(), rel=1e-5)
  x = jnp.asarray([0.0, 1.0, 3.0, -10.0])
  assert float(collapse.tanh_saturated(x, 1.0)) == 0.5  # tanh(3) and tanh(-10) pass 0.99


def test_collapse_monitor_warns_once_after_patience():
  monitor = collapse.CollapseMonitor(threshold=0.95, patience=3)
  assert monitor.update(0, 0.99) is None and monitor.update(10, 0.5) is None
  assert monitor.update(20, 0.97) is None and monitor.update(30, 0.98) is None
  message = monitor.update(40, 0.99)
  assert "step 40" in message and "since step 20" in message and monitor.first_step == 20
  assert monitor.update(50, 0.99) is None  # once


def test_a_collapsing_run_prints_the_warning_and_records_it(tmp_path, capsys):
  # A learning rate far too high for a tied Post-LN model sends every token to one state.
  config = config_lib.get_config(
      "tiny,num_layers=2,d_model=32,num_heads=4,seq_len=32,batch_size=8,placement=post,"
      "tie_embeddings=true,steps=40,warmup_steps=1,lr=0.3,clip_norm=0,layer_stats_every=4,"
      "eval_every=40,eval_batches=1,checkpoint.every=40,progress_bar=false")
  summary = train.train(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "representation collapse" in out
  assert summary["collapse_step"] is not None and summary["collapse_step"] < 40
