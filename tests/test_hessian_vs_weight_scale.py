"""experiments/hessian_vs_weight_scale.py: its seed statistics, verdict and write-up on synthetic
rows whose slopes and spreads are known in closed form; its configs, linear-map selection,
pre-norm scale and measurement on each backbone at a tiny size (untrained: the invariance is
a property of the graph, not of training)."""
import csv
import functools
import importlib.util
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def experiment():
  path = os.path.join(REPO, "experiments", "hessian_vs_weight_scale.py")
  spec = importlib.util.spec_from_file_location("hessian_vs_weight_scale", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rows(experiment, laws, seeds=(0, 1, 2)):
  """One row per seed and c: lambda_max = a_seed * c**slope for each (key -> slope)."""
  rows = []
  for seed in seeds:
    for (placement, scope, quantity, where), slope in laws.items():
      for c in experiment.SCALES:
        rows.append(dict(placement=placement, scope=scope, c=c, quantity=quantity,
                         where=where, lambda_max=(1.0 + seed) * c ** slope,
                         residual_bound=0.0, loss=2.0, seed=seed))
  return rows


def _laws(experiment, normalised_slope, plain_slope):
  laws = {key: normalised_slope for key in experiment.NORMALISED}
  laws[experiment.PLAIN] = plain_slope
  return laws


def test_over_seeds_recovers_each_seeds_slope_and_spread(experiment):
  per_seed = experiment.over_seeds(_rows(experiment, _laws(experiment, 0.0, 2.0)))
  c = np.asarray(experiment.SCALES)
  for seed, slope, spread in per_seed[experiment.PLAIN]:
    assert slope == pytest.approx(2.0)
    assert spread == pytest.approx((c.max() / c.min()) ** 2)
  assert [seed for seed, _, _ in per_seed[experiment.PLAIN]] == [0, 1, 2]
  for key in experiment.NORMALISED:
    assert all(spread == pytest.approx(1.0) for _, _, spread in per_seed[key])


@pytest.mark.parametrize("normalised_slope,plain_slope,expected", [
    (0.0, 2.0, "reproduced"),
    # c**0.05 over c in 0.25..8 is a max/min of 32**0.05 = 1.19: not flat.
    (0.05, 2.0, "not at this scale"),
    # Flat, but the plain map does not grow either: nothing to contrast with.
    (0.0, 0.1, "unresolved"),
])
def test_verdict_rule(experiment, normalised_slope, plain_slope, expected):
  per_seed = experiment.over_seeds(_rows(experiment, _laws(experiment, normalised_slope,
                                                           plain_slope)))
  assert experiment.verdict(per_seed)[0] == expected


def test_one_seed_that_is_not_flat_decides(experiment):
  rows = _rows(experiment, _laws(experiment, 0.0, 2.0))
  key = experiment.NORMALISED[0]
  for row in rows:
    if row["seed"] == 2 and (row["placement"], row["scope"], row["quantity"],
                             row["where"]) == key:
      row["lambda_max"] *= row["c"] ** 0.1
  assert experiment.verdict(experiment.over_seeds(rows))[0] == "not at this scale"


def test_a_results_file_without_seeds_reads_as_seed_0_and_reports(experiment, tmp_path):
  rows = _rows(experiment, _laws(experiment, 0.0, 2.0), seeds=(0,))
  path = tmp_path / "results.csv"
  with open(path, "w", newline="") as f:
    fields = [k for k in rows[0] if k != "seed"]
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows({k: r[k] for k in fields} for r in rows)
  read = experiment.read_csv(path)
  assert {r["seed"] for r in read} == {0}
  outcome, result = experiment.write_verdict(experiment.over_seeds(read),
                                             tmp_path / "verdict.json", "gpt2")
  with open(tmp_path / "verdict.json") as f:
    stored = json.load(f)
  assert (stored["verdict"], stored["result"], stored["seeds"]) == (outcome, result, 1)
  assert stored["backbone"] == "gpt2"
  assert outcome == "reproduced"


def _all_rows(experiment, seeds=(0,)):
  """Every (placement, scope, quantity, where) the script measures, as _measure_scope names
  them, with lambda_max = c**slope for a slope that differs per row."""
  laws = {}
  for placement in list(experiment.PLACEMENTS) + [experiment.EPS_VARIANT]:
    for scope, maps in experiment.SCOPES.items():
      for tap in experiment.TAP_MAPS:
        if maps is None or tap in maps:
          for kind in ("in", "out"):
            laws[placement, scope, f"act_{kind}", f"{tap}.{kind}"] = 0.1 * len(laws) - 2
      where = "+".join(maps) if maps else "all linear maps"
      laws[placement, scope, "params", where] = 0.1 * len(laws) - 2
  return _rows(experiment, laws, seeds)


def test_results_md_says_its_backbone_and_reads_each_with_its_own_prose(experiment, tmp_path):
  rows = _all_rows(experiment)
  eval_losses = {(name, 0): 2.5 for name in experiment.PLACEMENTS}
  texts = {}
  for backbone in experiment.BACKBONES:
    prenorm = {"blocks.0.attn.q": 3e-4, "blocks.0.mlp.up": 0.07}
    if backbone == "llama":
      prenorm["blocks.0.mlp.gate"] = 0.05
    path = tmp_path / f"{backbone}.md"
    experiment.write_markdown(rows, eval_losses, prenorm, path, None, backbone)
    texts[backbone] = path.read_text()
  assert "Models: gpt2 backbone" in texts["gpt2"] and "bias scaled too" in texts["gpt2"]
  assert "Models: llama backbone" in texts["llama"] and "W -> cW (no biases)" in texts["llama"]
  assert "blocks.0.mlp.gate: 0.05." in texts["llama"]
  # gpt2's prose names what only gpt2 has; llama's must not.
  for gpt2_only in ("Wx + b", "GELU", "position embedding", "bias scaled"):
    assert gpt2_only in texts["gpt2"] and gpt2_only not in texts["llama"], gpt2_only
  assert "SwiGLU" in texts["llama"]
  # The numbers are the data's: SimpleNorm's `up` input series at every c, in both.
  law = [r for r in rows if (r["placement"], r["scope"], r["quantity"]) ==
         ("simplenorm", "up", "act_in")]
  series = ", ".join(f"{r['lambda_max']:.3g}" for r in sorted(law, key=lambda r: r["c"]))
  for text in texts.values():
    assert f"lambda_max = {series} (max/min" in text


def test_each_backbones_config_is_the_one_the_docstring_states(experiment):
  for backbone in experiment.BACKBONES:
    for name in experiment.PLACEMENTS:
      config = experiment.make_config(backbone, name)
      spec = spec_lib.resolve(config.model)
      assert (spec.backbone, spec.num_layers, spec.d_model, spec.num_heads) == (
          backbone, 2, 64, 4)
      assert (config.data.seq_len, config.data.batch_size, config.train.steps,
              config.train.lr) == (64, 16, experiment.TRAIN_STEPS, 1e-3)
      if backbone == "llama":
        assert (spec.d_ff, spec.tie_embeddings, spec.has_bias, spec.norm_kind) == (
            spec_lib.llama_ffn_width(64, 16), False, False, "rmsnorm")
        assert spec.d_ff == 176
      else:
        assert (spec.d_ff, spec.tie_embeddings, spec.has_bias, spec.norm_kind) == (
            256, True, True, "layernorm")


# A model small enough to compile the whole measurement in seconds; eps tiny, so that the
# invariance holds to float32 rounding rather than to eps / mean(z^2).
TINY = {"llama": "tiny_llama,d_ff=24,", "gpt2": "tiny,"}
TINY_SIZES = ("num_layers=2,d_model=16,num_heads=2,vocab_size=32,max_seq_len=8,seq_len=8,"
              "norm_eps=1e-12,")


@functools.lru_cache(maxsize=None)
def _tiny(backbone, placement):
  """(setup-like namespace, params, tokens) of an untrained tiny model (built once: eager
  initialisation dispatches every op on its own)."""
  config = config_lib.get_config(TINY[backbone] + TINY_SIZES + placement)
  graphdef, params = nnx.split(model_lib.build(config.model, seed=1))
  setup = types.SimpleNamespace(graphdef=graphdef, spec=spec_lib.resolve(config.model))
  tokens_BxL1 = jax.random.randint(jax.random.key(2), (4, 9), 0, config.model.vocab_size)
  return setup, params, tokens_BxL1


@pytest.mark.parametrize("backbone", ["llama", "gpt2"])
def test_linear_maps_are_every_block_matrix_of_the_backbone(experiment, backbone):
  _, params, _ = _tiny(backbone, "placement=simplenorm")
  roles = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")
  roles += ("mlp.gate",) if backbone == "llama" else ()
  leaves = ("kernel",) if backbone == "llama" else ("kernel", "bias")
  expected = {f"blocks.{i}.{role}.{leaf}" for i in range(2) for role in roles for leaf in leaves}
  assert set(experiment.linear_paths(params)) == expected


@pytest.mark.parametrize("backbone", ["llama", "gpt2"])
def test_simplenorm_prenorm_scale_is_what_enters_the_norms(experiment, backbone):
  setup, params, tokens_BxL1 = _tiny(backbone, "placement=simplenorm")
  measured = experiment.simplenorm_prenorm_scale(setup, params, tokens_BxL1)
  # SimpleNorm's block 0 by hand: x' = x + F(x), no norm on the stream, each map's output
  # normalised; the MLP reads the stream after the attention's update.
  model = nnx.merge(setup.graphdef, params)
  block = model.blocks[0]
  x_BxLxD = model.embed_tokens(tokens_BxL1[:, :-1])
  h_BxLxD = x_BxLxD + block.attn(x_BxLxD)
  by_hand = {"blocks.0.attn.q": block.attn.q(x_BxLxD), "blocks.0.mlp.up": block.mlp.up(h_BxLxD)}
  if backbone == "llama":
    by_hand["blocks.0.mlp.gate"] = block.mlp.gate(h_BxLxD)
  assert set(measured) == set(by_hand)
  for path, z in by_hand.items():
    assert measured[path] == pytest.approx(float(jnp.mean(z * z)), rel=1e-5), path


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
SMALL_SCALES = (0.25, 1.0, 4.0)


@pytest.fixture(scope="module", params=["simplenorm", "pre"])
def llama_up_scaled(experiment, request):
  """placement -> {c: the measurement's output with blocks.0.mlp.up scaled by c}, tiny_llama."""
  setup, params, tokens_BxL1 = _tiny("llama", "placement=" + request.param)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(experiment, "NUM_STEPS", 10)  # read when the measurement is traced
    measure = experiment.make_measure(setup, tokens_BxL1)
    paths = experiment.linear_paths(params)
    maps = experiment.SCOPES["up"]
    mask = {p: jnp.float32(experiment.in_scope(p, maps)) for p in paths}
    scales = lambda c: {p: jnp.float32(c if experiment.in_scope(p, maps) else 1.0)
                        for p in paths}
    key = jax.random.key(0)
    compiled = measure.lower(params, scales(1.0), mask, key).compile(
        compiler_options=_FAST_COMPILE)
  out = {c: jax.device_get(compiled(params, scales(c), mask, key)) for c in SMALL_SCALES}
  return request.param, {c: {k: np.asarray(v, np.float64) for k, v in o.items()}
                         for c, o in out.items()}


def test_llama_up_input_hessian_is_flat_only_behind_a_norm(llama_up_scaled):
  placement, out = llama_up_scaled
  c = np.asarray(SMALL_SCALES)
  act_in = np.array([out[v]["blocks.0.mlp.up.in"][0] for v in c])
  act_out = np.array([out[v]["blocks.0.mlp.up.out"][0] for v in c])
  weights = np.array([out[v]["params"][0] for v in c])
  assert np.all(act_in > 0) and np.all(weights > 0), out
  if placement == "simplenorm":
    # Norm(cWx) before SwiGLU's product: the same function of x for every c, so the same
    # operator up to float32 rounding; the pre-norm output and the weights go as 1/c^2.
    np.testing.assert_allclose(act_in, act_in[1], rtol=1e-4)
    np.testing.assert_allclose(act_out * c ** 2, act_out[1], rtol=1e-3)
    np.testing.assert_allclose(weights * c ** 2, weights[1], rtol=1e-3)
    losses_c = [float(out[v]["loss"]) for v in c]
    np.testing.assert_allclose(losses_c, losses_c[1], rtol=1e-5)
  else:
    # Plain cWx: silu(gate) * cWx enters `down` linearly, so the input Hessian grows with c.
    assert act_in[2] / act_in[0] > 4.0, act_in
