"""Training: a sharded, jitted train step and the loop around it.

The state is a plain dict {step, params, opt_state} of arrays (params as an nnx.State), laid
out over the mesh by sharding.py and updated by one `jax.jit` with donated buffers. The loop
never blocks on the device: step t-1's metrics are read after step t is dispatched, except at
eval and checkpoint steps, where the step's own numbers are read first so that a non-finite
state is never saved.

Divergence (a non-finite loss or gradient norm) follows `train.on_divergence`: `stop` raises
DivergenceError naming the step with its per-layer gradient norms; `skip` drops the update
inside the jitted step (parameters and optimizer state unchanged, step counter and data
advance) and counts it.
"""
import collections
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import losses, placements
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import sharding as sharding_lib
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import collapse
from geonorm_jax.training import compile_options
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, optim, tracking
from geonorm_jax.training import validate as validate_lib


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


class DivergenceError(RuntimeError):
  """train.on_divergence=stop met a non-finite loss or gradient; nothing after the last
  finite checkpoint was saved."""

  def __init__(self, message, step):
    super().__init__(message)
    self.step = step


def validate(config, num_devices=None):
  """Every config error, before any compilation: fields, model, optimizer, mesh and data."""
  validate_lib.check_fields(config)
  tracking.check_installed(config.train)
  spec = spec_lib.resolve(config.model)
  if config.data.seq_len % spec.loss_chunks:
    raise ValueError(f"model.loss_chunks={spec.loss_chunks} does not divide "
                     f"data.seq_len={config.data.seq_len}")
  if spec.scan_layers and config.train.hessian_per_block:
    raise ValueError("train.hessian_per_block=true selects each block's parameters by name "
                     "(blocks.<i>.), which model.scan_layers=true stacks into one array; "
                     "set one of them to false")
  optim.learning_rate_schedule(config.train)
  optim.parse_multipliers(config.train.lr_multipliers)
  rules = sharding_lib.parse_rules(config.mesh.rules)
  mesh_sizes = dict(zip(sharding_lib.MESH_AXES,
                        sharding_lib.mesh_shape(config.mesh, num_devices or jax.device_count())))
  dp = sharding_lib.data_parallel_size(mesh_sizes, rules)
  # Batch splits and seq_len against the model's positions are checked with the data.
  try:
    data_lib.validate_data_config(config, process_count=jax.process_count(),
                                  data_parallel_size=dp)
  except (ValueError, FileNotFoundError):
    raise
  except Exception as e:  # pylint: disable=broad-except
    # An unreadable or malformed file fails deep inside a reader (grain, array_record,
    # numpy) with a message that names neither the field nor the file.
    raise ValueError(f"data.path={config.data.path!r} (data.source={config.data.source}) "
                     f"cannot be read: {type(e).__name__}: {e}") from e
  return spec


def make_setup(config, devices=None):
  spec = validate(config, None if devices is None else len(devices))
  mesh = sharding_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.parse_rules(config.mesh.rules)
  graphdef, abstract_params = model_lib.abstract_params(spec)
  optimizer, schedule = optim.make_optimizer(
      config.train, abstract_params,
      weight_decay=spec.placement.weight_decay)
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
  if jax.default_backend() != "gpu":
    return jax.jit(init, out_shardings=setup.state_shardings)()
  # XLA inlines every threefry call on a GPU: GPT-2 124M's init compiled for 3 min; the
  # threefry kernel (same bits) compiles in seconds (results/bench/accelerator_nvidia_h200.json).
  previous = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  try:
    return jax.jit(init, out_shardings=setup.state_shardings)()
  finally:
    jax.config.update("jax_threefry_gpu_kernel_lowering", previous)


