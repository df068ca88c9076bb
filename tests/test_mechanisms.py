"""The instability mechanisms in the per-layer statistics (nn/mechanisms.py through
train.make_stream_stats) and PaLM's z-loss (nn/losses.py), each against a float64 numpy
computation of its own.

Attention: q and k are rebuilt in numpy from the model's parameters and the stream entering
each block (its norm, projections, QK-norm, RoPE), the probabilities built by hand, and their
output, P V W_o, is checked against the model's own attention update, so the numpy scores are
the ones the model's softmax reads; the logged max and entropy must equal theirs, and what a
wrong implementation would log (masked keys counted, whole rows, scores before RoPE) must not.
Norm sites: their inputs rebuilt in numpy from the streams, their gains set to random values
first, so a mean or max of the wrong thing cannot pass. z-loss: value and gradient against the
closed form, whole and chunked paths, the train step's logged terms and the plain
cross-entropy of the validation loss.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax import cli
from geonorm_jax.nn import layers, losses
from geonorm_jax.nn import model as model_lib
from geonorm_jax.studies import report
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, train

NUM_LAYERS = 2
SEQ = 8
TOL = 1e-4
SMALL = (f"num_layers={NUM_LAYERS},d_model=32,num_heads=4,seq_len={SEQ},max_seq_len={SEQ},"
         "batch_size=2,init_std=0.3,")
GPT2_PRE = "tiny," + SMALL + "placement=pre"
# RoPE, RMSNorm, SwiGLU, grouped-query attention (2 KV heads for 4 query heads), QK-norm.
LLAMA_PRE_QK = ("tiny_llama," + SMALL + "d_ff=64,num_kv_heads=2,placement=pre,qk_norm=true")


def _setup(arg, random_gains=True):
  """(setup, params, tokens); random_gains: every norm's gain (and bias) drawn at random."""
  setup = train.make_setup(config_lib.get_config(arg), jax.devices()[:1])
  model = nnx.merge(setup.graphdef, train.init_state(setup)["params"])
  rng = np.random.default_rng(0)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, layers.Norm) and random_gains:
      for variable, low, high in ((module.gain, 0.5, 1.5), (module.bias, -0.3, 0.3)):
        if variable is not None:
          variable[...] = jnp.asarray(rng.uniform(low, high, variable.shape), jnp.float32)
  tokens = train.global_batch(setup, {"tokens": rng.integers(0, 256, (2, SEQ + 1))})
  return setup, nnx.state(model), tokens


def _stats(setup, params, tokens):
  values = jax.device_get(train.make_stream_stats(setup)(params, tokens))
  return {name: float(value) for name, value in values.items()}


@pytest.fixture(scope="module")
def runs():
  """arg -> (setup, params, tokens, stats), each computed once for the whole module."""
  cache = {}

  def get(arg):
    if arg not in cache:
      setup, params, tokens = _setup(arg)
      cache[arg] = (setup, params, tokens, _stats(setup, params, tokens))
    return cache[arg]
  return get


def _np(x):
  return np.asarray(x, np.float64)


def _norm64(module, x, kind):
  x = _np(x)
  if kind == "layernorm":
    x = x - x.mean(-1, keepdims=True)
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5)
  y = y if module.gain is None else y * _np(module.gain[...])
  return y if module.bias is None else y + _np(module.bias[...])


def _linear64(linear, x):
  y = _np(x) @ _np(linear.kernel[...])
  return y if linear.bias is None else y + _np(linear.bias[...])


def _rope64(x_BxLxHxK, theta):
  """Rotate-half RoPE (Hugging Face LLaMA's layout), positions 0..L-1."""
  length, hd = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
  freq = theta ** (-np.arange(0, hd, 2) / hd)
  angle_LxK = np.concatenate([np.outer(np.arange(length), freq)] * 2, axis=-1)
  half = hd // 2
  rotated = np.concatenate([-x_BxLxHxK[..., half:], x_BxLxHxK[..., :half]], axis=-1)
  return (x_BxLxHxK * np.cos(angle_LxK)[None, :, None] +
          rotated * np.sin(angle_LxK)[None, :, None])


