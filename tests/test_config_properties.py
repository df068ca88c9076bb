"""Property tests over configs (hypothesis): placement x backbone x sizes x dtype x dt x qk_norm
x z_loss x optimizer fields. Every valid config trains to a finite loss; every invalid value is refused
by validate, before compilation, with an error that starts with the field's name."""
import hypothesis
import jax
import numpy as np
import pytest

from geonorm_jax.data import windows as data_lib
from geonorm_jax.training import compile_options
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train as train_lib

st = hypothesis.strategies


def _config(extra=""):
  return config_lib.get_config(
      "tiny,num_layers=2,d_model=32,num_heads=2,seq_len=16,max_seq_len=16,batch_size=8,"
      "train.progress_bar=false,train.steps=30,train.warmup_steps=3" + (f",{extra}" if extra else ""))



@st.composite
def _valid_configs(draw):
  from geonorm_jax.nn import placements  # pylint: disable=g-import-not-at-top
  backbone = draw(st.sampled_from(["gpt2", "llama"]))
  num_heads = draw(st.sampled_from([1, 2]))
  head_dim = draw(st.sampled_from([8, 16]))  # even, as RoPE needs
  config = config_lib.get_config(
      "tiny,num_layers=1,seq_len=8,max_seq_len=8,batch_size=2,train.progress_bar=false,"
      "train.steps=10,train.warmup_steps=2")
  config.model.update(dict(
      backbone=backbone, placement=draw(st.sampled_from(sorted(placements.PLACEMENTS))),
      num_layers=1, d_model=num_heads * head_dim, num_heads=num_heads,
      dtype=draw(st.sampled_from(["float32", "bfloat16"])),
      dt=draw(st.floats(0.05, 1.0)), qk_norm=draw(st.booleans()),
      z_loss=draw(st.sampled_from([0.0, 1e-4, 0.1]))))
  config.train.update(dict(
      lr=draw(st.floats(1e-5, 1e-2)), b1=draw(st.floats(0.0, 0.99)),
      b2=draw(st.floats(0.0, 0.999)), weight_decay=draw(st.floats(0.0, 0.5)),
      clip_norm=draw(st.sampled_from([0.0, 0.5, 1.0])),
      min_lr_ratio=draw(st.floats(0.0, 1.0))))
  return config


# Each example compiles a train step (seconds on a 2-core CPU): a few examples per run, drawn
# deterministically, cover the grid over time as the strategy changes.
@hypothesis.settings(max_examples=4, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(_valid_configs())
def test_property_every_valid_config_trains_to_a_finite_loss(config):
  train_lib.validate(config, num_devices=1)
  setup = train_lib.make_setup(config, jax.devices()[:1])
  state = train_lib.init_state(setup)
  # The trainer's step and XLA options, with LLVM's optimization passes off: a third less
  # compile time per example; a finite loss does not hang on how the CPU code is optimized.
  step_fn = train_lib.make_train_step(setup, compiler_options={
      **compile_options.for_mesh(setup.mesh), "xla_backend_optimization_level": 0})
  iterator = data_lib.make_train_iterator(config)
  for _ in range(2):  # the second loss is after one update
    state, step_metrics = step_fn(state, train_lib.global_batch(setup, next(iterator)))
    assert np.isfinite(float(step_metrics["loss"])), config.model
    assert float(step_metrics["nonfinite"]) == 0.0


# field -> values that no run can use
_INVALID = {
    "train.lr": st.sampled_from([0.0, -1.0, float("nan"), float("inf")]),
    "train.steps": st.integers(-5, 0),
    "train.b1": st.one_of(st.floats(1.0, 10.0), st.floats(-10.0, -1e-3)),
    "train.b2": st.one_of(st.floats(1.0, 10.0), st.floats(-10.0, -1e-3)),
    "train.weight_decay": st.floats(-10.0, -1e-3),
    "train.clip_norm": st.floats(-10.0, -1e-3),
    "train.min_lr_ratio": st.one_of(st.floats(-10.0, -1e-3), st.floats(1.001, 10.0)),
    "train.hessian_every": st.integers(-5, -1),
    "train.spike_zscore": st.floats(-10.0, -1e-3),
    "train.spike_warmup": st.one_of(st.integers(-5, 1), st.integers(129, 1000)),
    "checkpoint.every": st.integers(-5, -1),
    "checkpoint.keep_last": st.integers(-5, -1),
    "checkpoint.keep_every": st.integers(-5, -1),
    "model.geo_alpha": st.floats(-10.0, 0.0),
    "model.ngpt_alpha_init": st.floats(-10.0, 0.0),
    "model.rope_theta": st.floats(-1e4, 0.0),
    "model.dt": st.floats(-10.0, 0.0),
    "model.d_model": st.integers(-4, 0),
    "model.z_loss": st.one_of(st.floats(-10.0, -1e-6),
                              st.sampled_from([float("nan"), float("inf")])),
}


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(st.sampled_from(sorted(_INVALID)).flatmap(
    lambda field: st.tuples(st.just(field), _INVALID[field])))
def test_property_every_invalid_value_is_refused_naming_its_field(field_and_value):
  field, value = field_and_value
  config = _config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ValueError) as info:
    train_lib.validate(config)
  assert str(info.value).startswith(f"{field}="), (field, value, str(info.value))