def _accumulated_grads(graphdef, params, tokens_AxBxL1):
  """(mean loss, its losses.LossTerms) and gradient over the A micro-batches, accumulated in
  a lax.scan."""
  grad_fn = jax.value_and_grad(losses.params_loss(graphdef, with_terms=True), has_aux=True)
  if tokens_AxBxL1.shape[0] == 1:
    return grad_fn(params, tokens_AxBxL1[0])

  def body(carry, tokens_BxL1):
    sums, grad_sum = carry
    loss_and_terms, grads = grad_fn(params, tokens_BxL1)
    return (jax.tree.map(jnp.add, sums, loss_and_terms),
            jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  no_loss = (jnp.zeros(()), losses.LossTerms(jnp.zeros(()), jnp.zeros(())))
  (sums, grad_sum), _ = jax.lax.scan(body, (no_loss, zeros), tokens_AxBxL1)
  count = tokens_AxBxL1.shape[0]
  return (jax.tree.map(lambda s: s / count, sums),
          jax.tree.map(lambda g: g / count, grad_sum))


def make_train_step(setup, compiler_options=None):
  """jit(state, tokens_AxBxL1) -> (state, metrics), state donated, shardings pinned.

  compiler_options: XLA's options for the step; None means compile_options.for_mesh."""
  if compiler_options is None:
    compiler_options = compile_options.for_mesh(setup.mesh)
  graphdef, optimizer, schedule = setup.graphdef, setup.optimizer, setup.schedule
  after_update = setup.spec.placement.after_update
  with_layer_stats = setup.config.train.layer_stats_every > 0
  skip_nonfinite = setup.config.train.on_divergence == "skip"
  with_z_loss = setup.spec.z_loss > 0
  layer_norms = functools.partial(_per_layer_norms, scan_layers=setup.spec.scan_layers)

  def train_step(state, tokens_AxBxL1):
    params = state["params"]
    with sharding_lib.activation_sharding(setup.mesh, setup.rules):
      (loss, terms), grads = _accumulated_grads(graphdef, params, tokens_AxBxL1)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    if after_update is not None:  # e.g. nGPT's projection of every matrix onto the sphere
      new_params = after_update(new_params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
      # An elementwise select that XLA fuses into the update: no host round trip, and the
      # same decision on every device since loss and grad_norm are replicated.
      keep = lambda new, old: jnp.where(finite, new, old)
      new_params = jax.tree.map(keep, new_params, params)
      opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
    step_metrics = {"loss": loss, "grad_norm": grad_norm,
                    "lr": schedule(state["step"]),
                    "nonfinite": 1.0 - finite.astype(jnp.float32),
                    # `loss` is the objective; its cross-entropy compares across runs.
                    "cross_entropy": terms.cross_entropy}
    if with_z_loss:
      step_metrics["z_loss"] = terms.z_loss
    layer_grad_norms = layer_norms(grads)
    # Kept on the device and read only when a step diverges: which layer blew up.
    for layer, value in layer_grad_norms.items():
      step_metrics[f"{_DIAGNOSTIC_PREFIX}grad_norm/{layer}"] = value
    if with_layer_stats:
      for layer, value in layer_grad_norms.items():
        step_metrics[f"grad_norm/{layer}"] = value
      update_norms, param_norms = layer_norms(updates), layer_norms(params)
      for layer, value in update_norms.items():  # as metrics.update_ratio
        step_metrics[f"update_ratio/{layer}"] = value / jnp.maximum(
            param_norms[layer], jnp.finfo(jnp.float32).tiny)
    return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, step_metrics

  return jax.jit(train_step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0,
                 compiler_options=compiler_options)


def _per_layer_norms(tree, scan_layers):
  """metrics.per_layer_norms; under model.scan_layers each stacked leaf is reduced along its
  `layers` axis once, instead of being sliced into T arrays (T x leaves ops to compile)."""
  if not scan_layers:
    return metrics.per_layer_norms(tree)
  flat = nnx.to_flat_state(tree)
  norms = metrics.per_layer_norms(nnx.from_flat_state([(p, v) for p, v in flat
                                                       if p[0] != "blocks"]))
  sum_sq_T = sum(jnp.sum(jnp.square(v[...].astype(jnp.float32)), axis=tuple(range(1, v.ndim)))
                 for p, v in flat if p[0] == "blocks")
  for index in range(sum_sq_T.shape[0]):
    norms[metrics.default_layer_of_path(f"blocks.{index}")] = jnp.sqrt(sum_sq_T[index])
  return norms


def make_eval_step(setup):
  """jit(params, tokens_AxBxL1) -> mean cross-entropy (without the z term) over all A
  micro-batches of the batch."""
  graphdef = setup.graphdef

  def eval_step(params, tokens_AxBxL1):
    loss_fn = losses.params_cross_entropy(graphdef)
    with sharding_lib.activation_sharding(setup.mesh, setup.rules):
      return jnp.mean(jax.lax.map(lambda t: loss_fn(params, t), tokens_AxBxL1))
  return jax.jit(eval_step, in_shardings=(setup.state_shardings["params"], setup.batch_sharding),
                 compiler_options=compile_options.for_mesh(setup.mesh))


def make_stream_stats(setup):
  """jit(params, tokens) -> per-layer residual RMS / mean |x|, the angle each block turns, the
  angle each of its sublayers turns, the instability mechanisms (nn/mechanisms.py: max
  attention logit and attention entropy per layer, the output logits' log Z and max, each
  norm site's input RMS and gain; `Transformer.inspect`), and the collapse diagnostics
  (collapse.py): token cosine, logit spread, DyT saturation.

  `sublayer_angle/{attn,mlp}/layer_XX` (mean over tokens) and `sublayer_angle_max/...` (max)
  are the angles between the stream before and after that sublayer's residual update; for
  GeoNorm that is the geodesic angle taken, alpha_k |v|/|x| clamped by geo_theta_max (while
  below pi: a longer step comes back round the circle).
  Measured on the first micro-batch only: a statistic, not a loss, so a sample suffices.
  """
  graphdef = setup.graphdef

  def stats(params, tokens_AxBxL1):
    model = nnx.merge(graphdef, params)
    logits, streams, midstreams, mechanisms = model.inspect(tokens_AxBxL1[0, :, :-1])
    out = {**metrics.residual_stats(streams), **mechanisms}
    for index in range(len(streams) - 1):
      out[f"stream_angle/layer_{index:02d}"] = metrics.angle_between(streams[index],
                                                                      streams[index + 1])
      for sublayer, before, after in (("attn", streams[index], midstreams[index]),
                                      ("mlp", midstreams[index], streams[index + 1])):
        angles = metrics.token_angles(before, after)
        out[f"sublayer_angle/{sublayer}/layer_{index:02d}"] = jnp.mean(angles)
        out[f"sublayer_angle_max/{sublayer}/layer_{index:02d}"] = jnp.max(angles)
    final_norm = model.final_norm
    head_input = streams[-1] if final_norm is None else final_norm(streams[-1])
    out["collapse/token_cosine"] = collapse.token_cosine(head_input)
    out["collapse/logit_spread"] = collapse.logit_spread(logits)
    if final_norm is not None and final_norm.alpha is not None:  # DyT
      out["collapse/tanh_saturated_final"] = collapse.tanh_saturated(streams[-1],
                                                                     final_norm.alpha[...])
      for index in range(setup.spec.num_layers):
        out[f"collapse/tanh_saturated_attn_in/layer_{index:02d}"] = collapse.tanh_saturated(
            streams[index], model.block(index).attn_in_norm.alpha[...])
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


@jax.jit
def _all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                            if jnp.issubdtype(leaf.dtype, jnp.inexact)]))


