"""Metrics: tensorboard + jsonl logging, per-layer statistics, progress bar, MFU.

Three independent parts:

* `MetricsWriter` writes every scalar twice: tensorboard events (for looking) and
  `metrics.jsonl` (for notebooks and experiment scripts, which should not need
  tensorboard to read a number back), and a third time to W&B when a tracker is
  given (training/tracking.py, `train.wandb`). Only process 0 writes.
* Pure JAX statistics (`residual_stats`, `per_layer_norms`, `update_ratio`,
  `angle_between`, `max_angle_between`) that run inside the jitted train step and return dicts of
  scalars, so the host only ever transfers a handful of floats.
* Throughput helpers: `ProgressBar`, `mfu`, `device_peak_flops`,
  `model_flops_per_token`.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from geonorm_jax.nn.paths import path_to_string

METRICS_FILENAME = "metrics.jsonl"
EVENTS_SUBDIR = "tensorboard"


# ---------------------------------------------------------------------------
# Writing and reading metrics.
# ---------------------------------------------------------------------------


def _import_summary_writer():
  """tensorboardX's SummaryWriter, without importing torch when nothing has yet.

  tensorboardX's writer module tries `import torch` only to name a type in its annotations;
  with torch installed (the test extras) that import cost every training process 2-3 s.
  While torch is not imported, a None in sys.modules makes that import fail at once, as if
  torch were absent; the entry goes again afterwards, so a later `import torch` works.
  """
  if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter
  sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Writes scalars to tensorboard and to `workdir/metrics.jsonl`.

  Every other process is a no-op, so the train loop can call it unconditionally.
  The tensorboard writer is created lazily so that a resumed run can first call
  `truncate_after` and have tensorboard hide the events it is about to redo.
  `tracker` (a tracking.WandbTracker) also gets every scalar, as `split/name`; its run
  is the caller's to finish, since the summary comes after the writer closes.
  """

  def __init__(self, workdir: str | os.PathLike, is_main_process: bool | None = None,
               tracker=None):
    if is_main_process is None:
      is_main_process = jax.process_index() == 0
    self.is_main_process = is_main_process
    self.workdir = os.fspath(workdir)
    self.metrics_path = os.path.join(self.workdir, METRICS_FILENAME)
    self.events_dir = os.path.join(self.workdir, EVENTS_SUBDIR)
    self.tracker = tracker
    self._summary_writer = None
    self._jsonl_file: TextIO | None = None
    # Tensorboard hides every event at or after this step that came from an
    # earlier (killed) run; set by `truncate_after`.
    self._purge_step: int | None = None

  def _tensorboard(self):
    if self._summary_writer is None:
      # Imported here so that importing this module (e.g. for the statistics
      # functions) does not pay for tensorboardX.
      SummaryWriter = _import_summary_writer()  # pylint: disable=invalid-name

      # tensorboardX names event files by the second and host name only; two
      # writers opened within one second (truncate + reopen) would clobber each
      # other. A nanosecond suffix keeps names unique and in creation order.
      self._summary_writer = SummaryWriter(
          logdir=self.events_dir,
          purge_step=self._purge_step,
          flush_secs=30,
          filename_suffix=f".{time.time_ns()}",
      )
    return self._summary_writer

  def _jsonl(self) -> TextIO:
    if self._jsonl_file is None:
      os.makedirs(self.workdir, exist_ok=True)
      self._jsonl_file = open(self.metrics_path, "a", encoding="utf-8")
    return self._jsonl_file

  def write_scalars(self, step: int, scalars: Mapping[str, Any], split: str = "train"):
    """Logs `scalars` (name -> number, host or device value) at `step`."""
    if not self.is_main_process:
      return
    step = int(step)
    values = {name: float(np.asarray(value)) for name, value in scalars.items()}
    writer = self._tensorboard()
    for name, value in values.items():
      writer.add_scalar(f"{split}/{name}", value, global_step=step)
    # NaN/inf are kept (json writes NaN/Infinity, Python reads them back): a
    # diverged run must show up in the file, not vanish from it.
    record = {"step": step, "split": split, **values}
    jsonl = self._jsonl()
    jsonl.write(json.dumps(record) + "\n")
    # Flushed every call so a killed run loses at most the line being written.
    jsonl.flush()
    if self.tracker is not None:
      self.tracker.log(step, split, values)

  def write_text(self, tag: str, text: str, step: int = 0):
    """Logs a text blob, e.g. the resolved config, as a tensorboard text summary."""
    if not self.is_main_process:
      return
    self._tensorboard().add_text(tag, text, global_step=int(step))

  def truncate_after(self, step: int):
    """Forgets everything logged after `step`, for a run resumed from `step`.

    Rewrites metrics.jsonl without the lines of later steps (and without a torn
    last line from a killed write), and makes tensorboard hide the later events
    of the earlier run, so no step appears twice after a resume.
    """
    if not self.is_main_process:
      return
    step = int(step)
    self._close_jsonl()
    if os.path.exists(self.metrics_path):
      kept = [r for r in _read_jsonl(self.metrics_path) if r["step"] <= step]
      tmp_path = self.metrics_path + ".tmp"
      with open(tmp_path, "w", encoding="utf-8") as f:
        for record in kept:
          f.write(json.dumps(record) + "\n")
      os.replace(tmp_path, self.metrics_path)  # atomic: never a half-written file
    # The purge marker is written when a tensorboard writer opens, so reopen.
    self._purge_step = step + 1
    self._close_tensorboard()

  def flush(self):
    if self._summary_writer is not None:
      self._summary_writer.flush()
    if self._jsonl_file is not None:
      self._jsonl_file.flush()

  def close(self):
    self._close_tensorboard()
    self._close_jsonl()

  def _close_tensorboard(self):
    if self._summary_writer is not None:
      self._summary_writer.close()
      self._summary_writer = None

  def _close_jsonl(self):
    if self._jsonl_file is not None:
      self._jsonl_file.close()
      self._jsonl_file = None

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # torn line from a killed process
      if isinstance(record, dict) and "step" in record:
        records.append(record)
  return records


