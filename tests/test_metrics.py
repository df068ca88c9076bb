"""Tests for geonorm_jax.training.metrics: logging round trips, per-layer statistics, throughput."""
import io
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from geonorm_jax.training import metrics


def _tensorboard_scalars(workdir, tag):
  accumulator = event_accumulator.EventAccumulator(
      os.path.join(workdir, metrics.EVENTS_SUBDIR), size_guidance={event_accumulator.SCALARS: 0}
  )
  accumulator.Reload()
  return [(event.step, event.value) for event in accumulator.Scalars(tag)]


# --- MetricsWriter -----------------------------------------------------------


def test_tensorboard_events_read_back(tmp_path):
  writer = metrics.MetricsWriter(tmp_path, is_main_process=True)
  writer.write_scalars(10, {"loss": 2.5, "lr": jnp.float32(1e-3)})
  writer.write_scalars(20, {"loss": np.float32(1.25)})
  writer.write_scalars(20, {"loss": 3.0}, split="eval")
  writer.write_text("config", "model:\n  d_model: 64")
  writer.close()

  assert _tensorboard_scalars(tmp_path, "train/loss") == [(10, 2.5), (20, 1.25)]
  assert _tensorboard_scalars(tmp_path, "eval/loss") == [(20, 3.0)]
  (step, lr), = _tensorboard_scalars(tmp_path, "train/lr")
  assert step == 10 and lr == pytest.approx(1e-3)


def test_jsonl_round_trip_and_series(tmp_path):
  with metrics.MetricsWriter(tmp_path, is_main_process=True) as writer:
    writer.write_scalars(1, {"loss": 4.0, "grad_norm": 0.5})
    writer.write_scalars(2, {"loss": float("nan")})
    writer.write_scalars(2, {"loss": 3.5}, split="eval")

  records = metrics.read_metrics(tmp_path)
  assert records[0] == {"step": 1, "split": "train", "loss": 4.0, "grad_norm": 0.5}
  assert math.isnan(records[1]["loss"])  # a diverged step is recorded, not dropped
  steps, values = metrics.read_scalar_series(tmp_path, "loss", "eval")
  np.testing.assert_array_equal(steps, [2])
  np.testing.assert_array_equal(values, [3.5])
  steps, _ = metrics.read_scalar_series(tmp_path, "grad_norm")
  np.testing.assert_array_equal(steps, [1])


def test_layer_series_gathers_layers_by_index(tmp_path):
  lines = [
      {"step": 0, "split": "layers", "residual_rms/layer_00": 1.0, "residual_rms/layer_10": 3.0,
       "residual_rms/layer_02": 2.0, "stream_angle/layer_00": 9.0},
      {"step": 0, "split": "train", "residual_rms/layer_00": 99.0},  # another split
      {"step": 5, "split": "layers", "residual_rms/layer_00": 4.0},  # layers 2 and 10 missing
      {"step": 5, "split": "layers", "residual_rms/layer_00": 5.0,  # a rerun of step 5 wins
       "residual_rms/layer_02": 6.0},
  ]
  (tmp_path / metrics.METRICS_FILENAME).write_text("".join(json.dumps(l) + "\n" for l in lines))
  steps, layers, values = metrics.read_layer_series(tmp_path, "residual_rms")
  np.testing.assert_array_equal(steps, [0, 5])
  np.testing.assert_array_equal(layers, [0, 2, 10])  # numeric order, not file order
  np.testing.assert_array_equal(values, [[1.0, 2.0, 3.0], [5.0, 6.0, np.nan]])
  steps, layers, values = metrics.read_layer_series(tmp_path, "residual_rms", split="train")
  np.testing.assert_array_equal(values, [[99.0]])
  steps, layers, values = metrics.read_layer_series(tmp_path, "grad_norm")
  assert values.shape == (0, 0) and len(steps) == 0 and len(layers) == 0


