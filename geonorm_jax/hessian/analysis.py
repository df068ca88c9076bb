"""The Hessian analysis of one checkpoint, in stages that report their cost and progress.

`Settings` says what to compute; `Analyser(setup)` compiles each stage once per run (so a
loop over a run's checkpoints compiles nothing after the first) and `Analyser.run(state)`
runs the chosen estimates on the Hessian of the token-weighted mean validation loss over
the first `num_batches` fixed validation batches, w.r.t. all parameters:

  top      Lanczos (full reorthogonalisation, `num_steps`): the top-k eigenvalues with
           their residual bounds, and the most negative one. Runs first and is reported
           on its own, so the top eigenvalues never wait for the density.
  density  stochastic Lanczos quadrature with `num_probes` probes: the top run (Gaussian
           start, uniform on the sphere) is one of them, the others are Rademacher
           probes batched `lanes` per compiled call. Grid from the top run's range.
  trace    Hutchinson's estimate with its standard error. With the density it is free:
           n e1^T T e1 = n v^T H v, so each density probe is a Hutchinson sample.
           Alone it runs `num_probes` batched Rademacher probes.
  precond  Lanczos (`precond_steps`) on Adam's preconditioned P^-1/2 H P^-1/2, P from
           the checkpoint's optimizer state; its top eigenvalue meets the Adam threshold
           (2 + 2 b1) / ((1 - b1) lr) as lambda_max meets 2 / lr.

The matvec is linearised once per stage (`hessian_matvec.linearized_matvec`: each product
is the tangent half of forward-over-reverse only) unless `hvp="recomputed"`, which holds
one micro-batch at a time (`accumulated_matvec`) for models whose residuals do not fit.
"""
import dataclasses
import functools
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from geonorm_jax.hessian import callback as hessian_callback, estimators
from geonorm_jax.hessian import matvec as hessian_matvec
from geonorm_jax.hessian.progress import HessianProgress, Stage
from geonorm_jax.nn import losses
from geonorm_jax.nn import model as model_lib
from geonorm_jax.training import compile_options
from geonorm_jax.training import train

ESTIMATES = ("top", "density", "trace", "precond")
HVP_MODES = ("linearized", "recomputed")
GRID_POINTS = 2048
# Gaussian width of the SLQ density, as a fraction of the spectrum's span: 10 grid
# spacings, so the trapezoid integral is exact to ~1e-6 and outliers stay resolved.
SIGMA_FRACTION = 0.005


@dataclasses.dataclass(frozen=True)
class Settings:
  """What to compute. Defaults: the top eigenvalues, the density and its free trace."""
  estimates: tuple = ("top", "density", "trace")
  num_steps: int = 50  # Lanczos steps of the top run and of every density probe
  num_probes: int = 8  # density / trace probes, the top run included
  # Probes per compiled call; 0 = auto: one on CPU, where a vmapped product measured
  # slower per probe than single ones (results/bench/hessian_analysis.json), all of them
  # on accelerators.
  lanes: int = 0
  num_batches: int = 4  # validation batches the loss averages over
  top_k: int = 10
  precond_steps: int = 20
  hvp: str = "linearized"
  seed: int = 0

  def validate(self):
    """One ValueError naming the field, before anything is restored or compiled."""
    unknown = [e for e in self.estimates if e not in ESTIMATES]
    if unknown or not self.estimates:
      raise ValueError(f"estimates={','.join(self.estimates)}: choose from {', '.join(ESTIMATES)}")
    for field in ("num_steps", "num_probes", "num_batches", "top_k", "precond_steps"):
      if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
        raise ValueError(f"{field}={getattr(self, field)!r} must be a positive integer")
    if self.lanes < 0:
      raise ValueError(f"lanes={self.lanes} must be >= 0 (0: automatic)")
    if self.top_k > self.num_steps:
      raise ValueError(f"top_k={self.top_k} exceeds num_steps={self.num_steps}")
    if self.hvp not in HVP_MODES:
      raise ValueError(f"hvp={self.hvp!r}: choose from {', '.join(HVP_MODES)}")
    if "density" in self.estimates and self.num_probes < 2 and "top" not in self.estimates:
      raise ValueError("num_probes must be >= 2 for a density without the top run")
    return self

  def as_dict(self):
    out = dataclasses.asdict(self)
    out["estimates"] = list(self.estimates)
    return out

  def lanes_for(self, num_probes: int) -> int:
    if self.lanes:
      return min(self.lanes, num_probes)
    return 1 if jax.default_backend() == "cpu" else num_probes

  @property
  def new_probes(self) -> int:
    """Density probes beyond the top run (which counts as one when it is computed)."""
    return self.num_probes - 1 if "top" in self.estimates else self.num_probes

  def stages(self) -> list[Stage]:
    """The plan: each chosen estimate and the products it runs, in execution order."""
    lanes = self.lanes_for
    stages = []
    if "top" in self.estimates:
      stages.append(Stage("top", f"Lanczos, {self.num_steps} steps", self.num_steps))
    if "density" in self.estimates and self.new_probes:
      reused = " (+ the top run)" if "top" in self.estimates else ""
      stages.append(Stage("density", f"SLQ, {self.new_probes} probes x {self.num_steps} "
                          f"steps{reused}", self.new_probes * self.num_steps,
                          lanes(self.new_probes)))
    if "trace" in self.estimates:
      if "density" in self.estimates:
        stages.append(Stage("trace", "Hutchinson on the density's probes", 0))
      else:
        stages.append(Stage("trace", f"Hutchinson, {self.num_probes} probes",
                            self.num_probes, lanes(self.num_probes)))
    if "precond" in self.estimates:
      stages.append(Stage("precond", f"Lanczos on P^-1/2 H P^-1/2, {self.precond_steps} steps",
                          self.precond_steps))
    return stages