def _attention64(setup, params, tokens):
  """Per block, in float64 numpy: {scores (B, H, L, L) unmasked, scores before RoPE}, after
  checking that softmax(scores) V W_o is the model's attention update (Pre-LN, dt = 1)."""
  spec = setup.spec
  model = nnx.merge(setup.graphdef, params)
  _, streams, midstreams = model(tokens[0, :, :-1], return_sublayer_streams=True)
  heads, kv_heads, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
  causal_LxL = np.tril(np.ones((SEQ, SEQ), bool))
  blocks = []
  for index in range(spec.num_layers):
    block = model.block(index)
    attn = block.attn
    h = _norm64(block.attn_in_norm, streams[index], spec.norm_kind)
    batch = h.shape[0]
    q = _linear64(attn.q, h).reshape(batch, SEQ, heads, hd)
    k = _linear64(attn.k, h).reshape(batch, SEQ, kv_heads, hd)
    v = _linear64(attn.v, h).reshape(batch, SEQ, kv_heads, hd)
    if spec.qk_norm:
      q, k = _norm64(attn.q_head_norm, q, "rmsnorm"), _norm64(attn.k_head_norm, k, "rmsnorm")
    # Query head h reads KV head h // (H / G).
    k, v = (np.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    scores = lambda q, k: np.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(hd)
    unrotated = scores(q, k)
    if spec.uses_rope:
      q, k = _rope64(q, spec.rope_theta), _rope64(k, spec.rope_theta)
    s = scores(q, k)
    masked = np.where(causal_LxL, s, -np.inf)
    p = np.exp(masked - masked.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhlm,bmhk->blhk", p, v).reshape(batch, SEQ, heads * hd)
    np.testing.assert_allclose(_np(midstreams[index]) - _np(streams[index]),
                               _linear64(attn.o, out), atol=TOL, rtol=0)
    blocks.append({"scores": s, "before_rope": unrotated})
  return blocks


def _max_and_entropy(scores, mask):
  """Max of the scores where mask, and the mean entropy (nats) of softmax over those."""
  masked = np.where(mask, scores, -np.inf)
  log_z = np.log(np.sum(np.exp(masked - masked.max(-1, keepdims=True)), -1)) + masked.max(-1)
  p = np.exp(masked - log_z[..., None])
  entropy = -np.sum(np.where(mask, p * np.log(np.where(mask, p, 1.0)), 0.0), -1)
  return masked.max(), entropy.mean()


@pytest.fixture(scope="module", params=[GPT2_PRE, LLAMA_PRE_QK], ids=["gpt2", "llama_qk_gqa"])
def attention(request, runs):
  setup, params, tokens, stats = runs(request.param)
  return setup, stats, _attention64(setup, params, tokens)


def test_attention_logit_max_and_entropy_match_float64(attention):
  _, stats, blocks = attention
  causal = np.tril(np.ones((SEQ, SEQ), bool))
  for index, block in enumerate(blocks):
    logit_max, entropy = _max_and_entropy(block["scores"], causal)
    assert logit_max > 1.0 and 0.1 < entropy < np.log(SEQ) - 0.1  # neither flat nor trivial
    np.testing.assert_allclose(stats[f"attn_logit_max/layer_{index:02d}"], logit_max,
                               atol=TOL, rtol=TOL)
    np.testing.assert_allclose(stats[f"attn_entropy/layer_{index:02d}"], entropy,
                               atol=TOL, rtol=TOL)


def test_wrong_attention_statistics_differ_from_the_logged_ones(attention):
  """What an implementation counting masked keys, whole rows, the wrong layer or the scores
  before RoPE would log is far from what is logged."""
  setup, stats, blocks = attention
  causal, everything = np.tril(np.ones((SEQ, SEQ), bool)), np.ones((SEQ, SEQ), bool)
  for index, block in enumerate(blocks):
    logged = (stats[f"attn_logit_max/layer_{index:02d}"],
              stats[f"attn_entropy/layer_{index:02d}"])
    wrong = {"whole rows": _max_and_entropy(block["scores"], everything),
             "other layer": _max_and_entropy(blocks[1 - index]["scores"], causal)}
    if setup.spec.uses_rope:
      wrong["before RoPE"] = _max_and_entropy(block["before_rope"], causal)
    for name, values in wrong.items():
      assert max(abs(a - b) for a, b in zip(values, logged)) > 100 * TOL, (index, name)
    # Whole rows: the entropy is that of rows over keys the query never reads.
    assert abs(wrong["whole rows"][1] - logged[1]) > 100 * TOL


@pytest.mark.parametrize("arg", [GPT2_PRE, LLAMA_PRE_QK], ids=["gpt2", "llama"])
def test_log_z_and_max_logit_match_float64(arg, runs):
  setup, params, tokens, stats = runs(arg)
  model = nnx.merge(setup.graphdef, params)
  _, streams = model(tokens[0, :, :-1], return_streams=True)
  head = _np(model.embed[...]).T if model.head is None else _np(model.head[...])
  logits = _norm64(model.final_norm, streams[-1], setup.spec.norm_kind) @ head
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.sum(np.exp(logits - top), -1)) + top[..., 0]
  assert abs(log_z.mean() - np.log(setup.spec.vocab_size)) > 0.1  # not the uniform value
  np.testing.assert_allclose(stats["logits/log_z_mean"], log_z.mean(), atol=TOL, rtol=TOL)
  np.testing.assert_allclose(stats["logits/max"], logits.max(), atol=TOL, rtol=TOL)


def _rms(x):
  return float(np.sqrt(np.mean(np.square(_np(x)))))


def _site_names(sites, layered):
  names = set()
  for site in sites:
    for layer in (range(NUM_LAYERS) if layered else (None,)):
      suffix = "" if layer is None else f"/layer_{layer:02d}"
      names |= {f"{statistic}/{site}{suffix}"
                for statistic in ("norm_input_rms", "norm_gain_mean", "norm_gain_max_abs")}
  return names


# (config, sites in each block, model-wide sites): every Norm module each placement builds.
NORM_SITES = {
    "pre": (GPT2_PRE, ("attn_in_norm", "mlp_in_norm"), ("final_norm",)),
    "peri": ("tiny," + SMALL + "placement=peri,embed_norm=true",
             ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"),
             ("embed_norm", "final_norm")),
    "simplenorm": ("tiny," + SMALL + "placement=simplenorm",
                   tuple(f"attn.{n}_out_norm" for n in "qkvo") + ("mlp.up_out_norm",
                                                                  "mlp.down_out_norm"),
                   ("final_norm",)),
}


@pytest.mark.parametrize("placement", sorted(NORM_SITES))
def test_norm_sites_input_rms_and_gain_match_float64(placement, runs):
  arg, block_sites, model_sites = NORM_SITES[placement]
  setup, params, tokens, stats = runs(arg)
  logged = {name for name in stats if name.startswith("norm_")}
  assert logged == _site_names(block_sites, True) | _site_names(model_sites, False)
  model = nnx.merge(setup.graphdef, params)
  _, streams, midstreams = model(tokens[0, :, :-1], return_sublayer_streams=True)
  kind = setup.spec.norm_kind
  inputs = {"final_norm": streams[-1]}  # site -> what the norm there reads
  if model.embed_norm is not None:  # gpt2: tokens + learned positions, then the norm
    embedded = (_np(model.embed[...])[np.asarray(tokens[0, :, :-1])] +
                _np(model.positions[...])[:SEQ])
    inputs["embed_norm"] = embedded
  for index in range(NUM_LAYERS):
    block, x, mid = model.block(index), streams[index], midstreams[index]
    named = lambda site, module_input: inputs.__setitem__(f"{site}/layer_{index:02d}",
                                                          module_input)
    if placement == "simplenorm":  # F reads the stream itself: x' = x + F(x)
      for name in "qkv":
        named(f"attn.{name}_out_norm", _linear64(getattr(block.attn, name), x))
      named("mlp.up_out_norm", _linear64(block.mlp.up, mid))
    else:
      named("attn_in_norm", x)
      named("mlp_in_norm", mid)
    if placement == "peri":  # N_out reads F(N_in(x))
      named("attn_out_norm", block.attn(block.attn_in_norm(x)))
      named("mlp_out_norm", block.mlp(block.mlp_in_norm(mid)))
  for site, module_input in inputs.items():
    np.testing.assert_allclose(stats[f"norm_input_rms/{site}"], _rms(module_input),
                               rtol=1e-5, err_msg=site)
  # The sites whose input is not rebuilt here (attn.o_out_norm, mlp.down_out_norm) at least
  # read something of scale.
  for name in logged:
    assert np.isfinite(stats[name]) and stats[name] > 1e-3, name
  for name in (n for n in logged if n.startswith("norm_gain_mean/")):
    site = name.split("/", 1)[1]
    path, _, layer = site.partition("/layer_")
    gain = _np(_module(model.block(int(layer)) if layer else model, path).gain[...])
    assert gain.std() > 0.1  # drawn at random: neither 1 nor a constant
    np.testing.assert_allclose(stats[name], gain.mean(), rtol=1e-6, err_msg=site)
    np.testing.assert_allclose(stats[f"norm_gain_max_abs/{site}"], np.abs(gain).max(),
                               rtol=1e-6, err_msg=site)


def _module(block, site):
  module = block
  for part in site.split("."):
    module = getattr(module, part)
  return module


def test_mechanisms_are_the_same_scanned_and_with_another_attention_kernel():
  """A seed gives the same parameters in both layouts (the gains left at their init); the
  statistics must agree too, under remat, and not depend on the attention kernel (they
  compute dense scores whatever model.attention is)."""
  base = _stats(*_setup(LLAMA_PRE_QK + ",attention=blocked", random_gains=False))
  other = _stats(*_setup(LLAMA_PRE_QK + ",scan_layers=true,remat=true,attention=dense",
                         random_gains=False))
  assert other.keys() == base.keys()
  for name, value in base.items():
    np.testing.assert_allclose(other[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


# --- z-loss --------------------------------------------------------------------------------

Z = 0.3  # big enough that its share of the gradient is far above the tolerance


def _closed_form(logits, targets):
  """(cross-entropy, mean log(Z)^2, d CE/d logits, d (Z * mean log(Z)^2)/d logits)."""
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.sum(np.exp(logits - top), -1)) + top[..., 0]
  softmax = np.exp(logits - log_z[..., None])
  count = targets.size
  onehot = np.eye(logits.shape[-1])[targets]
  cross_entropy = np.mean(log_z - np.sum(logits * onehot, -1))
  return (cross_entropy, np.mean(log_z ** 2), (softmax - onehot) / count,
          2 * Z * log_z[..., None] * softmax / count)


def test_z_loss_value_and_gradient_match_the_closed_form():
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(2, 8, 5)), rng.normal(size=(5, 11))
  targets = rng.integers(0, 11, (2, 8))
  logits = x @ w + 2.0  # an offset: log Z far from 0, so the z term pulls
  cross_entropy, log_z_sq, d_ce, d_z = _closed_form(logits, targets)
  with jax.enable_x64(True):
    whole = losses.loss_terms(jnp.float64(logits), targets, Z)
    grad = jax.grad(lambda l: losses.loss_terms(l, targets, Z).total)(jnp.float64(logits))
    grad_z = jax.grad(lambda l: losses.loss_terms(l, targets, Z).z_loss)(jnp.float64(logits))
    offset_fn = lambda h, w: h @ w + 2.0
    chunked_of = lambda x, w: losses.chunked_loss_terms(lambda h: offset_fn(h, w), x, targets,
                                                        chunks=4, z_loss=Z)
    chunked = chunked_of(jnp.float64(x), jnp.float64(w))
    grad_x, grad_w = jax.grad(lambda x, w: chunked_of(x, w).total, argnums=(0, 1))(
        jnp.float64(x), jnp.float64(w))
    off = losses.loss_terms(jnp.float64(logits), targets)
  # The loss is float32 whatever the logits are (losses.py), hence the tolerances.
  for terms in (whole, chunked):
    np.testing.assert_allclose(terms.cross_entropy, cross_entropy, rtol=1e-6)
    np.testing.assert_allclose(terms.z_loss, Z * log_z_sq, rtol=1e-6)
    np.testing.assert_allclose(terms.total, cross_entropy + Z * log_z_sq, rtol=1e-6)
  np.testing.assert_allclose(grad_z, d_z, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(grad, d_ce + d_z, rtol=1e-5, atol=1e-8)
  assert np.abs(d_z).max() > 0.1 * np.abs(d_ce).max()  # the z term is not negligible here
  dlogits = d_ce + d_z
  np.testing.assert_allclose(grad_x, dlogits @ w.T, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(grad_w, np.einsum("bld,blv->dv", x, dlogits), rtol=1e-5,
                             atol=1e-8)
  # Off: the term is exactly 0, the cross-entropy unchanged.
  assert float(off.z_loss) == 0.0 and float(off.cross_entropy) == float(whole.cross_entropy)


def test_z_loss_in_chunks_equals_the_whole_logits_on_a_model():
  tokens_BxL1 = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
  results = []
  for chunks in (1, 4):
    config = config_lib.get_config("tiny,num_layers=2,d_model=32,num_heads=4,seq_len=16,"
                                   f"max_seq_len=16,z_loss={Z},loss_chunks={chunks}")
    graphdef, state = nnx.split(model_lib.build(config.model, seed=3))
    results.append(jax.value_and_grad(losses.params_loss(graphdef, with_terms=True),
                                      has_aux=True)(state, tokens_BxL1))
  ((loss, terms), grads), ((chunked_loss, chunked_terms), chunked_grads) = results
  assert float(terms.z_loss) > 1.0  # log Z ~ log 256 at init: the term is large
  np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
  for got, expected in zip(chunked_terms, terms):
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               chunked_grads, grads)


@pytest.mark.parametrize("z,accum", [(Z, 1), (Z, 2), (0.0, 1)])
def test_train_step_logs_both_terms_and_the_validation_loss_stays_cross_entropy(z, accum):
  config = config_lib.get_config(GPT2_PRE + f",z_loss={z},batch_size=4,grad_accum={accum}")
  setup = train.make_setup(config, jax.devices()[:1])
  state = train.init_state(setup)
  rng = np.random.default_rng(2)
  tokens = train.global_batch(setup, {"tokens": rng.integers(0, 256, (4, SEQ + 1))})
  cross_entropy = float(train.make_eval_step(setup)(state["params"], tokens))
  model = nnx.merge(setup.graphdef, state["params"])
  windows = np.asarray(tokens).reshape(4, SEQ + 1)
  logits = _np(model(jnp.asarray(windows[:, :-1])))
  expected_ce, log_z_sq, _, _ = _closed_form(logits, windows[:, 1:])
  _, step_metrics = train.make_train_step(setup)(state, tokens)
  values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  np.testing.assert_allclose(cross_entropy, expected_ce, rtol=1e-5)  # no z term in eval
  np.testing.assert_allclose(values["cross_entropy"], expected_ce, rtol=1e-5)
  if not z:  # off: the loss is the cross-entropy, and no z_loss column is logged
    assert "z_loss" not in values and values["loss"] == values["cross_entropy"]
    return
  np.testing.assert_allclose(values["z_loss"], z * log_z_sq, rtol=1e-5)
  np.testing.assert_allclose(values["loss"], values["cross_entropy"] + values["z_loss"],
                             rtol=1e-6)


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_z_loss_is_refused_naming_the_field(value):
  with pytest.raises(ValueError, match=r"^model\.z_loss=") as info:
    train.validate(config_lib.get_config(f"{GPT2_PRE},z_loss={value}"))
  assert "\n" not in str(info.value)


def test_z_loss_is_not_in_the_checkpoint_fingerprint():
  """Like train.lr, a term of the objective: a run can resume or branch with z-loss on."""
  base, changed = config_lib.get_base_config(), config_lib.get_base_config()
  changed.model.z_loss = 1e-4
  assert (checkpoint_lib.config_fingerprint(changed) ==
          checkpoint_lib.config_fingerprint(base))


# --- the figure ----------------------------------------------------------------------------


def test_mechanisms_figure_of_a_run_folder(tmp_path, capsys):
  with metrics.MetricsWriter(tmp_path, is_main_process=True) as writer:
    for step in (0, 25, 50):
      writer.write_scalars(step, {"loss": 5.0 - step / 50}, split="train")
      writer.write_scalars(step, {
          **{f"attn_logit_max/layer_{l:02d}": 1.0 + step * (l + 1) for l in range(3)},
          **{f"attn_entropy/layer_{l:02d}": 2.0 - step / 100 for l in range(3)},
          "logits/log_z_mean": 5.5 - step / 25, "logits/max": 0.5 + step}, split="layers")
  cli.run_report(str(tmp_path))  # `python -m geonorm_jax report RUN`
  figure = tmp_path / report.MECHANISMS_FILENAME
  assert figure.stat().st_size > 5000
  assert f"{tmp_path}: {figure}" in capsys.readouterr().out


def test_mechanisms_figure_draws_every_site_and_marks_the_spikes(tmp_path):
  """Each panel holds the series the run logged, the norm sites included, and each logged
  spike at step s is marked at t = s - 1 (the record of the parameters that step started from)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import figure as figure_lib  # pylint: disable=g-import-not-at-top
  sites = ("blocks.0.attn.in", "blocks.0.mlp.in", "final")
  with metrics.MetricsWriter(tmp_path, is_main_process=True) as writer:
    for step in (0, 10, 20):
      writer.write_scalars(step, {
          **{f"attn_logit_max/layer_{l:02d}": 1.0 + step * (l + 1) for l in range(2)},
          **{f"attn_entropy/layer_{l:02d}": 2.0 - step / 100 for l in range(2)},
          **{f"norm_input_rms/{site}": (i + 1) * 10.0 ** (step / 10) for i, site in
             enumerate(sites)},
          "logits/log_z_mean": 5.5 - step / 25, "logits/max": 0.5 + step}, split="layers")
    for step in (11, 17):
      writer.write_scalars(step, {"loss": 9.0, "loss_z": 7.0}, split="spikes")
  figure = figure_lib.Figure()
  logit_axes, entropy_axes, output_axes, norm_axes = report.draw_mechanisms(figure,
                                                                            str(tmp_path))
  def series(axes):
    return {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()
            if not line.get_label().startswith("_") and line.get_label() != "spike"}
  assert series(logit_axes) == {"layer 0": [1.0, 11.0, 21.0], "layer 1": [1.0, 21.0, 41.0]}
  assert series(output_axes)["mean log Z"] == [5.5, 5.1, 4.7]
  assert series(norm_axes) == {site: [(i + 1) * 1.0, (i + 1) * 10.0, (i + 1) * 100.0]
                               for i, site in enumerate(sites)}
  assert norm_axes.get_yscale() == "log"
  for axes in (logit_axes, entropy_axes, output_axes, norm_axes):
    marks = sorted(line.get_xdata()[0] for line in axes.get_lines()
                   if line.get_linestyle() == ":" and line.get_color() == "r")
    assert marks == [10, 16]
  assert "2 logged spikes" in figure._suptitle.get_text()  # pylint: disable=protected-access


def test_mechanisms_figure_refuses_a_run_without_them(tmp_path):
  with metrics.MetricsWriter(tmp_path, is_main_process=True) as writer:
    writer.write_scalars(0, {"residual_rms/layer_00": 1.0}, split="layers")
  with pytest.raises(ValueError, match=r"metrics.jsonl has no attn_logit_max.*"
                     r"train.layer_stats_every"):
    report.plot_mechanisms(str(tmp_path))
  assert not (tmp_path / report.MECHANISMS_FILENAME).exists()
