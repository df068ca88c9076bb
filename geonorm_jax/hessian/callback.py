"""The trainer's curvature log: top Hessian eigenvalues next to the stability thresholds.

`make_hessian_logger(setup)` returns `log(state, tokens_AxBxL1, step) -> {name: float}`,
one jitted function (compiled on the first call) that runs, on the batch just trained on:

  lambda_max, lambda_max_bound, lambda_min   Lanczos on the Hessian of the training loss
                                             w.r.t. all parameters (train.hessian_steps)
  lambda_max_precond (+ _bound)              the same for P^-1/2 H P^-1/2, Adam's
                                             preconditioned Hessian, P from the opt state
  lr                                         the learning rate of the next update
  two_over_lr                                2 / lr: gradient descent is unstable on a
                                             quadratic once lambda_max exceeds it
  adam_threshold                             (2 + 2 b1) / ((1 - b1) lr): the same for
                                             lambda_max_precond (Cohen et al. 2022,
                                             "Adaptive gradient methods at the edge of
                                             stability"), 38/lr for b1 = 0.9
  lambda_max/blocks.{i}                      per block, if train.hessian_per_block

The loss is the training loss: the mean over the A micro-batches of each one's mean token
loss, its HVP accumulated over micro-batches in a `lax.scan` (memory of one micro-batch,
as in the train step). The learning rate is the one of the next update, schedule(state
["step"]), i.e. the step the measured curvature will meet. Global-norm clipping and
decoupled weight decay are not part of P: both act on the update, not on the curvature
seen by Adam's preconditioner. Per-parameter LR multipliers are: the effective
preconditioner of a parameter with multiplier m is P / m.

With `train.progress_bar`, each call first logs its cost (Hessian-vector products per
estimate) and then plain progress lines with an ETA (hessian_progress), on stderr like the
training bar.
"""
import jax
import jax.numpy as jnp

from geonorm_jax import hessian
from geonorm_jax.hessian.progress import HessianProgress, Stage
from geonorm_jax.nn import losses
from geonorm_jax.training import compile_options, optim, train


def block_select(index):
  return f"^blocks\\.{index}\\."


def effective_preconditioner(opt_state, params, train_config):
  """Adam's P (bias-corrected, with eps), divided by the per-parameter LR multipliers."""
  precond = hessian.adam_preconditioner(opt_state, None, b2=train_config.b2,
                                        eps=train_config.eps)
  if not train_config.lr_multipliers:
    return precond
  # P's leaves are in nu's structure (optax wraps them differently); match by leaf order,
  # which is the params' order.
  multipliers = jax.tree.leaves(optim.multiplier_tree(params, train_config.lr_multipliers))
  leaves = jax.tree.leaves(precond)
  scaled = [p / jnp.asarray(m, p.dtype) for p, m in zip(leaves, multipliers)]
  return jax.tree.unflatten(jax.tree.structure(precond), scaled)


def make_hessian_logger(setup, seed=0):
  """(state, tokens_AxBxL1, step) -> dict of floats; see the module docstring."""
  train_config = setup.config.train
  num_steps = int(train_config.hessian_steps)
  per_block = bool(train_config.hessian_per_block)
  num_layers = setup.spec.num_layers
  b1 = float(train_config.b1)
  micro_loss = losses.params_loss(setup.graphdef)
  base_key = jax.random.key(seed)
  stages = [Stage("lambda_max", f"Lanczos, {num_steps} steps", num_steps),
            Stage("precond", f"Lanczos on P^-1/2 H P^-1/2, {num_steps} steps", num_steps)]
  if per_block:
    stages.append(Stage("blocks", f"Lanczos per block, {num_layers} x {num_steps} steps",
                        num_layers * num_steps))
  show = bool(train_config.progress_bar) and jax.process_index() == 0
  current = {"progress": None}
  report = lambda count: current["progress"] and current["progress"](count)

  def lanczos_top(matvec, like, key):
    result = hessian.lanczos(matvec, like, num_steps, key, progress=report)
    return result.ritz_values[0], result.residual_bounds[0], result.ritz_values[-1]

  def compute(state, tokens_AxBxL1, step):
    params = state["params"]
    keys = jax.random.split(jax.random.fold_in(base_key, step), 2 + num_layers)
    full = hessian.accumulated_matvec(
        lambda tokens: hessian.params_matvec(micro_loss, params, tokens), tokens_AxBxL1)
    out = {}
    out["lambda_max"], out["lambda_max_bound"], out["lambda_min"] = lanczos_top(
        full, params, keys[0])
    precond = effective_preconditioner(state["opt_state"], params, train_config)
    top, bound, _ = lanczos_top(hessian.preconditioned_matvec(full, precond), params, keys[1])
    out["lambda_max_precond"], out["lambda_max_precond_bound"] = top, bound
    lr = setup.schedule(state["step"])
    out["lr"] = lr
    out["two_over_lr"] = 2.0 / lr
    out["adam_threshold"] = (2.0 + 2.0 * b1) / ((1.0 - b1) * lr)
    if per_block:
      for index in range(num_layers):
        select = block_select(index)
        _, like = hessian.subset_matvec(micro_loss, params, select, tokens_AxBxL1[0])
        block = hessian.accumulated_matvec(
            lambda tokens, s=select: hessian.subset_matvec(micro_loss, params, s, tokens)[0],
            tokens_AxBxL1)
        out[f"lambda_max/blocks.{index}"] = lanczos_top(block, like, keys[2 + index])[0]
    return out

  compiled = jax.jit(compute, compiler_options=compile_options.for_mesh(setup.mesh))

  def log(state, tokens_AxBxL1, step):
    progress = HessianProgress(stages, f"Hessian log at step {step}", enabled=show, redraw=False)
    current["progress"] = progress
    progress.start()
    try:
      values = jax.device_get(compiled(state, tokens_AxBxL1, jnp.asarray(step, jnp.int32)))
      jax.effects_barrier()  # every progress callback has run before the bar closes
    finally:
      progress.close()
      current["progress"] = None
    return {name: float(value) for name, value in values.items()}

  return log


def step_loggers(config):
  """What train.train(..., loggers=) takes for this config: the Hessian log every
  train.hessian_every steps, or nothing when it is 0."""
  every = int(config.train.hessian_every)
  return [train.StepLogger("hessian", every, make_hessian_logger)] if every > 0 else []
