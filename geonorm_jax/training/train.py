"""Training: a sharded, jitted train step and the loop around it.

The state is a plain dict {step, params, opt_state, spike} of arrays (params as an nnx.State,
spike the spike rule's window), laid out over the mesh by sharding.py and updated by one
`jax.jit` with donated buffers. The loop never blocks on the device: step t-1's metrics are
read after step t is dispatched, except at eval and checkpoint steps, where the step's own
numbers are read first so that a non-finite state is never saved.

Divergence (a non-finite loss or gradient norm) follows `train.on_divergence`: `stop` raises
DivergenceError naming the step with its per-layer gradient norms; `skip` drops the update
inside the jitted step (parameters and optimizer state unchanged, step counter and data
advance) and counts it.

Spikes (training/spikes.py: the loss or the gradient norm train.spike_zscore standard
deviations above its mean over the previous 128 steps) are judged inside the step from running
statistics kept in the state, so `train.skip_spikes` drops a spike's update the same way; each
spike is logged under `spikes` with the per-layer statistics of its own step.
"""
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
from geonorm_jax.training import metrics, optim, spikes, tracking
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
      "spike": jax.eval_shape(spikes.init),
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
            "opt_state": setup.optimizer.init(params), "spike": spikes.init()}
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
  train_config = setup.config.train
  with_layer_stats = train_config.layer_stats_every > 0
  skip_nonfinite = train_config.on_divergence == "skip"
  skip_spikes = train_config.skip_spikes
  spike_zscore, spike_warmup = float(train_config.spike_zscore), int(train_config.spike_warmup)
  with_z_loss = setup.spec.z_loss > 0
  layer_norms = functools.partial(_per_layer_norms, scan_layers=setup.spec.scan_layers)
  # A spike's per-layer statistics are those of its own step (the parameters before the
  # update, on its batch). The loop reads the flag one step late, when those parameters have
  # been donated, so they are taken here, in a branch that runs only on a flagged step.
  spike_layer_stats = (make_stream_stats(setup) if spike_zscore > 0 and with_layer_stats
                       else None)

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
    spike_stats, spike, spike_values = spikes.observe(state["spike"], loss, grad_norm,
                                                      spike_zscore, spike_warmup)
    if skip_nonfinite or skip_spikes:
      apply = jnp.ones((), bool)
      if skip_nonfinite:
        apply &= finite
      if skip_spikes:
        apply &= ~spike
      # An elementwise select that XLA fuses into the update: no host round trip, and the
      # same decision on every device since loss and grad_norm are replicated.
      keep = lambda new, old: jnp.where(apply, new, old)
      new_params = jax.tree.map(keep, new_params, params)
      opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
    step_metrics = {"loss": loss, "grad_norm": grad_norm,
                    "lr": schedule(state["step"]),
                    "nonfinite": 1.0 - finite.astype(jnp.float32),
                    # `loss` is the objective; its cross-entropy compares across runs.
                    "cross_entropy": terms.cross_entropy,
                    "spike": spike.astype(jnp.float32),
                    "loss_z": spike_values.pop("loss_z"),
                    "grad_norm_z": spike_values.pop("grad_norm_z")}
    if with_z_loss:
      step_metrics["z_loss"] = terms.z_loss
    # The running mean and std a spike was judged against: read only for a spike.
    for name, value in spike_values.items():
      step_metrics[f"{_SPIKE_PREFIX}{name}"] = value
    if spike_layer_stats is not None:
      # Under the step's activation constraints: its forward pass keeps each device's
      # activations to its own rows, as the training forward does.
      with sharding_lib.activation_sharding(setup.mesh, setup.rules):
        shapes = jax.eval_shape(spike_layer_stats, params, tokens_AxBxL1)
        layer_values = jax.lax.cond(
            spike, lambda: spike_layer_stats(params, tokens_AxBxL1),
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
      for name, value in layer_values.items():
        step_metrics[f"{_SPIKE_PREFIX}{name}"] = value
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
    return ({"step": state["step"] + 1, "params": new_params, "opt_state": opt_state,
             "spike": spike_stats}, step_metrics)

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
_DIAGNOSTIC_PREFIX = "diag/"  # read only when a step diverges
_SPIKE_PREFIX = "spike/"  # read only for a spike
_SPIKE_META_KEY = "spike_window"  # the checkpoint meta's copy of state["spike"]
# Counts over the whole run, carried in each checkpoint's meta and reported in the summary.
_RUN_COUNTS = ("skipped_steps", "loss_spikes", "skipped_spikes")
SUMMARY_FILENAME = metrics.SUMMARY_FILENAME


class _Run:
  """The loop's bookkeeping: throughput window, last values, divergence and spike counts."""

  def __init__(self, restored_meta):
    self.window_start = time.perf_counter()
    self.window_steps = 0
    self.tokens_per_s = float("nan")
    self.last_train_loss = float("nan")
    self.last_eval_loss = float("nan")
    # Over the whole run: restored from the checkpoint (absent from older ones: 0).
    for key in _RUN_COUNTS:
      setattr(self, key, int(restored_meta.get(key, 0)))
    # train.give_up_steps: the run's first logged train loss (its loss at initialisation) and
    # the steps since above it, carried in the checkpoint meta so that a resume keeps both.
    self.first_loss = restored_meta.get("first_loss")
    self.steps_above_first = int(restored_meta.get("steps_above_first", 0))
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

  def counts(self):
    return {key: getattr(self, key) for key in _RUN_COUNTS}

  def meta(self):
    """What a checkpoint's meta carries of the loop's bookkeeping."""
    return {**self.counts(), "first_loss": self.first_loss,
            "steps_above_first": self.steps_above_first}


def _checkpointed(state):
  """What a checkpoint holds as arrays: the state without its spike statistics, which go
  into the meta (JSON) so that checkpoints written before they existed still restore."""
  return {key: value for key, value in state.items() if key != "spike"}


def restore_state(ckpt, step, setup):
  """(state, data_state) of checkpoint `step` (None: the newest readable one), read straight
  into the setup's shardings; the spike statistics come from its meta (a checkpoint without
  them starts an empty window, judged again after train.spike_warmup steps)."""
  abstract = sharded_abstract_state(setup)
  state, data_state = ckpt.restore(step, _checkpointed(abstract))
  window = spikes.from_json(ckpt.restored_meta.get(_SPIKE_META_KEY), abstract["spike"])
  return {**state, "spike": window}, data_state


def _divergence_message(step, values, diagnostics, durable_step, workdir):
  per_layer = ", ".join(f"{name.rsplit('/', 1)[1]}={value:.3g}"
                        for name, value in sorted(diagnostics.items()))
  kept = (f"checkpoint step {durable_step} (finite) is the newest and was kept"
          if durable_step is not None else "no checkpoint was saved")
  return (f"training diverged at step {step}: loss={values['loss']}, "
          f"grad_norm={values['grad_norm']}, lr={values['lr']:.3g}; per-layer gradient norms: "
          f"{per_layer}. Nothing after it was saved; {kept} in {workdir}. Lower train.lr "
          "(or raise warmup), or set train.on_divergence=skip to drop such steps.")


def write_summary(workdir, summary):
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
      state, data_state = restore_state(ckpt, restore_step, setup)
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
  try:
    # Metrics never run ahead of the last durable step: whatever a crashed run logged after
    # its newest readable checkpoint (or at all, without one) is redone, so it goes.
    writer = open_writer(workdir, config, after_step=latest or 0, tracker=tracker)
    dp = sharding_lib.data_parallel_size(setup.mesh.shape, setup.rules)
    train_iter = data_lib.make_train_iterator(config, data_parallel_size=dp)
    if state is None:
      state = init_state(setup)
    else:
      train_iter.set_state(data_state)
      ckpt.durable_step = latest
  except BaseException:
    ckpt.close()
    if tracker is not None:
      tracker.finish(exit_code=1)  # marked failed in W&B; the error goes on up
    raise
  try:
    summary = run_loop(setup, state, train_iter, writer, ckpt, loggers,  # closes ckpt, writer
                       last_step=config.train.steps, restored_meta=ckpt.restored_meta)
  except BaseException:
    if tracker is not None:
      tracker.finish(exit_code=1)
    raise
  write_summary(workdir, summary)
  if tracker is not None:
    tracker.finish(summary)
  return summary


def open_writer(workdir, config, after_step=0, tracker=None):
  """Writes config.json into a run folder and returns its MetricsWriter (sending on to
  `tracker` too), with whatever metrics.jsonl held after `after_step` dropped (a resumed run
  redoes those steps)."""
  checkpoint_lib.save_config_json(workdir, config)
  writer = metrics.MetricsWriter(workdir, tracker=tracker)
  writer.truncate_after(after_step)
  writer.write_text("config", _resolved_config_text(config))
  return writer


def run_loop(setup, state, train_iter, writer, ckpt, loggers, last_step, restored_meta):
  """Trains from state["step"] + 1 to `last_step` (the schedule still ends at train.steps)
  and returns the summary; closes ckpt and writer.

  `ckpt` saves every checkpoint.every steps, at `last_step` and on preemption (a replay
  passes one that saves nothing); `restored_meta` carries the run's counts (skipped steps,
  spikes) from the checkpoint the state came from. Shared by `train` and `replay`.
  """
  config = setup.config
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
  bar = metrics.ProgressBar(last_step, start_step=start,
                            enabled=config.train.progress_bar and jax.process_index() == 0)
  ckpt.install_sigterm_handler()
  run = _Run(restored_meta)
  monitor = collapse.CollapseMonitor()
  pending = None
  started = time.perf_counter()

  def log_train(step, step_metrics):
    held = (_DIAGNOSTIC_PREFIX, _SPIKE_PREFIX)
    scalars = {k: v for k, v in step_metrics.items() if not k.startswith(held)}
    values = {k: float(v) for k, v in jax.device_get(scalars).items()}
    spike = values.pop("spike")
    if values.pop("nonfinite"):
      if config.train.on_divergence == "stop":
        diagnostics = jax.device_get({k: v for k, v in step_metrics.items()
                                      if k.startswith(_DIAGNOSTIC_PREFIX)})
        writer.write_scalars(step, {"diverged": 1.0, **values}, split="events")
        raise DivergenceError(_divergence_message(step, values, diagnostics,
                                                  ckpt.durable_step, writer.workdir), step)
      run.skipped_steps += 1
      writer.write_scalars(step, {"skipped": 1.0, "skipped_total": run.skipped_steps,
                                  **values}, split="events")
    elif spike:
      run.loss_spikes += 1
      run.skipped_spikes += config.train.skip_spikes
      # The running mean and std it was judged against and its step's per-layer statistics.
      judged = jax.device_get({k[len(_SPIKE_PREFIX):]: v for k, v in step_metrics.items()
                               if k.startswith(_SPIKE_PREFIX)})
      writer.write_scalars(step, {**values, **judged,
                                  "skipped": float(config.train.skip_spikes)}, split="spikes")
    run.last_train_loss = values["loss"]
    run.track_rise(step, values["loss"], config.train.give_up_steps)
    bar.update(step, values["loss"])
    if step % config.train.log_every == 0 or step == last_step:
      now = time.perf_counter()
      if run.window_steps:
        run.tokens_per_s = run.window_steps * tokens_per_step / (now - run.window_start)
      run.window_start, run.window_steps = now, 0
      values["tokens_per_s"] = run.tokens_per_s
      values["mfu"] = metrics.mfu(run.tokens_per_s, flops, jax.device_count(), peak)
      writer.write_scalars(step, values)

  try:
    for step in range(start + 1, last_step + 1):
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
      # train.give_up_steps: the run ends here, evaluated as at its last step but not saved.
      gave_up = run.gave_up_step is not None
      is_eval = gave_up or step % config.train.eval_every == 0 or step == last_step
      save = not gave_up and (stop or ckpt.should_save(step) or step == last_step)
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
        ckpt.save(step, _checkpointed(state), train_iter.get_state(), force=True,
                  extra_meta={**run.meta(), _SPIKE_META_KEY: spikes.to_json(state["spike"])})
      if gave_up:
        writer.write_scalars(step, {"gave_up": 1.0, "first_loss": run.first_loss},
                             split="events")
      if stop or gave_up:
        break
    if pending is not None:
      log_train(*pending)
    ckpt.wait()  # the final save is on disk before the summary says so
  finally:
    bar.close()
    ckpt.close()
    writer.close()
  return {"final_step": int(state["step"]), "final_train_loss": run.last_train_loss,
          "final_eval_loss": run.last_eval_loss, "tokens_per_s": run.tokens_per_s,
          "wall_s": time.perf_counter() - started, "preempted": bool(ckpt.preempted),
          "interrupted": bool(ckpt.interrupted), **run.counts(),
          "collapse_step": monitor.first_step, "gave_up_step": run.gave_up_step}


def config_from_workdir(workdir):
  """A run's saved config (workdir/config.json) laid over the base config."""
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