SUMMARY_FILENAME = "summary.json"  # written by train.train into each run folder


def read_summary(workdir: str | os.PathLike) -> dict[str, Any]:
  """A run's summary.json, or {} when the run has not written one."""
  path = os.path.join(workdir, SUMMARY_FILENAME)
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """All records of `workdir/metrics.jsonl`, in file order ([] if none yet)."""
  path = os.path.join(os.fspath(workdir), METRICS_FILENAME)
  if not os.path.exists(path):
    return []
  return _read_jsonl(path)


def read_scalar_series(
    workdir: str | os.PathLike, name: str, split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one scalar, sorted by step.

  If a step was logged twice (a resumed run that did not truncate), the later
  line wins, since it comes from the run that continued.
  """
  by_step = {}
  for record in read_metrics(workdir):
    if record.get("split") == split and name in record:
      by_step[int(record["step"])] = float(record[name])
  steps = np.array(sorted(by_step), dtype=np.int64)
  values = np.array([by_step[s] for s in steps], dtype=np.float64)
  return steps, values


_LAYER_KEY = re.compile(r"^(?P<statistic>.+)/layer_(?P<layer>\d+)$")


def read_layer_series(
    workdir: str | os.PathLike, statistic: str, split: str = "layers"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(steps_S, layers_L, values_SxL) of every `<statistic>/layer_NN` scalar of a run.

  E.g. statistic "residual_rms" (split "layers": the stream after the embedding and each
  block) or "grad_norm" (split "train"). Rows are the steps that logged the statistic,
  columns the layer indices in order; a layer missing at some step is NaN there. A step
  logged twice keeps the later line, as in `read_scalar_series`.
  """
  by_step: dict[int, dict[int, float]] = {}
  for record in read_metrics(workdir):
    if record.get("split") != split:
      continue
    for key, value in record.items():
      match = _LAYER_KEY.match(key)
      if match and match["statistic"] == statistic:
        by_step.setdefault(int(record["step"]), {})[int(match["layer"])] = float(value)
  steps = np.array(sorted(by_step), dtype=np.int64)
  layers = np.array(sorted({layer for row in by_step.values() for layer in row}), dtype=np.int64)
  values = np.full((len(steps), len(layers)), np.nan)
  for row_index, step in enumerate(steps):
    for column, layer in enumerate(layers):
      values[row_index, column] = by_step[int(step)].get(int(layer), np.nan)
  return steps, layers, values


# ---------------------------------------------------------------------------
# Per-layer statistics (pure JAX, jit-able).
# ---------------------------------------------------------------------------

_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)(?:\.|$)")
_EMBED_NAMES = re.compile(r"embed|wte|wpe|positions")


def default_layer_of_path(path: str) -> str:
  """'blocks.3.mlp.kernel' -> 'layer_03'; token/position embeddings -> 'embed'; rest -> 'head'.

  A model whose parameters are named differently passes its own function.
  """
  match = _BLOCK_INDEX.search(path)
  if match:
    return f"layer_{int(match.group(1)):02d}"
  if _EMBED_NAMES.search(path):
    return "embed"
  return "head"


def _sum_of_squares_by_layer(tree, layer_of_path: Callable[[str], str]) -> dict[str, jax.Array]:
  # The grouping runs in Python at trace time, so under jit it costs nothing.
  totals: dict[str, jax.Array] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    layer = layer_of_path(path_to_string(path))
    leaf_sum = jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
    totals[layer] = totals[layer] + leaf_sum if layer in totals else leaf_sum
  return totals


