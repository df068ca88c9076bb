"""Loss and gradient-norm spikes: a z-score against the previous steps' running statistics.

The rule of OLMo-core's `SkipStepOptimizer` (src/olmo_core/optim/skip_step_optimizer.py) and
llm.c's `OutlierDetector` (llmc/outlier_detector.h, read by train_gpt2.cu's -sl / -sg flags):
a step is a spike when its loss or its global gradient norm lies more than `threshold`
standard deviations above the mean of the same quantity over a window of earlier steps.

The choices, each from one of the two:
* a window of the previous WINDOW = 128 finite values (OLMo-core's rolling_interval_length,
  llm.c's OUTLIER_DETECTOR_WINDOW_SIZE), not an exponential average: two arrays of 128
  floats in the train state, so a resumed run judges every later step exactly as an
  uninterrupted one, and a hand computation over a list checks it;
* the current value is not in its own window (OLMo-core; llm.c's includes it, which caps
  any z-score at sqrt(W - 1) and lets the outlier raise its own threshold);
* the sample standard deviation (n - 1, torch.std's default in OLMo-core);
* one-sided, z > threshold (llm.c; OLMo-core compares |z|, which also flags a sudden drop);
* judged once `warmup` values are in the window (OLMo-core: max(20, 128 // 2) = 64;
  llm.c: a full window), the default threshold 6 being OLMo-core's sigma_factor;
* a flagged step's values still enter the window (OLMo-core), so a lasting jump in the loss
  stops being flagged once the window has seen it; non-finite values never enter it (they
  are `train.on_divergence`'s business).

Everything here runs inside the jitted train step, so a spike's update can be dropped there
(`train.skip_spikes`) without a second forward/backward pass or a host round trip.
"""
import jax
import jax.numpy as jnp
import numpy as np

WINDOW = 128
QUANTITIES = ("loss", "grad_norm")


def init(window=WINDOW):
  """Empty running statistics: the last `window` finite values of each quantity (a ring
  buffer, slot count % window written next) and how many were ever written."""
  stats = {f"{name}_W": jnp.zeros((window,), jnp.float32) for name in QUANTITIES}
  stats["count"] = jnp.zeros((), jnp.int32)
  return stats


def _moments(values_W, count):
  """Mean and sample standard deviation of the filled slots (all of them once wrapped)."""
  window = values_W.shape[0]
  n = jnp.minimum(count, window).astype(jnp.float32)
  filled_W = jnp.arange(window) < count
  mean = jnp.sum(jnp.where(filled_W, values_W, 0.0)) / jnp.maximum(n, 1.0)
  square_W = jnp.where(filled_W, jnp.square(values_W - mean), 0.0)
  return mean, jnp.sqrt(jnp.sum(square_W) / jnp.maximum(n - 1.0, 1.0))


def observe(stats, loss, grad_norm, threshold, warmup):
  """Judges one step against the window, then adds its values to it.

  Returns (new stats, is_spike, values): values holds `{q}_z` for q in loss, grad_norm
  (NaN while fewer than `warmup` values are known; 0 when the window is constant, as llm.c)
  and the `{q}_mean`, `{q}_std` it was judged against. threshold 0 turns the flag off; the
  window is kept either way, so turning it on later has a history.
  """
  window, count = stats["loss_W"].shape[0], stats["count"]
  judged = jnp.minimum(count, window) >= warmup
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  values, above, new_stats = {}, [], {}
  for name, value in zip(QUANTITIES, (loss, grad_norm)):
    value = jnp.asarray(value, jnp.float32)
    mean, std = _moments(stats[f"{name}_W"], count)
    z = jnp.where(std > 0, (value - mean) / jnp.where(std > 0, std, 1.0), 0.0)
    values[f"{name}_z"] = jnp.where(judged, z, jnp.nan)
    values[f"{name}_mean"], values[f"{name}_std"] = mean, std
    above.append(z > threshold)
    slot = count % window
    new_stats[f"{name}_W"] = jnp.where(finite, stats[f"{name}_W"].at[slot].set(value),
                                       stats[f"{name}_W"])
  new_stats["count"] = count + finite.astype(jnp.int32)
  is_spike = (threshold > 0) & judged & finite & (above[0] | above[1])
  return new_stats, is_spike, values


def to_json(stats):
  """The statistics as JSON (float32 -> Python float -> float32 is exact), for a
  checkpoint's meta: checkpoints written before the statistics existed still restore."""
  host = jax.device_get(stats)
  return {key: np.asarray(value).tolist() for key, value in host.items()}


def from_json(saved, abstract):
  """Arrays in `abstract`'s shardings from `to_json`'s output; None (a checkpoint without
  them) or another window size gives an empty window, judged again after the warm-up."""
  host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
  if saved is not None and all(np.shape(saved.get(k)) == host[k].shape for k in host):
    host = {k: np.asarray(saved[k], host[k].dtype) for k in host}
  # make_array_from_callback, not device_put: every process builds its own shards of a
  # replicated array, which device_put cannot do for devices of other hosts.
  return {k: jax.make_array_from_callback(host[k].shape, abstract[k].sharding,
                                          lambda index, value=host[k]: value[index])
          for k in host}