def _evaluate(eval_step, params, eval_arrays):
  return float(np.mean([float(eval_step(params, batch)) for batch in eval_arrays]))


def _resolved_config_text(config):
  return json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str)


_PREEMPTION_POLL_STEPS = 10  # multi-process: a device all-gather, so not every step
_DIAGNOSTIC_PREFIX = "diag/"
_SPIKE_WINDOW = 100  # steps in the running median a loss spike is measured against
_SPIKE_MIN_HISTORY = 10
SUMMARY_FILENAME = metrics.SUMMARY_FILENAME


class SpikeDetector:
  """Flags a finite loss above `factor` x the median of the previous `window` finite losses
  (judged only once `min_history` are known); factor 0 turns it off."""

  def __init__(self, factor, window=_SPIKE_WINDOW, min_history=_SPIKE_MIN_HISTORY):
    self.factor, self.min_history = factor, min_history
    self.recent = collections.deque(maxlen=window)

  def observe(self, loss):
    """The running median if `loss` is a spike, else None; `loss` joins the history."""
    median = None
    if self.factor and len(self.recent) >= self.min_history:
      median = float(np.median(self.recent))
      if not loss > self.factor * median:
        median = None
    self.recent.append(loss)
    return median


class _Run:
  """The loop's bookkeeping: throughput window, last values, divergence and spike tracking."""

  def __init__(self, skipped_steps, spike_factor):
    self.window_start = time.perf_counter()
    self.window_steps = 0
    self.tokens_per_s = float("nan")
    self.last_train_loss = float("nan")
    self.last_eval_loss = float("nan")
    self.skipped_steps = skipped_steps  # over the whole run, restored from the checkpoint
    self.spikes = 0
    self.spike_detector = SpikeDetector(spike_factor)
    self.first_loss = None  # the first logged train loss: the loss at initialisation
    self.steps_above_first = 0
    self.gave_up_step = None

  def track_rise(self, step, loss, give_up_steps):
    """train.give_up_steps: counts consecutive steps whose loss is above the first one (or not
    finite) and marks the step at which the count reaches the limit."""
    if self.first_loss is None:
      self.first_loss = loss
    above = not math.isfinite(loss) or loss > self.first_loss
    self.steps_above_first = self.steps_above_first + 1 if above else 0
    if give_up_steps and self.steps_above_first >= give_up_steps and self.gave_up_step is None:
      self.gave_up_step = step