def test_resume_truncates_jsonl_and_tensorboard(tmp_path):
  writer = metrics.MetricsWriter(tmp_path, is_main_process=True)
  for step in range(1, 6):
    writer.write_scalars(step, {"loss": float(step)})
  writer.close()
  with open(tmp_path / metrics.METRICS_FILENAME, "a") as f:
    f.write('{"step": 6, "split": "tr')  # torn line of a killed process

  # A new process restored the step-3 checkpoint and redoes steps 4 and 5.
  resumed = metrics.MetricsWriter(tmp_path, is_main_process=True)
  resumed.truncate_after(3)
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3]
  for step in (4, 5):
    resumed.write_scalars(step, {"loss": 10.0 * step})
  resumed.close()

  steps, values = metrics.read_scalar_series(tmp_path, "loss")
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
  np.testing.assert_array_equal(values, [1, 2, 3, 40, 50])
  expected = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
  assert _tensorboard_scalars(tmp_path, "train/loss") == expected


def test_non_main_process_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  writer = metrics.MetricsWriter(workdir, is_main_process=False)
  writer.write_scalars(1, {"loss": 1.0})
  writer.write_text("config", "x")
  writer.truncate_after(0)
  writer.flush()
  writer.close()
  assert not workdir.exists()
  assert metrics.read_metrics(workdir) == []


# --- per-layer statistics ------------------------------------------------------


def test_residual_stats_match_numpy():
  rng = np.random.default_rng(0)
  streams = [rng.normal(size=(2, 3, 8)).astype(np.float32) * scale for scale in (1.0, 5.0)]
  stats = jax.jit(metrics.residual_stats)([jnp.asarray(s, jnp.bfloat16) for s in streams])
  for index, stream in enumerate(streams):
    as_bf16 = np.asarray(jnp.asarray(stream, jnp.bfloat16), np.float32)
    rms = stats[f"residual_rms/layer_{index:02d}"]
    mean_abs = stats[f"residual_mean_abs/layer_{index:02d}"]
    assert rms.dtype == jnp.float32
    np.testing.assert_allclose(rms, np.sqrt(np.mean(as_bf16**2)), rtol=1e-6)
    np.testing.assert_allclose(mean_abs, np.mean(np.abs(as_bf16)), rtol=1e-6)


def _toy_tree(seed):
  rng = np.random.default_rng(seed)
  return {
      "embed": {"embedding": rng.normal(size=(5, 4))},
      "blocks": [
          {"attn": {"kernel": rng.normal(size=(4, 4))}, "norm": {"scale": rng.normal(size=(4,))}},
          {"attn": {"kernel": rng.normal(size=(4, 4))}, "norm": {"scale": rng.normal(size=(4,))}},
      ],
      "final_norm": {"scale": rng.normal(size=(4,))},
  }


def test_default_layer_of_path():
  assert metrics.default_layer_of_path("blocks.3.attn.kernel") == "layer_03"
  assert metrics.default_layer_of_path("blocks.12.mlp.value") == "layer_12"
  assert metrics.default_layer_of_path("embed.embedding") == "embed"
  assert metrics.default_layer_of_path("positions.value") == "embed"  # GPT-2 learned positions
  assert metrics.default_layer_of_path("final_norm.scale") == "head"


def test_per_layer_norms_and_update_ratio_match_numpy():
  grads, params = _toy_tree(1), _toy_tree(2)

  def numpy_norm(tree, layer):
    if layer == "embed":
      leaves = [tree["embed"]["embedding"]]
    elif layer == "head":
      leaves = [tree["final_norm"]["scale"]]
    else:
      block = tree["blocks"][int(layer[-2:])]
      leaves = [block["attn"]["kernel"], block["norm"]["scale"]]
    return np.sqrt(sum(np.sum(leaf**2) for leaf in leaves))

  norms = jax.jit(metrics.per_layer_norms)(grads)
  assert sorted(norms) == ["embed", "head", "layer_00", "layer_01"]
  ratios = jax.jit(metrics.update_ratio)(grads, params)
  for layer in norms:
    np.testing.assert_allclose(norms[layer], numpy_norm(grads, layer), rtol=1e-5)
    expected_ratio = numpy_norm(grads, layer) / numpy_norm(params, layer)
    np.testing.assert_allclose(ratios[layer], expected_ratio, rtol=1e-5)