def per_layer_norms(
    tree, layer_of_path: Callable[[str], str] = default_layer_of_path
) -> dict[str, jax.Array]:
  """Global L2 norm of each layer's group of leaves, e.g. of the gradient tree."""
  sums = _sum_of_squares_by_layer(tree, layer_of_path)
  return {layer: jnp.sqrt(total) for layer, total in sums.items()}


def update_ratio(
    updates, params, layer_of_path: Callable[[str], str] = default_layer_of_path
) -> dict[str, jax.Array]:
  """||update|| / ||param|| per layer: how far one optimizer step moves each layer."""
  update_norms = per_layer_norms(updates, layer_of_path)
  param_norms = per_layer_norms(params, layer_of_path)
  if update_norms.keys() != param_norms.keys():
    raise ValueError(
        "updates and params group into different layers:"
        f" {sorted(update_norms)} vs {sorted(param_norms)}"
    )
  # A layer whose params are all zero would divide by zero; report a large but
  # finite ratio instead of inf so the scalar still plots.
  tiny = jnp.finfo(jnp.float32).tiny
  return {
      layer: update_norms[layer] / jnp.maximum(param_norms[layer], tiny)
      for layer in update_norms
  }


def residual_stats(streams: Sequence[jax.Array]) -> dict[str, jax.Array]:
  """RMS and mean |x| of the residual stream after each layer.

  `streams[i]` is layer i's output, shape (batch, length, d_model). Computed in
  float32 because a bf16 mean over millions of squares loses the digits we want.
  """
  stats = {}
  for index, stream in enumerate(streams):
    x = jnp.asarray(stream, jnp.float32)
    stats[f"residual_rms/layer_{index:02d}"] = jnp.sqrt(jnp.mean(jnp.square(x)))
    stats[f"residual_mean_abs/layer_{index:02d}"] = jnp.mean(jnp.abs(x))
  return stats


def _safe_norm(x: jax.Array) -> jax.Array:
  """L2 norm over the last axis whose gradient is 0, not NaN, at x = 0."""
  squared = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
  positive = squared > 0
  # Double `where`: sqrt never sees 0, so its infinite derivative never meets
  # the zero cotangent and turns into NaN.
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def token_angles(x_before: jax.Array, x_after: jax.Array) -> jax.Array:
  """The angle (radians, in [0, pi]) between x_before and x_after at every token.

  Vectors live on the last axis; the result has the leading axes. arccos of the
  cosine is useless for small angles: in float32, cos(1e-4) rounds to 1 and
  arccos returns 0. Instead we use the half-angle form
  angle = 2 atan2(|u - v|, |u + v|) of the unit vectors u, v (the
  atan2(|cross|, dot) idea generalised to any dimension), which is accurate
  from 0 to pi, needs no clipping, and together with `_safe_norm` has a finite
  gradient when the two vectors coincide. A zero vector has no direction; its
  angle is reported as 0.
  """
  x = jnp.asarray(x_before, jnp.float32)
  y = jnp.asarray(x_after, jnp.float32)
  x_norm, y_norm = _safe_norm(x), _safe_norm(y)
  u = x / jnp.where(x_norm > 0, x_norm, 1.0)
  v = y / jnp.where(y_norm > 0, y_norm, 1.0)
  angle = 2.0 * jnp.arctan2(_safe_norm(u - v), _safe_norm(u + v))
  has_direction = (x_norm > 0) & (y_norm > 0)
  return jnp.where(has_direction, angle, 0.0)[..., 0]


def angle_between(x_before: jax.Array, x_after: jax.Array) -> jax.Array:
  """Mean angle (radians) between x_before and x_after over all tokens (`token_angles`)."""
  return jnp.mean(token_angles(x_before, x_after))


def max_angle_between(x_before: jax.Array, x_after: jax.Array) -> jax.Array:
  """Largest angle (radians) between x_before and x_after over all tokens (`token_angles`)."""
  return jnp.max(token_angles(x_before, x_after))


# ---------------------------------------------------------------------------
# Throughput.
# ---------------------------------------------------------------------------


def model_flops_per_token(
    num_params_non_embedding: int, num_layers: int, d_model: int, seq_len: int
) -> float:
  """Training FLOPs per token: 6 N + 12 L d T.

  6N counts forward (2 FLOPs per multiply-add per weight) plus backward (twice
  the forward) for every non-embedding weight; 12 L d T adds the attention
  score and value matmuls (QK^T and AV, 2 * 2 L d T forward, times 3 for
  forward + backward), which have no weights. This is the estimate of PaLM
  (Chowdhery et al. 2022, appendix B) and nanoGPT; it ignores the causal mask
  (counts the full T x T scores), norms, and softmax.
  """
  return 6.0 * num_params_non_embedding + 12.0 * num_layers * d_model * seq_len