def validation_micro_batches(setup, num_batches):
  """(batches used, the first num_batches validation batches as one (K, b, L+1) array)."""
  batches = train.eval_batches(setup)
  if not batches:
    raise ValueError("the run's config gives no validation batches (train.eval_batches=0)")
  chosen = batches[:num_batches]
  # Each is (A, b, L+1) in the batch sharding: micro-batches stack along A.
  return len(chosen), jnp.concatenate(chosen, axis=0)


def thresholds(setup, step):
  """lr of the next update and the stability thresholds lambda_max and the preconditioned
  lambda_max meet: 2 / lr (gradient descent), (2 + 2 b1) / ((1 - b1) lr) (Adam)."""
  lr = float(setup.schedule(step))
  b1 = float(setup.config.train.b1)
  return {"lr": lr, "two_over_lr": 2.0 / lr if lr > 0 else math.inf,
          "adam_threshold": (2.0 + 2.0 * b1) / ((1.0 - b1) * lr) if lr > 0 else math.inf}


def _floats(x):
  return [float(v) for v in np.asarray(x).ravel()]


class Analyser:
  """The compiled stages for one run's setup; `run` analyses one restored state."""

  def __init__(self, setup, settings: Settings):
    self.setup = setup
    self.settings = settings.validate()
    self.micro_loss = losses.params_loss(setup.graphdef)
    self.shardings = setup.state_shardings["params"]
    self.progress: Optional[HessianProgress] = None
    report = lambda count: self.progress(count) if self.progress is not None else None
    s = settings
    jit = functools.partial(jax.jit, compiler_options=compile_options.for_mesh(setup.mesh))
    self._top = jit(lambda p, t, k: estimators.lanczos(
        self._matvec(p, t), p, s.num_steps, k, shardings=self.shardings, progress=report))
    self._probes = jit(lambda p, t, k: estimators.lanczos_batch(
        self._matvec(p, t), p, s.num_steps, s.new_probes, k, lanes=s.lanes_for(s.new_probes),
        shardings=self.shardings, progress=report))
    self._hutchinson = jit(lambda p, t, k: estimators.hutchinson_trace(
        self._matvec(p, t), p, s.num_probes, k, lanes=s.lanes_for(s.num_probes),
        shardings=self.shardings, progress=report))
    self._precond = jit(lambda p, t, precond, k: estimators.lanczos(
        hessian_matvec.preconditioned_matvec(self._matvec(p, t), precond), p, s.precond_steps,
        k, shardings=self.shardings, progress=report))
    self._loss = jit(lambda p, t: jnp.mean(jax.vmap(lambda x: self.micro_loss(p, x))(t)))

  def _matvec(self, params, tokens_KxBxL1):
    # lm_loss has no mask, so every micro-batch predicts b * L tokens: the token-weighted
    # mean is the equal-weighted one.
    if self.settings.hvp == "linearized":
      return hessian_matvec.linearized_matvec(self.micro_loss, params, tokens_KxBxL1)
    return hessian_matvec.accumulated_matvec(
        lambda t: hessian_matvec.params_matvec(self.micro_loss, params, t), tokens_KxBxL1)

  def run(self, state, *, header="Hessian", stream=None, enabled=True, on_top=None):
    """The report dict of one state (params, opt_state, step); `on_top(report)` is called
    with the top eigenvalues as soon as they exist."""
    s, setup = self.settings, self.setup
    params = state["params"]
    step = int(state["step"])
    used_batches, tokens_KxBxL1 = validation_micro_batches(setup, s.num_batches)
    num_tokens = int(tokens_KxBxL1.shape[0] * tokens_KxBxL1.shape[1] *
                     (tokens_KxBxL1.shape[2] - 1))
    num_params = model_lib.count_params(params)
    stages = s.stages()
    self.progress = HessianProgress(stages, f"{header} (step {step}, {num_params:,} parameters, "
                                    f"{num_tokens:,} tokens)", stream=stream, enabled=enabled)
    top_key, probe_key, hutch_key, precond_key = jax.random.split(jax.random.key(s.seed), 4)
    report = {
        "step": step, "num_params": num_params, "num_batches": used_batches,
        "num_tokens": num_tokens, "settings": s.as_dict(),
        "tokens_trained": step * setup.config.data.batch_size * setup.config.data.seq_len,
        "products": {stage.name: stage.products for stage in stages},
        "seconds": {}, **thresholds(setup, step),
    }
    self.progress.start()
    top_run = None
    try:
      started = time.perf_counter()
      report["val_loss"] = float(self._loss(params, tokens_KxBxL1))
      if "top" in s.estimates:
        self.progress.stage("top")
        top_run = jax.device_get(self._top(params, tokens_KxBxL1, top_key))
        estimators.check_finite(top_run)  # a clear error instead of a NaN-filled report
        report["lanczos"] = _top_report(top_run, s.top_k)
        report["seconds"]["top"] = time.perf_counter() - started
        top = report["lanczos"]
        self.progress.message(f"top eigenvalues: {', '.join(f'{v:.5g}' for v in top['top_eigenvalues'][:5])}"
                              f"{' ...' if len(top['top_eigenvalues']) > 5 else ''} "
                              f"(lambda_min {top['lambda_min']:.4g})")
        if on_top is not None:
          on_top(dict(report))
      runs = None
      if "density" in s.estimates:
        started = time.perf_counter()
        parts = [top_run] if top_run is not None else []
        if s.new_probes:
          self.progress.stage("density")
          parts.append(jax.device_get(self._probes(params, tokens_KxBxL1, probe_key)))
        runs = estimators.concatenate_runs(*parts)
        estimators.check_finite(runs)
        report["density"] = _density_report(runs, num_params)
        report["seconds"]["density"] = time.perf_counter() - started
      if "trace" in s.estimates:
        if runs is not None:
          density = report["density"]
          report["trace"] = {"estimate": density["trace"], "stderr": density["trace_stderr"],
                             "num_probes": s.num_probes, "method": "hutchinson on the density's probes"}
        else:
          started = time.perf_counter()
          self.progress.stage("trace")
          trace = jax.device_get(self._hutchinson(params, tokens_KxBxL1, hutch_key))
          estimators.check_finite(trace)
          report["trace"] = {"estimate": float(trace.estimate), "stderr": float(trace.stderr),
                             "num_probes": s.num_probes, "method": "hutchinson"}
          report["seconds"]["trace"] = time.perf_counter() - started
      if "precond" in s.estimates:
        started = time.perf_counter()
        self.progress.stage("precond")
        precond = hessian_callback.effective_preconditioner(state["opt_state"], params,
                                                            setup.config.train)
        result = jax.device_get(self._precond(params, tokens_KxBxL1, precond, precond_key))
        estimators.check_finite(result)
        report["precond"] = {"lambda_max": float(result.ritz_values[0]),
                             "residual_bound": float(result.residual_bounds[0])}
        report["seconds"]["precond"] = time.perf_counter() - started
    finally:
      jax.effects_barrier()  # the last progress callbacks have run
      self.progress.close()
    return report


