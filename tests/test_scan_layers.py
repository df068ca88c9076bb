"""model.scan_layers: the stacked layout computes what the unrolled one does, trains the same,
refuses what it cannot do, and its checkpoints are told apart from the unrolled ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.interop import convert
from geonorm_jax.nn import init_rules, losses
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import checkpoint
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train

# Layer-dependent numbers each case exercises under the scan: GeoNorm's alpha_k (per block, and
# per sublayer with a clamp), LNS's 1/sqrt(l) with remat, nGPT's sublayer scales and unit q/k,
# SimpleNorm's depth-scaled init and QK-norm, DyT's per-site alpha; RoPE + GQA on llama,
# learned positions on gpt2. (Constants equal in every block, as DeepNorm's, stay static.)
CASES = [
    "placement=geonorm,geo_schedule=harmonic",
    "placement=lns,backbone=llama,remat=true",
    "placement=ngpt,backbone=llama",
    "placement=simplenorm,qk_norm=true",
    pytest.param("placement=geonorm,geo_schedule=linear_paper,geo_counter=sublayers,"
                 "geo_theta_max=0.5,backbone=llama", marks=pytest.mark.slow),
    # alpha_0 set apart from the defaults (the paper's table gives 1.0 everywhere at this
    # width): distinct values per site also catch a scan that mixes the sites up.
    pytest.param("placement=dyt,backbone=llama,dyt_alpha_attn=0.8,dyt_alpha_ffn=0.2,"
                 "dyt_alpha_final=0.2", marks=pytest.mark.slow),
]


def small(arg):
  # init_std 0.3: sublayer outputs large enough that every block's constants matter.
  return config_lib.get_config("tiny,num_layers=3,d_model=32,num_heads=4,num_kv_heads=2,"
                               "vocab_size=64,max_seq_len=16,init_std=0.3," + arg)


def both_layouts(arg, seed=5):
  """(unrolled model, scanned model holding the unrolled one's parameters, converted)."""
  unrolled = model_lib.build(small(arg).model, seed=seed)
  scanned_graphdef, _ = model_lib.abstract_params(small(arg + ",scan_layers=true").model)
  scanned = nnx.merge(scanned_graphdef, convert.stack_layers(nnx.state(unrolled)))
  return unrolled, scanned


def _tokens(shape=(2, 9), seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, shape), jnp.int32)


def _forward_and_gradients(model, tokens):
  """Logits, streams, loss, parameter gradients (unrolled layout), gradients at two taps."""
  graphdef, params = nnx.split(model)
  like = jnp.zeros((tokens.shape[0], tokens.shape[1] - 1, model.spec.d_model), jnp.float32)
  taps = {"blocks.1.attn.q.in": like, "blocks.2.input": like}

  @jax.jit
  def run(params, taps):
    def loss_fn(params, taps):
      return losses.lm_loss(nnx.merge(graphdef, params), tokens, perturb=taps)
    loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, taps)
    logits, streams = nnx.merge(graphdef, params)(tokens[:, :-1], return_streams=True)
    return logits, streams, loss, grads
  logits, streams, loss, (grads, tap_grads) = run(params, taps)
  if model.spec.scan_layers:
    grads = convert.unstack_layers(grads)
  return logits, streams, loss, grads, tap_grads


@pytest.mark.parametrize("arg", CASES)
def test_same_parameters_give_the_same_logits_loss_and_gradients(arg):
  unrolled, scanned = both_layouts(arg)
  tokens = _tokens()
  logits_u, streams_u, loss_u, grads_u, taps_u = _forward_and_gradients(unrolled, tokens)
  logits_s, streams_s, loss_s, grads_s, taps_s = _forward_and_gradients(scanned, tokens)
  np.testing.assert_allclose(logits_s, logits_u, rtol=1e-5, atol=1e-5)
  assert len(streams_s) == len(streams_u) == 4
  for stream_s, stream_u in zip(streams_s, streams_u):
    np.testing.assert_allclose(stream_s, stream_u, rtol=1e-5, atol=1e-5)
  # The blocks change the stream, so equal logits are not the embedding's alone.
  assert float(jnp.abs(streams_u[3] - streams_u[0]).max()) > 1e-2
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  flat_u = dict(nnx.to_flat_state(grads_u))
  flat_s = dict(nnx.to_flat_state(grads_s))
  assert flat_u.keys() == flat_s.keys()
  for path, grad_u in flat_u.items():
    np.testing.assert_allclose(flat_s[path][...], grad_u[...], rtol=1e-4, atol=1e-6,
                               err_msg=str(path))
  for name, tap_grad in taps_u.items():
    assert float(jnp.abs(tap_grad).max()) > 0, name
    np.testing.assert_allclose(taps_s[name], tap_grad, rtol=1e-4, atol=1e-7, err_msg=name)


def test_a_seed_gives_the_same_parameters_in_both_layouts():
  arg = "placement=simplenorm,backbone=llama"  # depth-scaled init: block l's std differs
  unrolled = nnx.state(model_lib.build(small(arg).model, seed=3))
  scanned = nnx.state(model_lib.build(small(arg + ",scan_layers=true").model, seed=3))
  assert jax.tree.structure(convert.stack_layers(unrolled)) == jax.tree.structure(scanned)
  for a, b in zip(jax.tree.leaves(convert.stack_layers(unrolled)), jax.tree.leaves(scanned)):
    np.testing.assert_array_equal(a, b)
  # And the stacked kernels carry the layer axis in their logical names.
  kernel = dict(nnx.to_flat_state(scanned))[("blocks", "attn", "q", "kernel")]
  assert kernel.get_metadata()["logical_axes"] == ("layers", "embed", "heads")
  assert kernel.shape == (3, 32, 32)


