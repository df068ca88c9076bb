"""The angle each sublayer turns the residual stream (train.make_stream_stats:
`sublayer_angle/{attn,mlp}/layer_XX`, mean over tokens, and `sublayer_angle_max/...`).

For GeoNorm they are the geodesic angle taken, theta = alpha_k |v|/|x| (clamped by
geo_theta_max), computed here again in float64 from the model's own tensors; for Pre-LN the two
sublayers' angles add up to at least the block's (the triangle inequality on the sphere of
directions) and a sublayer whose output is zero turns nothing; a statistic of the wrong thing
(the block, the other sublayer, the mean for the max, the unclamped angle) fails these checks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import model as model_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, train

NUM_LAYERS = 2
TOL = 1e-5  # radians
SUBLAYERS = ("attn", "mlp")


def _key(sublayer, index, statistic="sublayer_angle"):
  return f"{statistic}/{sublayer}/layer_{index:02d}"


def _setup(arg):
  config = config_lib.get_config(
      f"tiny,num_layers={NUM_LAYERS},d_model=32,num_heads=4,seq_len=16,batch_size=4," + arg)
  setup = train.make_setup(config, jax.devices()[:1])
  params = train.init_state(setup)["params"]
  tokens = train.global_batch(setup, {"tokens": np.random.default_rng(0).integers(0, 256,
                                                                                  (4, 17))})
  return setup, params, tokens


def _stats(setup, params, tokens):
  values = jax.device_get(train.make_stream_stats(setup)(params, tokens))
  return {name: float(value) for name, value in values.items()}


def _geodesic_angles(setup, params, tokens):
  """{(sublayer, index): (theta, theta taken) per token}, in float64 numpy from the model's own
  streams and sublayer outputs F(N(x)); also checks that the stream after each sublayer is
  the geodesic step by the angle taken."""
  spec = setup.spec
  model = nnx.merge(setup.graphdef, params)
  _, streams, midstreams = model(tokens[0, :, :-1], return_sublayer_streams=True)
  theta_max = spec.option("geo_theta_max")
  angles = {}
  for index in range(spec.num_layers):
    block = model.block(index)
    alpha_k = spec.option("geo_alpha") / (index + 1)  # harmonic schedule, k counts blocks
    for sublayer, before, after in (("attn", streams[index], midstreams[index]),
                                    ("mlp", midstreams[index], streams[index + 1])):
      norm, function = getattr(block, f"{sublayer}_in_norm"), getattr(block, sublayer)
      g = np.asarray(function(norm(before)), np.float64)
      x = np.asarray(before, np.float64)
      x_norm = np.linalg.norm(x, axis=-1, keepdims=True)
      v = g - np.sum(x * g, axis=-1, keepdims=True) / x_norm ** 2 * x
      v_norm = np.linalg.norm(v, axis=-1, keepdims=True)
      theta = alpha_k * v_norm / x_norm
      taken = np.minimum(theta, theta_max) if theta_max else theta
      stepped = np.cos(taken) * x + x_norm * np.sin(taken) * v / v_norm
      np.testing.assert_allclose(np.asarray(after, np.float64), stepped,
                                 atol=TOL * float(x_norm.max()), rtol=0)
      angles[sublayer, index] = (theta[..., 0], taken[..., 0])
  return angles


def _assert_angles(stats, angles):
  for (sublayer, index), (_, taken) in angles.items():
    np.testing.assert_allclose(stats[_key(sublayer, index)], taken.mean(), atol=TOL, rtol=0,
                               err_msg=_key(sublayer, index))
    np.testing.assert_allclose(stats[_key(sublayer, index, "sublayer_angle_max")], taken.max(),
                               atol=TOL, rtol=0, err_msg=_key(sublayer, index, "max"))


def _passes(stats, angles):
  try:
    _assert_angles(stats, angles)
  except AssertionError:
    return False
  return True


@pytest.fixture(scope="module")
def geonorm():
  """(stats, angles) of a GeoNorm model at init, alpha = 3."""
  setup, params, tokens = _setup("placement=geonorm,geo_alpha=3")
  return _stats(setup, params, tokens), _geodesic_angles(setup, params, tokens)


THETA_MAX = 5e-4  # below every token's theta at init (the smallest is ~1.1e-3)


@pytest.fixture(scope="module")
def geonorm_clamped():
  setup, params, tokens = _setup(f"placement=geonorm,geo_alpha=3,geo_theta_max={THETA_MAX}")
  return _stats(setup, params, tokens), _geodesic_angles(setup, params, tokens)


def test_geonorm_sublayer_angles_are_the_geodesic_angles(geonorm):
  stats, angles = geonorm
  assert set(angles) == {(s, i) for s in SUBLAYERS for i in range(NUM_LAYERS)}
  _assert_angles(stats, angles)


def test_geonorm_sublayer_angles_under_a_small_clamp_are_the_clamp(geonorm_clamped):
  stats, angles = geonorm_clamped
  for (sublayer, index), (theta, _) in angles.items():
    assert theta.min() > THETA_MAX, (sublayer, index)  # every token's step is clamped
    np.testing.assert_allclose(stats[_key(sublayer, index)], THETA_MAX, atol=TOL, rtol=0)
    np.testing.assert_allclose(stats[_key(sublayer, index, "sublayer_angle_max")], THETA_MAX,
                               atol=TOL, rtol=0)
  _assert_angles(stats, angles)


def test_wrong_angle_statistics_fail_the_checks(geonorm, geonorm_clamped):
  """What an implementation that measured the wrong thing would log does not pass."""
  stats, angles = geonorm

  def replaced(new_value):
    wrong = dict(stats)
    for sublayer in SUBLAYERS:
      for index in range(NUM_LAYERS):
        for statistic in ("sublayer_angle", "sublayer_angle_max"):
          wrong[_key(sublayer, index, statistic)] = new_value(sublayer, index, statistic)
    return wrong

  other = {"attn": "mlp", "mlp": "attn"}
  wrong_ones = {
      "the block's angle": replaced(lambda s, i, _: stats[f"stream_angle/layer_{i:02d}"]),
      "the other sublayer": replaced(lambda s, i, statistic: stats[_key(other[s], i, statistic)]),
      "the mean as the max": replaced(lambda s, i, _: stats[_key(s, i)]),
      "the next block's": replaced(lambda s, i, statistic: stats[
          _key(s, (i + 1) % NUM_LAYERS, statistic)]),
  }
  assert _passes(stats, angles)
  for name, wrong in wrong_ones.items():
    assert not _passes(wrong, angles), name
  # Clamped: the unclamped theta is not what the model logs, nor what it takes.
  clamped_stats, clamped_angles = geonorm_clamped
  unclamped = {key: (theta, theta) for key, (theta, _) in clamped_angles.items()}
  assert not _passes(clamped_stats, unclamped)


def _pre_ln(zeroed=()):
  """Stats of a Pre-LN model at init with the output matrix of each (sublayer, block index) in
  `zeroed` set to zero, so that sublayer adds nothing to the stream."""
  setup, params, tokens = _setup("placement=pre,init_std=0.1")
  model = nnx.merge(setup.graphdef, params)
  for sublayer, index in zeroed:
    module = getattr(model.blocks[index], sublayer)
    linear = module.o if sublayer == "attn" else module.down
    for variable in (linear.kernel, linear.bias):
      if variable is not None:
        variable[...] = jnp.zeros_like(variable[...])
  return _stats(setup, nnx.state(model), tokens)


def test_pre_ln_sublayer_angles_obey_the_triangle_inequality():
  stats = _pre_ln()
  for index in range(NUM_LAYERS):
    attn, mlp = stats[_key("attn", index)], stats[_key("mlp", index)]
    block = stats[f"stream_angle/layer_{index:02d}"]
    assert attn > 1e-3 and mlp > 1e-3
    assert attn + mlp >= block - 1e-6, (index, attn, mlp, block)
    for sublayer in SUBLAYERS:
      assert stats[_key(sublayer, index, "sublayer_angle_max")] >= stats[_key(sublayer, index)]


def test_pre_ln_a_sublayer_that_outputs_zero_turns_nothing():
  stats = _pre_ln(zeroed=(("attn", 0), ("mlp", 1)))
  for sublayer, index, moving in (("attn", 0, "mlp"), ("mlp", 1, "attn")):
    # 0 up to float32 rounding (x and x + 0 normalised in two fusions differ in the last bit).
    assert stats[_key(sublayer, index)] < 1e-6
    assert stats[_key(sublayer, index, "sublayer_angle_max")] < 1e-6
    # The block's turn is then all the other sublayer's, and it is not nothing.
    block = stats[f"stream_angle/layer_{index:02d}"]
    assert block > 1e-3
    np.testing.assert_allclose(stats[_key(moving, index)], block, atol=1e-6, rtol=0)


def test_token_angles_mean_and_max():
  angles = np.array([0.0, 1e-4, 0.3, 2.0, np.pi])
  x = np.zeros((5, 8), np.float32)
  x[:, 0] = 2.0
  y = np.zeros((5, 8), np.float32)
  y[:, 0], y[:, 3] = 3.0 * np.cos(angles), 3.0 * np.sin(angles)
  np.testing.assert_allclose(metrics.token_angles(x, y), angles, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics.max_angle_between(x, y), np.pi, rtol=1e-6)
  np.testing.assert_allclose(metrics.angle_between(x, y), angles.mean(), rtol=1e-6)
  # A zero vector has no direction: angle 0, also in the max.
  zero = metrics.token_angles(np.zeros((2, 3, 8)), np.ones((2, 3, 8)))
  assert zero.shape == (2, 3) and float(jnp.max(zero)) == 0.0


@pytest.mark.parametrize("layout", ["remat=true", "scan_layers=true",
                                    "scan_layers=true,remat=true"])
def test_sublayer_streams_are_the_same_in_every_layout(layout):
  def forward(arg):
    config = config_lib.get_config(f"tiny,num_layers=3,d_model=32,num_heads=4,max_seq_len=16,"
                                   f"placement=geonorm,geo_alpha=3,{arg}")
    model = model_lib.build(config.model, seed=1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 9)), jnp.int32)
    return model(tokens, return_sublayer_streams=True), model(tokens, return_streams=True)
  (logits, streams, midstreams), (plain_logits, plain_streams) = forward("")
  assert len(streams) == 4 and len(midstreams) == 3
  np.testing.assert_array_equal(logits, plain_logits)  # asking for more changes nothing
  for got, expected in zip(streams, plain_streams):
    np.testing.assert_array_equal(got, expected)
  (other_logits, other_streams, other_midstreams), _ = forward(layout)
  np.testing.assert_allclose(other_logits, logits, rtol=1e-5, atol=1e-5)
  for got, expected in zip(other_streams + other_midstreams, streams + midstreams):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  # The midstream lies strictly between: neither the block's input nor its output.
  for index in range(3):
    assert float(jnp.max(jnp.abs(midstreams[index] - streams[index]))) > 1e-4
    assert float(jnp.max(jnp.abs(midstreams[index] - streams[index + 1]))) > 1e-4
