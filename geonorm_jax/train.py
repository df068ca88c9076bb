"""Training: a sharded, jitted train step and the loop around it.

The state is a plain dict {step, params, opt_state} of arrays (params as an nnx.State), laid
out over the mesh by sharding.py and updated by one `jax.jit` with donated buffers. The loop
never blocks on the device: step t-1's metrics are read after step t is dispatched.
"""
import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from geonorm_jax import checkpoint as checkpoint_lib
from geonorm_jax import collapse
from geonorm_jax import config as config_lib
from geonorm_jax import data as data_lib
from geonorm_jax import hessian_callback
from geonorm_jax import losses, metrics, optim, placements
from geonorm_jax import model as model_lib
from geonorm_jax import sharding as sharding_lib
from geonorm_jax import spec as spec_lib


@dataclasses.dataclass
class Setup:
  """Everything that follows from a config before any array is allocated."""
  config: object
  spec: spec_lib.ModelSpec
  mesh: jax.sharding.Mesh
  rules: dict
  graphdef: object
  abstract_state: dict
  state_shardings: dict
  batch_sharding: jax.sharding.NamedSharding
  optimizer: optax.GradientTransformation
  schedule: object


def validate(config, num_devices=None):
  """Every config error, before any compilation: model, optimizer, mesh and data."""
  spec = spec_lib.resolve(config.model)
  optim.learning_rate_schedule(config.train)
  optim.parse_multipliers(config.train.lr_multipliers)
  rules = sharding_lib.parse_rules(config.mesh.rules)
  mesh_sizes = dict(zip(sharding_lib.MESH_AXES,
                        sharding_lib.mesh_shape(config.mesh, num_devices or jax.device_count())))
  dp = sharding_lib.data_parallel_size(mesh_sizes, rules)
  train = config.train
  for field in ("steps", "grad_accum", "eval_every", "eval_batches", "log_every"):
    if getattr(train, field) <= 0:
      raise ValueError(f"train.{field}={getattr(train, field)} must be positive")
  # Batch splits and seq_len against the model's positions are checked with the data.
  data_lib.validate_data_config(config, process_count=jax.process_count(), data_parallel_size=dp)
  return spec


def make_setup(config, devices=None):
  spec = validate(config, None if devices is None else len(devices))
  mesh = sharding_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.parse_rules(config.mesh.rules)
  graphdef, abstract_params = model_lib.abstract_params(spec)
  optimizer, schedule = optim.make_optimizer(
      config.train, abstract_params,
      weight_decay=placements.get_placement(spec.placement).weight_decay)
  abstract_state = {
      "step": jax.ShapeDtypeStruct((), jnp.int32),
      "params": abstract_params,
      "opt_state": jax.eval_shape(optimizer.init, abstract_params),
  }
  state_shardings = sharding_lib.tree_shardings(abstract_state, mesh, rules)
  batch_sharding = sharding_lib.batch_sharding(mesh, rules, ndim=3, batch_dim=1)
  return Setup(config, spec, mesh, rules, graphdef, abstract_state, state_shardings,
               batch_sharding, optimizer, schedule)