def _rotated_pair(angle, dim=64, seed=0):
  """Two vectors of different lengths in a random plane, `angle` radians apart."""
  rng = np.random.default_rng(seed)
  basis, _ = np.linalg.qr(rng.normal(size=(dim, 2)))
  e1, e2 = basis[:, 0], basis[:, 1]
  return 3.0 * e1, 0.5 * (np.cos(angle) * e1 + np.sin(angle) * e2)


def test_angle_between_known_angles():
  before, after = _rotated_pair(0.3)
  # Tokens on leading axes: the mean over (batch, length) of identical angles.
  x = jnp.asarray(np.broadcast_to(before, (2, 3, 64)), jnp.float32)
  y = jnp.asarray(np.broadcast_to(after, (2, 3, 64)), jnp.float32)
  np.testing.assert_allclose(metrics.angle_between(x, y), 0.3, rtol=1e-5)
  np.testing.assert_allclose(metrics.angle_between(x, -x), np.pi, rtol=1e-5)
  # In float32 arccos(cos(1e-4)) is 0; the atan2 form must still resolve it.
  small_before, small_after = _rotated_pair(1e-4, seed=1)
  small = metrics.angle_between(
      jnp.asarray(small_before, jnp.float32), jnp.asarray(small_after, jnp.float32)
  )
  np.testing.assert_allclose(small, 1e-4, rtol=1e-2)


def test_angle_between_nan_free_for_identical_vectors():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)
  value_and_grads = jax.value_and_grad(metrics.angle_between, argnums=(0, 1))
  value, (grad_before, grad_after) = value_and_grads(x, x)
  assert float(value) == 0.0
  assert np.all(np.isfinite(grad_before)) and np.all(np.isfinite(grad_after))
  zero_value, zero_grad = jax.value_and_grad(metrics.angle_between)(jnp.zeros((3, 16)), x[:3])
  assert float(zero_value) == 0.0 and np.all(np.isfinite(zero_grad))


# --- throughput ----------------------------------------------------------------


def test_mfu_and_flops_arithmetic():
  assert metrics.model_flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
  # 1e4 tokens/s * 1e9 FLOPs/token = 1e13 FLOP/s over 4 devices of 1e13 peak -> 25 %.
  assert metrics.mfu(1e4, 1e9, 4, 1e13) == pytest.approx(0.25)
  assert metrics.device_peak_flops("TPU v4", "bfloat16", 1.0) == 275e12
  assert metrics.device_peak_flops("TPU v5 lite", jnp.bfloat16, 1.0) == 197e12
  assert metrics.device_peak_flops("TPU v5p", "bfloat16", 1.0) == 459e12
  assert metrics.device_peak_flops("TPU v6 lite", "bfloat16", 1.0) == 918e12
  assert metrics.device_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16", 1.0) == 989e12
  assert metrics.device_peak_flops("NVIDIA H200", "bfloat16", 1.0) == 989e12
  assert metrics.device_peak_flops("NVIDIA A100-SXM4-80GB", "float32", 1.0) == 156e12
  assert metrics.device_peak_flops("cpu", "float32", 1e11) == 1e11


# --- ProgressBar ---------------------------------------------------------------


def test_progress_bar_plain_lines(monkeypatch):
  clock = iter([100.0, 101.0, 102.0, 103.0, 104.0])
  monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
  stream = io.StringIO()  # not a tty -> plain lines every `plain_every` steps
  bar = metrics.ProgressBar(total_steps=8, start_step=0, stream=stream, plain_every=2, enabled=True)
  for step in (1, 2, 3, 4):
    bar.update(step, loss=1.0 / step)
  lines = stream.getvalue().splitlines()
  assert len(lines) == 2 and "\r" not in stream.getvalue()
  # 3 steps (1 -> 4) in 3 s: 1 step/s, 4 steps left -> 4 s.
  assert lines[-1].startswith("step 4/8") and "1.00 steps/s" in lines[-1]
  assert "ETA 0:00:04" in lines[-1] and "loss 0.2500" in lines[-1]