def mfu(
    tokens_per_s: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float
) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak."""
  return tokens_per_s * flops_per_token / (num_devices * peak_flops_per_device)


# Dense peak FLOP/s per chip for the matmul unit XLA uses at default precision.
# Low precision = bf16/fp16. For float32, TPUs run default-precision matmuls as
# one bf16 pass (same peak) and NVIDIA Ampere/Hopper GPUs use TF32 tensor cores.
# Matched by substring of the lower-cased `device.device_kind`, first match
# wins, so the more specific names come first.
_PEAK_FLOPS = (
    # (device_kind substring, low-precision peak, float32 peak)
    ("tpu v6 lite", 918e12, 918e12),
    ("tpu v6e", 918e12, 918e12),
    ("tpu v5 lite", 197e12, 197e12),
    ("tpu v5e", 197e12, 197e12),
    ("tpu v5p", 459e12, 459e12),
    ("tpu v5", 459e12, 459e12),
    ("tpu v4", 275e12, 275e12),
    ("h200", 989e12, 494.5e12),  # same compute die as the H100 SXM
    ("h100", 989e12, 494.5e12),  # SXM; the PCIe card is slower
    ("a100", 312e12, 156e12),
)


def device_peak_flops(device_kind: str, dtype: Any, default: float) -> float:
  """Peak FLOP/s of one device for matmuls in `dtype`; `default` if unknown (e.g. CPU)."""
  dtype_name = jnp.dtype(dtype).name
  if dtype_name in ("bfloat16", "float16"):
    column = 1
  elif dtype_name == "float32":
    column = 2
  else:
    return default
  kind = device_kind.lower()
  for row in _PEAK_FLOPS:
    if row[0] in kind:
      return row[column]
  return default


def _format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?:??:??"
  seconds = int(round(seconds))
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressBar:
  """A one-line progress bar with steps/s, ETA and the last loss.

  On a terminal the line is redrawn in place (\\r), at most ten times a second.
  Into a file (a batch job's log) it prints a plain line every `plain_every`
  steps instead, since \\r would leave thousands of fragments. The rate is
  measured from the first `update`, so the first step's compile time does not
  pollute the ETA.
  """

  def __init__(
      self,
      total_steps: int,
      start_step: int = 0,
      *,
      stream: TextIO | None = None,
      plain_every: int | None = None,
      enabled: bool | None = None,
      width: int = 30,
  ):
    self.total_steps = int(total_steps)
    self.start_step = int(start_step)
    self.stream = sys.stderr if stream is None else stream
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self.plain_every = plain_every or max(1, self.total_steps // 20)
    self.width = width
    self._first_time: float | None = None
    self._first_step = self.start_step
    self._last_draw = 0.0
    self.last_loss: float | None = None
    self.step = self.start_step

  def steps_per_second(self, now: float | None = None) -> float:
    if self._first_time is None:
      return float("nan")
    elapsed = (time.monotonic() if now is None else now) - self._first_time
    done = self.step - self._first_step
    return done / elapsed if elapsed > 0 and done > 0 else float("nan")

  def render(self, now: float | None = None) -> str:
    fraction = min(1.0, self.step / self.total_steps) if self.total_steps > 0 else 1.0
    filled = int(round(fraction * self.width))
    rate = self.steps_per_second(now)
    remaining = (self.total_steps - self.step) / rate if rate > 0 else float("nan")
    line = (
        f"step {self.step}/{self.total_steps} [{'#' * filled}{'-' * (self.width - filled)}]"
        f" {100 * fraction:5.1f}% {rate:.2f} steps/s ETA {_format_duration(remaining)}"
    )
    if self.last_loss is not None:
      line += f" loss {self.last_loss:.4f}"
    return line

  def update(self, step: int, loss: float | None = None):
    """Records that `step` is done (and its loss, a host float) and maybe redraws."""
    if not self.enabled:
      return
    now = time.monotonic()
    if self._first_time is None:
      self._first_time, self._first_step = now, int(step)
    self.step = int(step)
    if loss is not None:
      self.last_loss = float(loss)
    finished = self.step >= self.total_steps
    if self.is_tty:
      if finished or now - self._last_draw >= 0.1:
        self._last_draw = now
        self.stream.write("\r" + self.render(now))
        self.stream.flush()
    elif finished or self.step % self.plain_every == 0:
      self.stream.write(self.render(now) + "\n")
      self.stream.flush()

  def close(self):
    """Ends the redrawn line so later output starts on a fresh one."""
    if self.enabled and self.is_tty:
      self.stream.write("\n")
      self.stream.flush()