def test_conversion_round_trips_and_refuses_the_wrong_layout():
  unrolled = nnx.state(model_lib.build(small("placement=pre").model, seed=1))
  back = convert.unstack_layers(convert.stack_layers(unrolled))
  assert jax.tree.structure(back) == jax.tree.structure(unrolled)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="not in the scan_layers layout"):
    convert.unstack_layers(unrolled)
  with pytest.raises(ValueError, match="already stacked"):
    convert.stack_layers(convert.stack_layers(unrolled))


def test_ngpt_projection_normalises_each_stacked_matrix_as_its_own():
  unrolled = nnx.state(model_lib.build(small("placement=ngpt").model, seed=2))
  noisy = jax.tree.map(lambda x: x * 1.7 + 0.01, unrolled)
  expected = convert.stack_layers(init_rules.normalize_ngpt_weights(noisy))
  got = init_rules.normalize_ngpt_weights(convert.stack_layers(noisy))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # nGPT's per-sublayer alpha (a vector, stacked to a matrix) must not be projected.
  alpha = dict(nnx.to_flat_state(got))[("blocks", "attn_alpha", "scale")]
  np.testing.assert_allclose(alpha[...], 1.7 * 32 ** -0.5 + 0.01, rtol=1e-6)


def _train_config(arg):
  return config_lib.get_config(
      "tiny,num_layers=3,d_model=32,num_heads=4,seq_len=16,batch_size=8,steps=3,lr=3e-3,"
      "init_std=0.3,"
      "warmup_steps=1,layer_stats_every=1," + arg)


def test_training_steps_give_the_same_losses_and_statistics():
  results = {}
  for layout in ("false", "true"):
    setup = train.make_setup(_train_config(f"placement=geonorm,scan_layers={layout}"),
                             jax.devices()[:1])
    state = train.init_state(setup)
    step = train.make_train_step(setup)
    rng = np.random.default_rng(0)
    history = []
    for _ in range(3):
      tokens = train.global_batch(setup, {"tokens": rng.integers(0, 256, (8, 17))})
      state, step_metrics = step(state, tokens)
      history.append(jax.device_get(step_metrics))
    # The per-layer stream statistics (and collapse diagnostics) on the trained state.
    history.append(jax.device_get(train.make_stream_stats(setup)(state["params"], tokens)))
    results[layout] = history
  assert "grad_norm/layer_02" in results["true"][0]
  assert "update_ratio/layer_02" in results["true"][0]
  assert "stream_angle/layer_02" in results["true"][-1]
  for unrolled, scanned in zip(results["false"], results["true"]):
    assert unrolled.keys() == scanned.keys()
    for name, value in unrolled.items():
      # GPT-2's key bias b_k adds q.b_k to all of a query's scores, which softmax ignores: its
      # gradient is float noise, which Adam turns into lr-sized steps that differ between the
      # layouts (0.1% of the max logit here, the layouts' only visible difference).
      rtol = 2e-3 if name.startswith("attn_logit_max/") else 2e-4
      np.testing.assert_allclose(scanned[name], value, rtol=rtol, atol=1e-6, err_msg=name)


def test_a_block_of_the_stacked_model_reads_as_the_unrolled_block():
  unrolled, scanned = both_layouts("placement=dyt")
  for index in range(3):
    for a, b in zip(jax.tree.leaves(nnx.state(scanned.block(index))),
                    jax.tree.leaves(nnx.state(unrolled.block(index)))):
      np.testing.assert_array_equal(a, b)
  assert unrolled.block(1) is unrolled.blocks[1]


def test_what_the_scan_cannot_run_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"model.scan_layers=true .*model.placement=mixln"):
    spec_lib.resolve(small("placement=mixln,scan_layers=true,num_layers=8").model)
  # A Mix-LN whose blocks are all alike scans fine.
  spec_lib.resolve(small("placement=mixln,scan_layers=true,mixln_fraction=0").model)
  config = _train_config("scan_layers=true,hessian_every=1,hessian_per_block=true")
  with pytest.raises(ValueError, match="train.hessian_per_block"):
    train.validate(config, num_devices=1)


def test_a_checkpoint_of_the_other_layout_is_refused_with_the_conversion_named(tmp_path):
  unrolled_config, scanned_config = small("placement=pre"), small("placement=pre,scan_layers=true")
  params = nnx.state(model_lib.build(scanned_config.model))
  ckpt_config = config_lib.get_base_config().checkpoint
  with checkpoint.Checkpointer(tmp_path, ckpt_config,
                               checkpoint.config_fingerprint(scanned_config)) as saver:
    saver.save(1, {"params": params}, None, force=True)
  expected = checkpoint.config_fingerprint(unrolled_config)
  with checkpoint.Checkpointer(tmp_path, ckpt_config, expected) as loader:
    with pytest.raises(checkpoint.IncompatibleCheckpointError) as error:
      loader.restore(None, {"params": nnx.state(model_lib.build(unrolled_config.model))})
  message = str(error.value)
  assert "model.scan_layers: checkpoint=True, current=False" in message
  assert "convert.stack_layers" in message
