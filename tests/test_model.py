"""The model zoo: sizes, causality, every placement x backbone x dtype, placement invariants."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import layers, losses, model as model_lib, placements, spec as spec_lib
from geonorm_jax.training import config as config_lib

PLACEMENTS = sorted(placements.PLACEMENTS)
BACKBONES = ["gpt2", "llama"]


def small(arg=""):
  return config_lib.get_config("tiny,num_layers=2,d_model=32,num_heads=4,num_kv_heads=2,"
                               "vocab_size=64,max_seq_len=16," + arg)


def test_gpt2_124m_parameter_count_without_allocating():
  _, state = model_lib.abstract_params(config_lib.get_config("gpt2_124m").model)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
  assert model_lib.count_params(state) == 124_439_808


def test_llama2_7b_parameter_count_without_allocating():
  _, state = model_lib.abstract_params(config_lib.get_config("llama2_7b").model)
  assert model_lib.count_params(state) == 6_738_415_616


def test_every_parameter_has_logical_axes_of_its_rank():
  for backbone in BACKBONES:
    for placement in PLACEMENTS:
      _, state = model_lib.abstract_params(small(f"backbone={backbone},placement={placement},"
                                                 "qk_norm=true").model)
      for path, variable in nnx.to_flat_state(state):
        axes = variable.get_metadata().get("logical_axes")
        assert axes is not None and len(axes) == len(variable.shape), (placement, path, axes)


# The fast loop keeps every placement on gpt2 in float32; the rest of the matrix is slow.
@pytest.mark.parametrize("backbone", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_placement_is_causal_and_trains(backbone, placement, dtype):
  model = model_lib.build(small(f"backbone={backbone},placement={placement},dtype={dtype}").model)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 13)), jnp.int32)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 5) % 64)

  @jax.jit
  def run(state, tokens, changed):
    loss, grads = jax.value_and_grad(
        lambda s: losses.lm_loss(nnx.merge(graphdef, s), tokens))(state)
    # Both inputs in one batch: the same compiled ops compute both (a forward pass fused
    # into the differentiated one may round differently, which says nothing about causality).
    both = nnx.merge(graphdef, state)(jnp.concatenate([tokens, changed])[:, :-1])
    return loss, grads, both[:len(tokens)], both[len(tokens):]

  loss, grads, logits, logits_changed = run(state, tokens, changed)
  assert np.isfinite(loss) and 2.0 < loss < 8.0, loss  # ~log(64) = 4.16 at init
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert sum(float(jnp.sum(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 0
  # Positions before the first changed token see exactly the same logits.
  np.testing.assert_array_equal(logits[:, :8], logits_changed[:, :8])
  assert not np.allclose(logits[:, 8:], logits_changed[:, 8:])


@pytest.mark.parametrize("backbone", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_geonorm_keeps_radius_through_24_layers(backbone):
  # init_std=0.3 makes the sublayer outputs large enough that each step turns the stream.
  config = small(f"backbone={backbone},placement=geonorm,num_layers=24,geo_schedule=constant,"
                 "geo_alpha=1.0,init_std=0.3")
  model = model_lib.build(config.model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
  _, streams = nnx.jit(lambda m, t: m(t, return_streams=True))(model, tokens)
  radius0 = jnp.linalg.norm(streams[0], axis=-1)
  np.testing.assert_allclose(radius0, np.sqrt(32), rtol=1e-5)  # the embedding sits on sqrt(d)
  moved = 0.0
  for x in streams[1:]:
    np.testing.assert_allclose(jnp.linalg.norm(x, axis=-1), radius0, rtol=1e-5)
    moved = max(moved, float(jnp.max(jnp.abs(x - streams[0]))))
  assert moved > 1.0  # the stream did move: the radius test is not vacuous


def test_geonorm_block_is_closed_form_with_schedule():
  """One block of the model equals the closed-form update with alpha_k = alpha / k."""
  config = small("backbone=llama,placement=geonorm,num_layers=3,geo_schedule=harmonic,"
                 "geo_alpha=0.9")
  model = model_lib.build(config.model)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (1, 6)), jnp.int32)
  _, streams = model(tokens, return_streams=True)
  block = model.blocks[2]  # k = 3 -> alpha = 0.3
  x = streams[2]
  g = block.attn(block.attn_in_norm(x))
  v = g - jnp.sum(x * g, -1, keepdims=True) / jnp.sum(x * x, -1, keepdims=True) * x
  theta = 0.3 * jnp.linalg.norm(v, axis=-1, keepdims=True) / jnp.linalg.norm(x, axis=-1,
                                                                            keepdims=True)
  x_mid = jnp.cos(theta) * x + jnp.linalg.norm(x, axis=-1, keepdims=True) * jnp.sin(theta) * v \
      / jnp.linalg.norm(v, axis=-1, keepdims=True)
  np.testing.assert_allclose(block(x), _mlp_step(block, x_mid, 0.3), rtol=1e-5, atol=1e-5)


def _mlp_step(block, x, alpha):
  g = block.mlp(block.mlp_in_norm(x))
  v = g - jnp.sum(x * g, -1, keepdims=True) / jnp.sum(x * x, -1, keepdims=True) * x
  r = jnp.linalg.norm(x, axis=-1, keepdims=True)
  theta = alpha * jnp.linalg.norm(v, axis=-1, keepdims=True) / r
  return jnp.cos(theta) * x + r * jnp.sin(theta) * v / jnp.linalg.norm(v, axis=-1, keepdims=True)


@pytest.mark.parametrize("backbone,expected_norms", [("gpt2", 6), ("llama", 7)])
def test_simplenorm_normalises_every_linear_output(backbone, expected_norms, monkeypatch):
  # init_std=0.2 keeps the linear outputs' variance far above eps=1e-5 with GPT-2's small
  # tied embedding (LLaMA's untied SimpleGPT init draws the embedding from N(0, 1)).
  model = model_lib.build(small(f"backbone={backbone},placement=simplenorm,init_std=0.2").model)
  rng = np.random.default_rng(3)
  inner = {}
  for path, module in nnx.iter_modules(model):
    if isinstance(module, layers.Norm) and "out_norm" in str(path[-1]):
      module.gain[...] = jnp.asarray(rng.uniform(0.5, 2.0, module.gain.shape), jnp.float32)
      inner[id(module)] = path
  assert len(inner) == expected_norms * 2  # every q, k, v, o and MLP matrix of both blocks
  recorded = []
  original = layers.Norm.__call__

  def recording_call(self, x):
    y = original(self, x)
    if id(self) in inner:
      recorded.append((self, x, y))
    return y

  monkeypatch.setattr(layers.Norm, "__call__", recording_call)
  model(jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32))
  assert len(recorded) == len(inner)
  for norm, x, y in recorded:
    assert x.shape[-1] == norm.gain.shape[0]
    rms = jnp.sqrt(jnp.mean((y / norm.gain[...]) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # eps=1e-5 against unit-scale inputs
  # No stream pre-norm: the blocks hold no residual-stream norms at all.
  for block in model.blocks:
    assert block.attn_in_norm is None and block.mlp_in_norm is None


def test_deepnorm_residual_scale():
  # The init is pinned in test_fidelity.py.
  x = jnp.ones((1, 2, 256))
  f = lambda h: h * 0.5
  norms_ = placements.SublayerNorms(output=lambda h: h)
  ctx = placements.ResidualContext(layer=1, num_layers=6, constants={"alpha": 12 ** 0.25})
  np.testing.assert_allclose(placements.deepnorm(x, f, norms_, ctx), 12 ** 0.25 + 0.5, rtol=1e-6)


def test_ngpt_weights_are_unit_along_embedding_axis():
  model = model_lib.build(small("backbone=llama,placement=ngpt").model)
  np.testing.assert_allclose(jnp.linalg.norm(model.embed[...], axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(model.head[...], axis=0), 1.0, rtol=1e-5)
  attn = model.blocks[0].attn
  np.testing.assert_allclose(jnp.linalg.norm(attn.q.kernel[...], axis=0), 1.0, rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(attn.o.kernel[...], axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(model.blocks[1].mlp.down.kernel[...], axis=1), 1.0,
                             rtol=1e-5)
  _, streams = model(jnp.zeros((1, 5), jnp.int32), return_streams=True)
  for x in streams:
    np.testing.assert_allclose(jnp.linalg.norm(x, axis=-1), 1.0, rtol=1e-5)


def test_mixln_uses_post_then_pre():
  model = model_lib.build(small("placement=mixln,num_layers=8").model)
  kinds = ["post" if b.attn_out_norm is not None else "pre" for b in model.blocks]
  assert kinds == ["post"] * 2 + ["pre"] * 6


def test_layernorm_scaling_divides_by_sqrt_layer():
  ctx = placements.ResidualContext(layer=4, num_layers=6, dt=0.5)
  norms_ = placements.SublayerNorms(input=lambda h: h + 1.0)
  out = placements.layernorm_scaling(jnp.ones(3), lambda h: 3.0 * h, norms_, ctx)
  np.testing.assert_allclose(out, 1.0 + 0.5 * 3.0 * 2.0 / 2.0)


def test_dt_scales_every_additive_update():
  for name in ["pre", "peri", "lns", "simplenorm", "dyt"]:
    update = placements.get_placement(name).update
    norms_ = placements.SublayerNorms(input=lambda h: h, output=lambda h: h)
    ctx = placements.ResidualContext(layer=1, num_layers=2, dt=0.1)
    np.testing.assert_allclose(update(jnp.ones(4), lambda h: 2.0 * h, norms_, ctx), 1.2, rtol=1e-6)


@pytest.mark.slow  # compiles the model twice, with and without remat
def test_remat_gives_identical_gradients():
  base = small("placement=peri")
  remat = small("placement=peri,remat=true")
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 9)), jnp.int32)
  grads = []
  for config in (base, remat):
    graphdef, state = nnx.split(model_lib.build(config.model))
    grads.append(jax.jit(jax.grad(lambda s: losses.lm_loss(nnx.merge(graphdef, s), tokens)))(state))
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_qk_norm_adds_per_head_gains():
  model = model_lib.build(small("qk_norm=true").model)
  assert model.blocks[0].attn.q_head_norm.gain.shape == (8,)


@pytest.mark.parametrize("override,field", [
    ("placement=postnorm", "model.placement"),
    ("backbone=bert", "model.backbone"),
    ("geo_schedule=cosine", "model.geo_schedule"),
    ("d_model=30", "model.d_model"),
    ("num_kv_heads=3", "model.num_kv_heads"),
    ("num_layers=0", "model.num_layers"),
    ("num_heads=-2", "model.num_heads"),
    ("vocab_size=-1", "model.vocab_size"),
    ("norm_kind=batchnorm", "model.norm_kind"),
    ("dtype=int8", "model.dtype"),
])
def test_bad_model_config_names_the_field(override, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    spec_lib.resolve(small(override).model)


def test_unknown_placement_lists_valid_names():
  with pytest.raises(ValueError) as error:
    placements.get_placement("prenorm")
  for name in placements.valid_names():
    assert name in str(error.value)


def test_config_presets_and_overrides():
  config = config_lib.get_config("size=gpt2_124m,placement=geonorm,train.lr=3e-4")
  assert config.model.d_model == 768 and config.model.placement == "geonorm"
  assert config.train.lr == 3e-4
  with pytest.raises(ValueError, match="size 'gpt9'"):
    config_lib.get_config("gpt9")
  with pytest.raises(ValueError, match="'nonexistent' is unknown"):
    config_lib.get_config("tiny,nonexistent=1")


def _attention_float64(q, k, v, scale):
  """Causal GQA attention in numpy float64, written from the definition."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  batch, length, heads, _ = q.shape
  group = heads // k.shape[2]
  out = np.zeros_like(q)
  for h in range(heads):
    scores = np.einsum("blk,bmk->blm", q[:, :, h], k[:, :, h // group]) * scale
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[:, :, h] = np.einsum("blm,bmk->blk", probs, v[:, :, h // group])
  return out


def test_softmax_derivatives_equal_autodiff_of_the_formula():
  """model.softmax's written-out derivative against JAX's derivative of exp(x) / sum exp(x)
  in float64: value, gradient, a Hessian-vector product (forward over reverse) and forward
  mode, on rows with masked entries (the attention's finfo.min) and one large logit."""
  with jax.enable_x64(True):
    keys = jax.random.split(jax.random.key(0), 3)
    x = 3.0 * jax.random.normal(keys[0], (2, 5, 7), jnp.float64)
    x = x.at[:, :, 4:].set(jnp.finfo(jnp.float32).min).at[0, 0, 1].set(40.0)
    weights, direction = (jax.random.normal(k, x.shape, jnp.float64) for k in keys[1:])
    formula = lambda x: jnp.exp(x - x.max(-1, keepdims=True)) / jnp.sum(
        jnp.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)

    def derivatives(fn):
      objective = lambda x: jnp.sum(jnp.sin(fn(x)) * weights)
      return (fn(x), jax.grad(objective)(x),
              jax.jvp(jax.grad(objective), (x,), (direction,))[1],
              jax.jvp(fn, (x,), (direction,))[1])
    got, want = derivatives(lambda x: model_lib.softmax(x, -1)), derivatives(formula)
  reference = np.exp(np.asarray(x) - np.asarray(x).max(-1, keepdims=True))
  np.testing.assert_allclose(got[0], reference / reference.sum(-1, keepdims=True), rtol=1e-12)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["dense", "blocked"])
def test_attention_implementations_match_float64_and_each_other(impl):
  # 150 queries: two full blocks of ATTENTION_BLOCK and a partial one; 4 query heads on 2 KV heads.
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 150, 4, 8))
  k, v = (jax.random.normal(key, (2, 150, 2, 8)) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], q.shape)
  assert model_lib.ATTENTION_BLOCK < 150
  out = model_lib.causal_attention(q, k, v, 0.3, impl)
  np.testing.assert_allclose(out, _attention_float64(q, k, v, 0.3), atol=2e-6)

  def loss(impl_name, q, k, v):
    return jnp.sum(model_lib.causal_attention(q, k, v, 0.3, impl_name) * cotangent)
  grads = jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2))(q, k, v)
  reference = jax.grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads, reference):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_attention_choice_does_not_change_the_model():
  base = "num_layers=2,d_model=32,num_heads=4,num_kv_heads=2,max_seq_len=160,backbone=llama"
  tokens = jax.random.randint(jax.random.key(1), (2, 150), 0, 256)
  logits = {impl: model_lib.build(config_lib.get_config(f"{base},attention={impl}").model)(tokens)
            for impl in ("dense", "blocked")}
  np.testing.assert_allclose(logits["blocked"], logits["dense"], atol=1e-5)
  with pytest.raises(ValueError, match="model.attention"):
    spec_lib.resolve(config_lib.get_config("attention=flash").model)