def _divergence_message(step, values, diagnostics, durable_step, workdir):
  per_layer = ", ".join(f"{name.rsplit('/', 1)[1]}={value:.3g}"
                        for name, value in sorted(diagnostics.items()))
  kept = (f"checkpoint step {durable_step} (finite) is the newest and was kept"
          if durable_step is not None else "no checkpoint was saved")
  return (f"training diverged at step {step}: loss={values['loss']}, "
          f"grad_norm={values['grad_norm']}, lr={values['lr']:.3g}; per-layer gradient norms: "
          f"{per_layer}. Nothing after it was saved; {kept} in {workdir}. Lower train.lr "
          "(or raise warmup), or set train.on_divergence=skip to drop such steps.")


def _write_summary(workdir, summary):
  if jax.process_index() == 0:
    checkpoint_lib.write_text_atomic(os.path.join(workdir, SUMMARY_FILENAME),
                                     json.dumps(summary, indent=2))


def _set_aside_newer(ckpt, step):
  """Resuming from an explicit older `step`: later checkpoints belong to the abandoned
  continuation; they are moved to checkpoints_set_aside/ (not deleted) so this run can
  save those steps again."""
  newer = [s for s in ckpt.all_steps() if s > step]
  if not newer or jax.process_index() != 0:
    return
  target_dir = os.path.join(os.fspath(ckpt.workdir), checkpoint_lib.SET_ASIDE_SUBDIR)
  os.makedirs(target_dir, exist_ok=True)
  stamp = time.strftime("%Y%m%d-%H%M%S")
  for s in newer:
    os.replace(os.fspath(ckpt.directory / str(s)),
               os.path.join(target_dir, f"{s}.superseded-{stamp}"))
  ckpt.all_steps()  # reloads orbax's list of steps, or it would skip saving those steps again
  print(f"resuming from step {step}: checkpoints {newer} moved to {target_dir}",
        file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class StepLogger:
  """A measurement the loop takes after every `every`-th update, written under `split` of
  metrics.jsonl. `make(setup)` builds it once: (state, tokens_AxBxL1, step) -> {name: float}.
  The loop knows no measurement by name: the Hessian log (hessian.callback.step_loggers)
  comes in through here, so training never imports the Hessian package."""
  split: str
  every: int
  make: Callable


def train(config, workdir, step=None, loggers=()):
  """Train (resuming from workdir's newest readable checkpoint, or `step`) and return a
  summary dict. `loggers`: StepLoggers run during training (train.hessian_every > 0 needs
  the Hessian one: `geonorm_jax.hessian.callback.step_loggers(config)`).

  Raises DivergenceError (on_divergence=stop), CheckpointSaveError (a failed save, reported
  at the next step), WorkdirBusyError (another trainer holds the workdir) or
  IncompatibleCheckpointError, each before anything on disk is lost. A run already at
  train.steps returns its stored summary and writes nothing.
  """
  if config.train.hessian_every > 0 and not any(l.split == "hessian" for l in loggers):
    raise ValueError("train.hessian_every > 0 but no Hessian logger was passed: call "
                     "train(config, workdir, loggers=geonorm_jax.hessian.callback."
                     "step_loggers(config)), as `python -m geonorm_jax train` does")
  sharding_lib.maybe_initialize_distributed(config.mesh)
  setup = make_setup(config)
  checkpoint_lib.check_writable(workdir)
  lock = checkpoint_lib.WorkdirLock(workdir).acquire()
  try:
    return _train_locked(config, workdir, setup, step, loggers)
  finally:
    lock.release()


def _train_locked(config, workdir, setup, restore_step, loggers):
  fingerprint = checkpoint_lib.config_fingerprint(config, with_data_content=True)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint, fingerprint)
  try:
    state, data_state = None, None
    if restore_step is not None or ckpt.all_steps():
      # Before anything is written to workdir: a config mismatch leaves it untouched.
      state, data_state = ckpt.restore(restore_step, sharded_abstract_state(setup))
      if restore_step is not None:
        _set_aside_newer(ckpt, restore_step)
    latest = None if state is None else int(state["step"])
    if latest is not None and latest >= config.train.steps:
      print(f"run in {workdir} already finished at step {latest} (train.steps="
            f"{config.train.steps}); nothing to do, its files are left as they are. Raise "
            "--config.train.steps to train further.", file=sys.stderr, flush=True)
      ckpt.close()
      return {**metrics.read_summary(workdir), "final_step": latest, "already_finished": True}
    # W&B (train.wandb) starts before config.json and the metrics are rewritten, so a run
    # that W&B refuses (no API key, no network) changes nothing there.
    tracker = tracking.start(config, workdir)
  except BaseException:
    ckpt.close()
    raise
  checkpoint_lib.save_config_json(workdir, config)
  writer = metrics.MetricsWriter(workdir, tracker=tracker)
  # Metrics never run ahead of the last durable step: whatever a crashed run logged after
  # its newest readable checkpoint (or at all, without one) is redone, so it goes.
  writer.truncate_after(latest or 0)
  writer.write_text("config", _resolved_config_text(config))

  dp = sharding_lib.data_parallel_size(setup.mesh.shape, setup.rules)
  train_iter = data_lib.make_train_iterator(config, data_parallel_size=dp)
  if state is None:
    state = init_state(setup)
  else:
    train_iter.set_state(data_state)
    ckpt.durable_step = latest
  start = int(state["step"])

  train_step = make_train_step(setup)
  eval_step = make_eval_step(setup)
  stream_stats = make_stream_stats(setup) if config.train.layer_stats_every > 0 else None
  step_loggers = [(logger, logger.make(setup)) for logger in loggers if logger.every > 0]
  eval_arrays = eval_batches(setup)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(setup, config.data.seq_len)
  peak = metrics.device_peak_flops(jax.devices()[0].device_kind, config.model.dtype,
                                   config.train.peak_flops)
  bar = metrics.ProgressBar(config.train.steps, start_step=start,
                            enabled=config.train.progress_bar and jax.process_index() == 0)
  ckpt.install_sigterm_handler()
  run = _Run(int(ckpt.restored_meta.get("skipped_steps", 0)), config.train.spike_factor)
  monitor = collapse.CollapseMonitor()
  pending = None
  started = time.perf_counter()

  def log_train(step, step_metrics):
    scalars = {k: v for k, v in step_metrics.items() if not k.startswith(_DIAGNOSTIC_PREFIX)}
    values = {k: float(v) for k, v in jax.device_get(scalars).items()}
    if values.pop("nonfinite"):
      if config.train.on_divergence == "stop":
        diagnostics = jax.device_get({k: v for k, v in step_metrics.items()
                                      if k.startswith(_DIAGNOSTIC_PREFIX)})
        writer.write_scalars(step, {"diverged": 1.0, **values}, split="events")
        raise DivergenceError(_divergence_message(step, values, diagnostics,
                                                  ckpt.durable_step, workdir), step)
      run.skipped_steps += 1
      writer.write_scalars(step, {"skipped": 1.0, "skipped_total": run.skipped_steps,
                                  **values}, split="events")
    else:
      median = run.spike_detector.observe(values["loss"])
      if median is not None:
        run.spikes += 1
        writer.write_scalars(step, {"loss_spike": values["loss"], "running_median": median,
                                    "ratio": values["loss"] / median}, split="events")
    run.last_train_loss = values["loss"]
    run.track_rise(step, values["loss"], config.train.give_up_steps)
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
      for logger, measure in step_loggers:
        if step % logger.every == 0:
          writer.write_scalars(step, measure(state, tokens, step), split=logger.split)
      if pending is not None:
        log_train(*pending)  # step t-1's numbers, read while step t runs
      pending = (step, step_metrics)
      run.window_steps += 1
      ckpt.poll()  # a background save that failed stops the run now, not an interval later
      # Every process must join the all-gather at the same steps, or the others hang.
      poll = jax.process_count() == 1 or step % _PREEMPTION_POLL_STEPS == 0
      stop = poll and ckpt.any_process_preempted()
      if run.gave_up_step is not None:
        if pending is not None:
          log_train(*pending)
          pending = None
        run.last_eval_loss = _evaluate(eval_step, state["params"], eval_arrays)
        writer.write_scalars(step, {"loss": run.last_eval_loss}, split="eval")
        writer.write_scalars(step, {"gave_up": 1.0, "first_loss": run.first_loss},
                             split="events")
        break
      is_eval = step % config.train.eval_every == 0 or step == config.train.steps
      save = stop or ckpt.should_save(step) or step == config.train.steps
      if is_eval or save:
        log_train(*pending)  # this step's numbers first: a diverged step is never saved
        pending = None
      if is_eval:
        run.last_eval_loss = _evaluate(eval_step, state["params"], eval_arrays)
        writer.write_scalars(step, {"loss": run.last_eval_loss}, split="eval")
        run.window_start = time.perf_counter()  # keep eval time out of tokens/s
      if save:
        if not bool(_all_finite(state["params"])):
          raise DivergenceError(
              f"the parameters after step {step} are not finite although its loss and "
              f"gradient were; nothing was saved (newest checkpoint: {ckpt.durable_step})",
              step)
        ckpt.save(step, state, train_iter.get_state(), force=True,
                  extra_meta={"skipped_steps": run.skipped_steps})
      if stop:
        break
    if pending is not None:
      log_train(*pending)
    ckpt.wait()  # the final save is on disk before the summary says so
  except BaseException:
    if tracker is not None:
      tracker.finish(exit_code=1)  # marked failed in W&B; the error goes on up
    raise
  finally:
    bar.close()
    ckpt.close()
    writer.close()
  final_step = int(state["step"])
  summary = {"final_step": final_step, "final_train_loss": run.last_train_loss,
             "final_eval_loss": run.last_eval_loss, "tokens_per_s": run.tokens_per_s,
             "wall_s": time.perf_counter() - started, "preempted": bool(ckpt.preempted),
             "interrupted": bool(ckpt.interrupted), "skipped_steps": run.skipped_steps,
             "loss_spikes": run.spikes, "collapse_step": monitor.first_step,
             "gave_up_step": run.gave_up_step}
  _write_summary(workdir, summary)
  if tracker is not None:
    tracker.finish(summary)
  return summary


def config_from_workdir(workdir):
  """The config a run was trained with (workdir/config.json)."""
  path = os.path.join(workdir, checkpoint_lib.CONFIG_FILENAME)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir} a training run's workdir?")
  with open(path) as f:
    return config_lib.from_dict(json.load(f))


def restore_params(workdir, step=None, config=None):
  """(config, setup, {step, params}) of a checkpoint; the config comes from
  workdir/config.json unless given.

  Reads only: the workdir may be read-only, nothing is created in it, and neither the
  optimizer nor the data-iterator state is read. Only the model must match the checkpoint
  (eval may read other data); a newest checkpoint that cannot be read is reported and the
  previous one used.
  """
  config = config_from_workdir(workdir) if config is None else config
  setup = make_setup(config)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint, read_only=True)
  try:
    state, _ = ckpt.restore(step, sharded_abstract_state(setup),
                            checkpoint_lib.model_fingerprint(config), params_only=True)
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
