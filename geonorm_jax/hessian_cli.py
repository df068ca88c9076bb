"""`python -m geonorm_jax hessian --workdir=RUN [--step=S]`: the Hessian spectrum of a checkpoint.

Loads the checkpoint (train.restore_params), takes the first `num_batches` of the run's
fixed validation batches, and analyses the Hessian of the token-weighted mean validation
loss over them w.r.t. all parameters:

  * Lanczos (full reorthogonalisation, `num_steps`): the top-k eigenvalues with their
    residual bounds, and the most negative one;
  * stochastic Lanczos quadrature (`num_probes` Rademacher probes): the spectral density
    on a grid covering [lambda_min, lambda_max] found above, and its trace estimate;
  * Hutchinson's trace estimate with its standard error (a second, independent one).

Writes workdir/hessian/step_<S>.json and step_<S>.png (density, log-scale y) and returns
a short summary. All micro-batches of all chosen batches have the same shape, so their
HVPs are accumulated by one `lax.scan` weighted by token count (the Hessian of the mean
over all tokens, as `hessian.multi_batch_matvec` computes it); unlike that function's
Python loop, the scan compiles the model's HVP once instead of once per batch, which on a
CPU is most of this command's run time.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from geonorm_jax import hessian, losses, train
from geonorm_jax import model as model_lib

GRID_POINTS = 2048
# Gaussian width of the SLQ density, as a fraction of the spectrum's span: 10 grid
# spacings, so the trapezoid integral is exact to ~1e-6 and outliers stay resolved.
SIGMA_FRACTION = 0.005


def _stacked_micro_batches(setup, num_batches):
  """(number of batches used, the first num_batches validation batches as one (K, b, L+1)
  array of micro-batches)."""
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1, got {num_batches}")
  batches = train.eval_batches(setup)
  if not batches:
    raise ValueError("the run's config gives no validation batches (train.eval_batches=0)")
  chosen = [np.asarray(jax.device_get(b)) for b in batches[:num_batches]]
  stacked = np.concatenate(chosen, axis=0)  # each is (A, b, L+1): micro-batches stack
  return len(chosen), jnp.asarray(stacked, jnp.int32)


def _analyse(graphdef, params, tokens_KxBxL1, *, num_steps, num_probes, top_k, key):
  """Everything in one jitted function: Lanczos, then SLQ on a grid from its range."""
  micro_loss = losses.params_loss(graphdef)
  # lm_loss has no mask, so every micro-batch predicts b * L tokens: the token-weighted mean
  # is the equal-weighted one.
  matvec = hessian.accumulated_matvec(
      lambda t: hessian.params_matvec(micro_loss, params, t), tokens_KxBxL1)
  lanczos_key, slq_key, hutch_key = jax.random.split(key, 3)
  result = hessian.lanczos(matvec, params, num_steps, lanczos_key)
  top, bottom = result.ritz_values[0], result.ritz_values[-1]
  span = jnp.maximum(top - bottom, 1e-6 * jnp.maximum(jnp.abs(top), 1.0))
  sigma = SIGMA_FRACTION * span
  # 10 sigma of margin: the Gaussians at the extreme nodes integrate to 1 on the grid.
  grid = jnp.linspace(bottom - 10 * sigma, top + 10 * sigma, GRID_POINTS)
  density = hessian.spectral_density(matvec, params, num_steps, num_probes, slq_key, grid,
                                     sigma)
  trace = hessian.hutchinson_trace(matvec, params, num_probes, hutch_key)
  loss = jnp.mean(jax.vmap(lambda t: micro_loss(params, t))(tokens_KxBxL1))
  return {
      "top": result.ritz_values[:top_k], "top_bounds": result.residual_bounds[:top_k],
      "top_valid": result.valid[:top_k], "lambda_min": bottom,
      "lambda_min_bound": result.residual_bounds[-1], "lanczos": result,
      "density": density, "sigma": sigma, "hutchinson": trace, "loss": loss,
  }


def _floats(x):
  return [float(v) for v in np.asarray(x).ravel()]


def _plot(path, grid, density, top, bottom, title):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  grid, density = np.asarray(grid), np.asarray(density)
  positive = density[density > 0]
  # A log axis spans the Gaussian tails down to ~1e-300; 1e-8 of the peak is the
  # range a reader can use (bulk vs outliers) without the plot being all tails.
  floor = max(float(positive.min()) if positive.size else 1e-12, 1e-8 * float(density.max()))
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.semilogy(grid, np.maximum(density, floor), lw=1.2)
  ax.set_ylim(bottom=floor)
  for value, label in ((top, "lambda_max"), (bottom, "lambda_min")):
    ax.axvline(value, color="gray", ls=":", lw=1)
    ax.annotate(f"{label}={value:.4g}", (value, density.max()), fontsize=8, rotation=90,
                va="top", ha="right")
  ax.set_xlabel("eigenvalue")
  ax.set_ylabel("density (SLQ)")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(workdir, step=None, num_steps=50, num_probes=8, num_batches=4, top_k=10, seed=0):
  """Analyse a checkpoint of `workdir` (default: the latest); returns a summary dict."""
  config, setup, state = train.restore_params(workdir, step)
  step = int(state["step"])
  params = state["params"]
  num_params = model_lib.count_params(params)
  if not 1 <= top_k <= num_steps:
    raise ValueError(f"need 1 <= top_k <= num_steps, got top_k={top_k}, num_steps={num_steps}")
  used_batches, tokens_KxBxL1 = _stacked_micro_batches(setup, num_batches)
  analyse = jax.jit(lambda p, t, k: _analyse(setup.graphdef, p, t, num_steps=num_steps,
                                             num_probes=num_probes, top_k=top_k, key=k))
  out = jax.device_get(analyse(params, tokens_KxBxL1, jax.random.key(seed)))
  for name in ("lanczos", "density", "hutchinson"):
    hessian.check_finite(out[name])  # a clear error instead of a NaN-filled report

  density = out["density"]
  grid, values = np.asarray(density.grid, np.float64), np.asarray(density.density, np.float64)
  num_tokens = int(tokens_KxBxL1.shape[0] * tokens_KxBxL1.shape[1] * (tokens_KxBxL1.shape[2] - 1))
  lanczos = out["lanczos"]
  valid = np.asarray(out["top_valid"])
  report = {
      "workdir": os.path.abspath(workdir), "step": step, "num_params": num_params,
      "placement": config.model.placement, "num_batches": used_batches,
      "num_tokens": num_tokens, "num_steps": num_steps, "num_probes": num_probes,
      "seed": seed, "val_loss": float(out["loss"]),
      "lanczos": {
          "top_eigenvalues": _floats(np.asarray(out["top"])[valid]),
          "residual_bounds": _floats(np.asarray(out["top_bounds"])[valid]),
          "lambda_min": float(out["lambda_min"]),
          "lambda_min_residual_bound": float(out["lambda_min_bound"]),
          "num_valid_steps": int(lanczos.num_valid_steps),
          "breakdown": bool(lanczos.breakdown),
      },
      "density": {
          "grid": _floats(grid), "values": _floats(values), "sigma": float(out["sigma"]),
          "integral": float(np.trapezoid(values, grid)),
      },
      "trace": {
          "slq": {"estimate": float(density.trace), "stderr": float(density.trace_stderr)},
          "hutchinson": {"estimate": float(out["hutchinson"].estimate),
                         "stderr": float(out["hutchinson"].stderr)},
      },
  }
  out_dir = os.path.join(workdir, "hessian")
  os.makedirs(out_dir, exist_ok=True)
  json_path = os.path.join(out_dir, f"step_{step}.json")
  png_path = os.path.join(out_dir, f"step_{step}.png")
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)
  top = report["lanczos"]["top_eigenvalues"][0]
  _plot(png_path, grid, values, top, report["lanczos"]["lambda_min"],
        f"{config.model.placement}, step {step}: Hessian of the validation loss "
        f"({num_params:,} params, {num_tokens:,} tokens)")
  return {
      "step": step, "lambda_max": top, "lambda_max_residual_bound":
      report["lanczos"]["residual_bounds"][0], "lambda_min": report["lanczos"]["lambda_min"],
      "trace_hutchinson": report["trace"]["hutchinson"], "json": json_path, "png": png_path,
  }
