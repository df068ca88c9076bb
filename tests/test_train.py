"""The train step: sharded runs equal the single-device run; accumulation; paper sizes lower."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import sharding as sharding_lib
from geonorm_jax.training import compile_options
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import optim, train

SMALL = ("tiny,num_layers=2,d_model=32,num_heads=4,seq_len=32,max_seq_len=32,batch_size=16,"
         "train.progress_bar=false,warmup_steps=2,steps=10,lr=3e-3")


def _losses(config, devices, steps=3):
  setup = train.make_setup(config, devices)
  state = train.init_state(setup)
  step_fn = train.make_train_step(setup)
  iterator = data_lib.make_train_iterator(config)
  out = []
  for _ in range(steps):
    state, metrics = step_fn(state, train.global_batch(setup, next(iterator)))
    out.append(float(metrics["loss"]))
  return np.array(out), state


@pytest.fixture(scope="module")
def single_device_run():
  return _losses(config_lib.get_config(SMALL), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [pytest.param("data=8", marks=pytest.mark.slow),
                                  pytest.param("data=2,fsdp=4", marks=pytest.mark.slow),
                                  pytest.param("data=2,tensor=4", marks=pytest.mark.slow),
                                  "data=1,fsdp=2,tensor=4"])
def test_sharded_training_matches_single_device(mesh, single_device_run):
  expected, expected_state = single_device_run
  mesh_args = ",".join(f"mesh.{item}" for item in mesh.split(","))
  got, state = _losses(config_lib.get_config(SMALL + "," + mesh_args), jax.devices())
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  assert got[-1] < got[0]  # it trains
  # The parameters really are split over the devices the rules name.
  kernel = state["params"]["blocks"][0]["mlp"]["up"]["kernel"]
  shard_shape = kernel[...].addressable_shards[0].data.shape
  sizes = dict(item.split("=") for item in mesh.split(","))
  assert shard_shape == (32 // int(sizes.get("fsdp", 1)), 128 // int(sizes.get("tensor", 1)))
  np.testing.assert_allclose(jax.device_get(kernel[...]),
                             jax.device_get(expected_state["params"]["blocks"][0]["mlp"]["up"]
                                            ["kernel"][...]), rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_matches_full_batch(single_device_run):
  expected, _ = single_device_run
  got, _ = _losses(config_lib.get_config(SMALL + ",grad_accum=4"), jax.devices()[:1])
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_schedules():
  config = config_lib.get_config("tiny,steps=100,warmup_steps=10,lr=1.0,min_lr_ratio=0.1")
  cosine = optim.learning_rate_schedule(config.train)
  # Update t of the warmup runs at lr (t+1)/W: the first update already moves.
  assert float(cosine(0)) == pytest.approx(0.1) and float(cosine(4)) == pytest.approx(0.5)
  assert float(cosine(9)) == pytest.approx(1.0) and float(cosine(10)) == pytest.approx(1.0)
  assert float(cosine(55)) == pytest.approx(0.55, abs=1e-3)  # half way down the cosine
  assert float(cosine(100)) == pytest.approx(0.1)
  config.train.schedule = "wsd"
  config.train.decay_fraction = 0.2
  wsd = optim.learning_rate_schedule(config.train)
  assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(80)) == pytest.approx(1.0)
  assert float(wsd(90)) == pytest.approx(0.55) and float(wsd(100)) == pytest.approx(0.1)
  config.train.schedule, config.train.min_lr_ratio = "linear", 0.0  # SimpleGPT's: to zero
  linear = optim.learning_rate_schedule(config.train)
  assert float(linear(10)) == pytest.approx(1.0) and float(linear(55)) == pytest.approx(0.5)
  assert float(linear(100)) == pytest.approx(0.0, abs=1e-7)


def test_weight_decay_scope_all_decays_every_parameter():
  config = config_lib.get_config(SMALL)
  setup = train.make_setup(config, jax.devices()[:1])
  params = train.init_state(setup)["params"]
  masks = {scope: [bool(m) for m in jax.tree.leaves(optim._leaf_map(
      lambda path, scope=scope: optim._decays(path, False, scope), params))]
      for scope in optim.DECAY_SCOPES}
  assert all(masks["all"]) and not all(masks["matrices"]) and any(masks["matrices"])
  config.train.weight_decay_scope = "some"
  with pytest.raises(ValueError, match="train.weight_decay_scope"):
    optim.make_optimizer(config.train, params)


def test_weight_decay_mask_and_lr_multipliers():
  config = config_lib.get_config(SMALL + ",weight_decay=0.5,clip_norm=0,lr=0.1,"
                                 "lr_multipliers=attn\\.q=0.0")
  setup = train.make_setup(config, jax.devices()[:1])
  state = train.init_state(setup)
  zero_grads = jax.tree.map(jnp.zeros_like, state["params"])
  state["step"] = jnp.asarray(5)
  opt_state = setup.optimizer.init(state["params"])
  updates, _ = setup.optimizer.update(zero_grads, opt_state, state["params"])
  block = updates["blocks"][0]
  lr = float(setup.schedule(0))  # optax counts its own steps from 0
  # Zero gradients: only decoupled weight decay moves anything, and only matrices.
  assert float(jnp.abs(block["attn_in_norm"]["gain"][...]).max()) == 0.0
  assert float(jnp.abs(block["attn"]["k"]["bias"][...]).max()) == 0.0
  assert float(jnp.abs(updates["embed"][...]).max()) == 0.0  # decay_embeddings=False
  assert float(jnp.abs(updates["head"][...]).max()) == 0.0  # the untied head follows it
  np.testing.assert_allclose(block["attn"]["k"]["kernel"][...],
                             -lr * 0.5 * state["params"]["blocks"][0]["attn"]["k"]["kernel"][...],
                             rtol=1e-5, atol=1e-12)
  assert float(jnp.abs(block["attn"]["q"]["kernel"][...]).max()) == 0.0  # multiplier 0


@pytest.mark.parametrize("size,mesh", [("gpt2_1.5b", "mesh.fsdp=8,mesh.data=1"),
                                       ("llama2_7b", "mesh.fsdp=4,mesh.tensor=2,mesh.data=1"),
                                       ("llama3_8b", "mesh.fsdp=8,mesh.data=1"),
                                       ("geonorm_1.3b", "mesh.fsdp=8,mesh.data=1")])
@pytest.mark.slow  # lowers four billion-parameter train steps
def test_paper_sizes_lower_on_a_sharded_mesh(size, mesh):
  """The train step of each big config lowers with abstract inputs: no parameter allocated."""
  config = config_lib.get_config(f"{size},{mesh},seq_len=64,batch_size=8,train.progress_bar=false")
  setup = train.make_setup(config)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          setup.abstract_state, setup.state_shardings)
  tokens = jax.ShapeDtypeStruct((1, 8, 65), jnp.int32, sharding=setup.batch_sharding)
  lowered = train.make_train_step(setup).lower(abstract, tokens)
  lowered_text = lowered.as_text()
  assert "mhlo.num_partitions = 8" in lowered_text  # one SPMD program over all 8 devices
  assert "tensor<1x8x65xi32>" in lowered_text  # the global batch, as the step reads it
  embed_spec = setup.state_shardings["params"]["embed"].get_value().spec
  assert "fsdp" in str(embed_spec)  # the biggest matrix is split, so it would fit on a pod


@pytest.mark.parametrize("override,field", [
    ("batch_size=12,mesh.data=8", "data.batch_size"),
    ("seq_len=64", "data.seq_len"),
    ("grad_accum=3", "data.batch_size"),
    ("grad_accum=4,mesh.data=8", "micro-batches of 4"),
    ("schedule=step", "train.schedule"),
    ("mesh.data=3", "mesh"),
    ("mesh.rules=embed=pipeline", "mesh.rules"),
    ("lr_multipliers=(=2", "train.lr_multipliers"),
    ("data.source=builtin,vocab_size=100", "model.vocab_size"),
])
def test_bad_training_config_fails_before_compilation(override, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    train.validate(config_lib.get_config(SMALL + "," + override))


def test_missing_data_file_is_named():
  with pytest.raises(FileNotFoundError, match="no_such_file.txt"):
    train.validate(config_lib.get_config(SMALL + ",data.source=text,data.path=/tmp/no_such_file.txt"))


def test_unwritable_workdir_fails_before_training(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(OSError, match=str(blocker)):
    train.train(config_lib.get_config(SMALL), str(blocker / "run"))


def test_eval_step_averages_every_micro_batch():
  config = config_lib.get_config(SMALL)
  setup = train.make_setup(config, jax.devices()[:1])
  state = train.init_state(setup)
  tokens = train.global_batch(setup, next(data_lib.make_train_iterator(config)))
  full = float(train.make_eval_step(setup)(state["params"], tokens))
  accum_config = config_lib.get_config(SMALL + ",grad_accum=4")
  accum_setup = train.make_setup(accum_config, jax.devices()[:1])
  split = train.global_batch(accum_setup, {"tokens": np.asarray(tokens).reshape(16, -1)})
  assert split.shape[0] == 4
  np.testing.assert_allclose(float(train.make_eval_step(accum_setup)(state["params"], split)),
                             full, rtol=1e-6)


@pytest.mark.parametrize("tie", ["true", "false"])
def test_flops_per_token_counts_the_head_matmul_once(tie):
  config = config_lib.get_config(f"gpt2_124m,tie_embeddings={tie}")
  setup = train.make_setup(config, jax.devices()[:1])
  # GPT-2 124M: 85,056,000 block parameters + LayerNorms (38,400) + the 38.6M head matmul.
  blocks_and_norms = 124_439_808 - 50257 * 768 - 1024 * 768
  expected = 6 * (blocks_and_norms + 50257 * 768) + 12 * 12 * 768 * 1024
  assert train.flops_per_token(setup, 1024) == expected


def test_fsdp_keeps_each_devices_activations_to_its_own_rows(monkeypatch):
  """Per-device temporaries of the train step on 8 FSDP devices: with the model's activation
  constraints they shrink with the local batch; without them GSPMD kept the whole batch's
  activations on every device (results/bench/memory.md)."""
  config = config_lib.get_config(
      "tiny,num_layers=2,d_model=64,num_heads=4,seq_len=128,max_seq_len=128,batch_size=32,"
      "vocab_size=256,mesh.data=1,mesh.fsdp=8,train.progress_bar=false")

  def temporaries():
    setup = train.make_setup(config)
    abstract = train.sharded_abstract_state(setup)
    tokens = jax.ShapeDtypeStruct((1, 32, 129), jnp.int32, sharding=setup.batch_sharding)
    compiled = train.make_train_step(setup).lower(abstract, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  constrained = temporaries()
  monkeypatch.setattr(sharding_lib, "constrain", lambda x, logical_axes: x)
  monkeypatch.setattr(model_lib, "constrain", lambda x, logical_axes: x)
  unconstrained = temporaries()
  assert constrained < 0.5 * unconstrained, (constrained, unconstrained)


def test_cpu_step_keeps_the_geodesic_barriers_until_fusion():
  """compile_options keeps the optimization barriers of GeoNorm's update (two per update in
  the gradient: tangents in and out) in the compiled CPU step; XLA's default pipeline drops
  them all, and then fuses the gradient of every update into loops that recompute the later
  ones (GeoNorm 1.108x -> 1.061x Pre-LN's step, results/bench/train.json `barriers`)."""
  config = config_lib.get_config(SMALL + ",placement=geonorm")

  setup = train.make_setup(config, jax.devices()[:1])
  abstract = train.sharded_abstract_state(setup)
  tokens = jax.ShapeDtypeStruct((1, 16, 33), jnp.int32, sharding=setup.batch_sharding)

  def barriers(compiler_options=None):
    step = train.make_train_step(setup, compiler_options)
    return step.lower(abstract, tokens).compile().as_text().count("opt-barrier(")

  updates = 2 * config.model.num_layers
  assert compile_options.for_mesh(setup.mesh) == compile_options.KEEP_BARRIERS
  assert barriers() >= 2 * updates
  assert barriers(compiler_options={}) == 0