def _top_report(result, top_k):
  valid = np.asarray(result.valid[:top_k])
  return {
      "top_eigenvalues": _floats(np.asarray(result.ritz_values[:top_k])[valid]),
      "residual_bounds": _floats(np.asarray(result.residual_bounds[:top_k])[valid]),
      "lambda_min": float(result.ritz_values[-1]),
      "lambda_min_residual_bound": float(result.residual_bounds[-1]),
      "num_valid_steps": int(result.num_valid_steps),
      "breakdown": bool(result.breakdown),
  }


def _density_report(runs, dim):
  """Density on a grid spanning every probe's Ritz values (the top run's range when it is
  one of them: Lanczos finds the extremes first)."""
  nodes = np.asarray(runs.ritz_values, np.float64)
  top, bottom = float(np.nanmax(nodes)), float(np.nanmin(nodes))
  span = max(top - bottom, 1e-6 * max(abs(top), 1.0))
  sigma = SIGMA_FRACTION * span
  # 10 sigma of margin: the Gaussians at the extreme nodes integrate to 1 on the grid.
  grid = np.linspace(bottom - 10 * sigma, top + 10 * sigma, GRID_POINTS)
  density = estimators.density_from_runs(runs, dim, jnp.asarray(grid, jnp.float32), sigma)
  values = np.asarray(density.density, np.float64)
  grid = np.asarray(density.grid, np.float64)
  return {"grid": _floats(grid), "values": _floats(values), "sigma": sigma,
          "integral": float(np.trapezoid(values, grid)), "num_probes": int(nodes.shape[0]),
          "trace": float(density.trace), "trace_stderr": float(density.trace_stderr)}