def test_auto_attention_picks_the_fused_kernel_only_where_it_applies():
  def resolved(arg, backend):
    return model_lib.attention_impl(spec_lib.resolve(config_lib.get_config(arg).model), backend)
  assert resolved("dtype=bfloat16", "cpu") == "blocked"
  assert resolved("dtype=bfloat16", "gpu") == "cudnn"
  assert resolved("dtype=float32", "gpu") == "dense"  # cuDNN's fused kernel is 16-bit only
  assert resolved("dtype=bfloat16,d_model=160,num_heads=1", "gpu") == "dense"  # head_dim 160
  assert resolved("dtype=bfloat16,d_model=132,num_heads=4", "gpu") == "dense"  # head_dim 33
  assert resolved("dtype=bfloat16", "tpu") == "dense"
  assert resolved("dtype=bfloat16,attention=dense", "gpu") == "dense"


def test_cross_entropy_and_its_gradient_match_float64():
  """losses.cross_entropy against the closed form in float64: mean masked NLL, gradient
  mask * (softmax - onehot) / count."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 11)) * 3
  targets = rng.integers(0, 11, (2, 5))
  mask = (rng.random((2, 5)) > 0.3).astype(np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  onehot = np.eye(11)[targets]
  expected = -(np.sum(log_probs * onehot, -1) * mask).sum() / mask.sum()
  expected_grad = (np.exp(log_probs) - onehot) * mask[..., None] / mask.sum()
  with jax.enable_x64(True):
    loss, count = losses.cross_entropy(jnp.float64(logits), targets, mask)
    grad = jax.grad(lambda l: losses.cross_entropy(l, targets, mask)[0])(jnp.float64(logits))
  assert count == mask.sum()
  # The loss computes in float32 whatever the logits' dtype.
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-8)