def init_state(setup, seed=None):
  """Parameters and optimizer state created directly in their shardings (no host copy)."""
  seed = setup.config.seed if seed is None else seed

  def init():
    params = nnx.state(model_lib.build(setup.spec, seed=seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": setup.optimizer.init(params)}
  return jax.jit(init, out_shardings=setup.state_shardings)()


def _accumulated_grads(graphdef, params, tokens_AxBxL1):
  """Mean loss and gradient over the A micro-batches, accumulated in a lax.scan."""
  grad_fn = jax.value_and_grad(losses.params_loss(graphdef))
  if tokens_AxBxL1.shape[0] == 1:
    return grad_fn(params, tokens_AxBxL1[0])

  def body(carry, tokens_BxL1):
    loss_sum, grad_sum = carry
    loss, grads = grad_fn(params, tokens_BxL1)
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (loss_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros(()), zeros), tokens_AxBxL1)
  count = tokens_AxBxL1.shape[0]
  return loss_sum / count, jax.tree.map(lambda g: g / count, grad_sum)


def make_train_step(setup):
  """jit(state, tokens_AxBxL1) -> (state, metrics), state donated, shardings pinned."""
  graphdef, optimizer, schedule = setup.graphdef, setup.optimizer, setup.schedule
  after_update = placements.get_placement(setup.spec.placement).after_update
  with_layer_stats = setup.config.train.layer_stats_every > 0

  def train_step(state, tokens_AxBxL1):
    params = state["params"]
    loss, grads = _accumulated_grads(graphdef, params, tokens_AxBxL1)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    if after_update is not None:  # e.g. nGPT's projection of every matrix onto the sphere
      new_params = after_update(new_params)
    step_metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                    "lr": schedule(state["step"])}
    if with_layer_stats:
      for layer, value in metrics.per_layer_norms(grads).items():
        step_metrics[f"grad_norm/{layer}"] = value
      for layer, value in metrics.update_ratio(updates, params).items():
        step_metrics[f"update_ratio/{layer}"] = value
    return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, step_metrics

  return jax.jit(train_step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(setup):
  """jit(params, tokens_AxBxL1) -> mean loss over all A micro-batches of the batch."""
  graphdef = setup.graphdef

  def eval_step(params, tokens_AxBxL1):
    loss_fn = losses.params_loss(graphdef)
    return jnp.mean(jax.lax.map(lambda t: loss_fn(params, t), tokens_AxBxL1))
  return jax.jit(eval_step, in_shardings=(setup.state_shardings["params"], setup.batch_sharding))


def make_stream_stats(setup):
  """jit(params, tokens) -> per-layer residual RMS / mean |x|, the angle each block turns, and
  the collapse diagnostics (collapse.py): token cosine, logit spread, DyT saturation.

  Measured on the first micro-batch only: a statistic, not a loss, so a sample suffices.
  """
  graphdef = setup.graphdef

  def stats(params, tokens_AxBxL1):
    model = nnx.merge(graphdef, params)
    logits, streams = model(tokens_AxBxL1[0, :, :-1], return_streams=True)
    out = metrics.residual_stats(streams)
    for index in range(len(streams) - 1):
      out[f"stream_angle/layer_{index:02d}"] = metrics.angle_between(streams[index],
                                                                      streams[index + 1])
    final_norm = model.final_norm
    head_input = streams[-1] if final_norm is None else final_norm(streams[-1])
    out["collapse/token_cosine"] = collapse.token_cosine(head_input)
    out["collapse/logit_spread"] = collapse.logit_spread(logits)
    if final_norm is not None and final_norm.alpha is not None:  # DyT
      out["collapse/tanh_saturated_final"] = collapse.tanh_saturated(streams[-1],
                                                                     final_norm.alpha[...])
      for index, block in enumerate(model.blocks):
        out[f"collapse/tanh_saturated_attn_in/layer_{index:02d}"] = collapse.tanh_saturated(
            streams[index], block.attn_in_norm.alpha[...])
    return out
  return jax.jit(stats, in_shardings=(setup.state_shardings["params"], setup.batch_sharding))


def global_batch(setup, local_batch):
  """This process's rows -> one global (A, B/A, L+1) array sharded over the replica axes."""
  tokens = np.asarray(local_batch["tokens"], np.int32)
  accum = setup.config.train.grad_accum
  local = tokens.reshape(accum, tokens.shape[0] // accum, tokens.shape[1])
  global_shape = (accum, setup.config.data.batch_size // accum, tokens.shape[1])
  return jax.make_array_from_process_local_data(setup.batch_sharding, local, global_shape)


def sharded_abstract_state(setup):
  """ShapeDtypeStructs carrying the target shardings: what a restore reads into."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      setup.abstract_state, setup.state_shardings)


def eval_batches(setup):
  """The fixed validation batches, as global arrays in the batch sharding."""
  dp = sharding_lib.data_parallel_size(setup.mesh.shape, setup.rules)
  return [global_batch(setup, batch)
          for batch in data_lib.make_eval_batches(setup.config, data_parallel_size=dp)]


def flops_per_token(setup, seq_len):
  """6N + 12 L d T, N the parameters that multiply (the setup's abstract params) as nanoGPT
  counts them: the lookups (learned positions, and the token embedding when the head is a
  separate matrix) do no matmul; a tied embedding is the head's matmul and counts."""
  spec = setup.spec
  lookups = spec.max_seq_len * spec.d_model if spec.backbone == "gpt2" else 0
  if not spec.tie_embeddings:
    lookups += spec.vocab_size * spec.d_model
  num_params = model_lib.count_params(setup.abstract_state["params"])
  return metrics.model_flops_per_token(num_params - lookups,
                                       spec.num_layers, spec.d_model, seq_len)


def _evaluate(eval_step, params, eval_arrays):
  return float(np.mean([float(eval_step(params, batch)) for batch in eval_arrays]))


def _resolved_config_text(config):
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


_PREEMPTION_POLL_STEPS = 10  # multi-process: a device all-gather, so not every step


class _Run:
  """The loop's bookkeeping: throughput window, pending metrics, last values."""

  def __init__(self, start_step):
    self.window_start = time.perf_counter()
    self.window_steps = 0
    self.tokens_per_s = float("nan")
    self.last_train_loss = float("nan")
    self.last_eval_loss = float("nan")
    self.start_step = start_step


def train(config, workdir):
  """Train (resuming from workdir's latest checkpoint) and return a summary dict."""
  sharding_lib.maybe_initialize_distributed(config.mesh)
  checkpoint_lib.check_writable(workdir)
  setup = make_setup(config)
  fingerprint = checkpoint_lib.config_fingerprint(config)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint, fingerprint)
  latest = ckpt.latest_step()
  if latest is not None:
    try:
      ckpt.check_compatible(latest, fingerprint)  # before anything is written to workdir
    except BaseException:
      ckpt.close()
      raise
  checkpoint_lib.save_config_json(workdir, config)
  writer = metrics.MetricsWriter(workdir)
  writer.write_text("config", _resolved_config_text(config))

  dp = sharding_lib.data_parallel_size(setup.mesh.shape, setup.rules)
  train_iter = data_lib.make_train_iterator(config, data_parallel_size=dp)
  if latest is None:
    state = init_state(setup)
  else:
    state, data_state = ckpt.restore(latest, sharded_abstract_state(setup))
    train_iter.set_state(data_state)
    writer.truncate_after(latest)
  start = int(state["step"])

  train_step = make_train_step(setup)
  eval_step = make_eval_step(setup)
  stream_stats = make_stream_stats(setup) if config.train.layer_stats_every > 0 else None
  hessian_every = config.train.hessian_every
  hessian_logger = hessian_callback.make_hessian_logger(setup) if hessian_every > 0 else None
  eval_arrays = eval_batches(setup)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(setup, config.data.seq_len)
  peak = metrics.device_peak_flops(jax.devices()[0].device_kind, config.model.dtype,
                                   config.train.peak_flops)
  bar = metrics.ProgressBar(config.train.steps, start_step=start,
                            enabled=config.train.progress_bar and jax.process_index() == 0)
  ckpt.install_sigterm_handler()
  run = _Run(start)
  monitor = collapse.CollapseMonitor()
  pending = None
  started = time.perf_counter()

  def log_train(step, step_metrics):
    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    run.last_train_loss = values["loss"]
    bar.update(step, values["loss"])
    if step % config.train.log_every == 0 or step == config.train.steps:
      now = time.perf_counter()
      if run.window_steps:
        run.tokens_per_s = run.window_steps * tokens_per_step / (now - run.window_start)
      run.window_start, run.window_steps = now, 0
      values["tokens_per_s"] = run.tokens_per_s
      values["mfu"] = metrics.mfu(run.tokens_per_s, flops, jax.device_count(), peak)
      writer.write_scalars(step, values)

  try:
    for step in range(start + 1, config.train.steps + 1):
      tokens = global_batch(setup, next(train_iter))
      if stream_stats is not None and (step - 1) % config.train.layer_stats_every == 0:
        layer_values = jax.device_get(stream_stats(state["params"], tokens))
        writer.write_scalars(step - 1, layer_values, split="layers")
        warning = monitor.update(step - 1, float(layer_values["collapse/token_cosine"]))
        if warning and jax.process_index() == 0:
          print(warning, flush=True)
      state, step_metrics = train_step(state, tokens)
      if hessian_logger is not None and step % hessian_every == 0:
        writer.write_scalars(step, hessian_logger(state, tokens, step), split="hessian")
      if pending is not None:
        log_train(*pending)  # step t-1's numbers, read while step t runs
      pending = (step, step_metrics)
      run.window_steps += 1
      if step % config.train.eval_every == 0 or step == config.train.steps:
        log_train(*pending)
        pending = None
        run.last_eval_loss = _evaluate(eval_step, state["params"], eval_arrays)
        writer.write_scalars(step, {"loss": run.last_eval_loss}, split="eval")
        run.window_start = time.perf_counter()  # keep eval time out of tokens/s
      ckpt.save(step, state, train_iter.get_state(), force=step == config.train.steps)
      # Every process must join the all-gather at the same steps, or the others hang.
      poll = jax.process_count() == 1 or step % _PREEMPTION_POLL_STEPS == 0
      if poll and ckpt.any_process_preempted():
        ckpt.save(step, state, train_iter.get_state(), force=True)
        break
    if pending is not None:
      log_train(*pending)
  finally:
    bar.close()
    ckpt.wait()
    ckpt.close()
    writer.close()
  final_step = int(state["step"])
  summary = {"final_step": final_step, "final_train_loss": run.last_train_loss,
             "final_eval_loss": run.last_eval_loss, "tokens_per_s": run.tokens_per_s,
             "wall_s": time.perf_counter() - started, "preempted": bool(ckpt.preempted),
             "collapse_step": monitor.first_step}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary


def _config_from_workdir(workdir):
  path = os.path.join(workdir, checkpoint_lib.CONFIG_FILENAME)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} a training run's workdir?")
  with open(path) as f:
    return config_lib.from_dict(json.load(f))


def restore_params(workdir, step=None, config=None):
  """(config, setup, params) of a checkpoint; the config comes from workdir/config.json."""
  config = _config_from_workdir(workdir) if config is None else config
  setup = make_setup(config)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint,
                                     checkpoint_lib.config_fingerprint(config))
  try:
    state, _ = ckpt.restore(step, sharded_abstract_state(setup))
  finally:
    ckpt.close()
  return config, setup, state


def load_model(workdir, step=None):
  """(config, NNX model) restored from a checkpoint."""
  config, setup, state = restore_params(workdir, step)
  return config, nnx.merge(setup.graphdef, state["params"])


def evaluate(config, workdir, step=None):
  """Validation loss of a saved checkpoint on the fixed validation batches."""
  config, setup, state = restore_params(workdir, step, config)
  loss = _evaluate(make_eval_step(setup), state["params"], eval_batches(setup))
  return {"step": int(state["step"]), "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50))}


def benchmark_tokens_per_s(config, steps):
  """Training tokens/s of `config` over `steps` steps after a warm-up step (for benchmarks)."""
  setup = make_setup(config)
  state = init_state(setup)
  step_fn = make_train_step(setup)
  it = data_lib.make_train_iterator(config)
  state, step_metrics = step_fn(state, global_batch(setup, next(it)))
  float(step_metrics["loss"])
  batches = [global_batch(setup, next(it)) for _ in range(steps)]
  start = time.perf_counter()
  for tokens in batches:
    state, step_metrics = step_fn(state, tokens)
  float(step_metrics["loss"])  # the last step's value exists only once every step has run
  return steps * config.data.batch_size * config.data.seq_len / (time.perf_counter() - start)
