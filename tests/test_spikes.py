"""Spikes (training/spikes.py): the z-score rule against a hand computation, the skipped
update inside the jitted step, every logged spike of a short run against the rule applied to
its own logged losses, and a resumed run that judges the same steps the same way."""
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geonorm_jax.data import windows as data_lib
from geonorm_jax.training import checkpoint as checkpoint_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics
from geonorm_jax.training import spikes
from geonorm_jax.training import train as train_lib

STEPS, THRESHOLD, WARMUP = 30, 0.5, 5
# One block of width 32: the run is its compilation. Per-layer statistics at every step, so
# each spike's own statistics can be checked against the loop's `layers` record.
TINY = ("tiny,num_layers=1,d_model=32,num_heads=2,seq_len=16,max_seq_len=16,batch_size=8,"
        "train.warmup_steps=3,train.log_every=1,train.eval_every=10,train.eval_batches=1,"
        "train.layer_stats_every=1,train.progress_bar=false,checkpoint.every=10,"
        f"train.steps={STEPS},train.spike_zscore={THRESHOLD},train.spike_warmup={WARMUP}")


def _config(extra=""):
  return config_lib.get_config(TINY + (f",{extra}" if extra else ""))


def _hand_zscores(pairs, window, warmup):
  """z of each (loss, grad_norm) against the previous `window` finite pairs, in float64:
  sample std, NaN before `warmup` pairs, 0 for a constant window."""
  history, out = [], []
  for pair in pairs:
    if len(history) >= warmup:
      previous = np.array(history[-window:], np.float64)
      mean, std = previous.mean(axis=0), previous.std(axis=0, ddof=1)
      out.append(tuple((v - m) / s if s > 0 else 0.0 for v, m, s in zip(pair, mean, std)))
    else:
      out.append((float("nan"), float("nan")))
    if all(np.isfinite(pair)):
      history.append(pair)
  return out


def test_zscores_against_a_hand_computation():
  losses = [1.0, 2.0, 9.0, 3.0, 2.5, float("nan"), 7.0, 100.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
  grad_norms = [1.0, 1.1, 0.9, 1.0, 1.05, 2.0, 0.95, 1.0, 5.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0]
  observe = jax.jit(functools.partial(spikes.observe, threshold=2.0, warmup=3))
  stats, got = spikes.init(window=4), []
  for loss, grad_norm in zip(losses, grad_norms):
    stats, is_spike, values = observe(stats, jnp.float32(loss), jnp.float32(grad_norm))
    got.append((bool(is_spike), float(values["loss_z"]), float(values["grad_norm_z"])))
  # Worked by hand: 3.0 after (1, 2, 9): mean 4, sample std sqrt(38/2) -> z = -1/sqrt(19).
  assert got[3][1] == pytest.approx(-1 / np.sqrt(19), rel=1e-6)
  # 100.0 after (9, 3, 2.5, 7) (the NaN step never entered): mean 5.375, squares 29.6875/3.
  assert got[7][1] == pytest.approx(94.625 / np.sqrt(29.6875 / 3), rel=1e-6)
  as_float32 = lambda values: [float(np.float32(v)) for v in values]
  expected = _hand_zscores(list(zip(as_float32(losses), as_float32(grad_norms))), window=4,
                           warmup=3)
  for step, ((flag, loss_z, grad_z), (hand_loss_z, hand_grad_z)) in enumerate(zip(got, expected)):
    np.testing.assert_allclose([loss_z, grad_z], [hand_loss_z, hand_grad_z], rtol=1e-5,
                               err_msg=f"step {step}")
    finite = np.isfinite(losses[step]) and np.isfinite(grad_norms[step])
    assert flag == (finite and (hand_loss_z > 2.0 or hand_grad_z > 2.0)), step
  # The loss spike (100) and the gradient-norm spike (5.0) after it; the NaN step is never a
  # spike although its gradient norm lies 11.6 std above; a constant window gives z = 0.
  assert [step for step, (flag, _, _) in enumerate(got) if flag] == [7, 8]
  assert got[5][2] == pytest.approx(0.9875 / np.sqrt(0.021875 / 3), rel=1e-5)
  assert got[-1][1:] == (0.0, 0.0)


def test_threshold_zero_flags_nothing_but_keeps_the_window():
  observe = jax.jit(functools.partial(spikes.observe, threshold=0.0, warmup=2))
  stats = spikes.init(window=4)
  for loss in (1.0, 1.1, 1e6):
    stats, is_spike, _ = observe(stats, jnp.float32(loss), jnp.float32(1.0))
    assert not bool(is_spike)
  assert int(stats["count"]) == 3


def _flagging_window(loss_value):
  """A full window around `loss_value` / 10 with a small spread: any real loss is far above."""
  values = np.full(spikes.WINDOW, loss_value / 10, np.float32)
  values[::2] *= 1.01
  return {"loss_W": jnp.asarray(values), "grad_norm_W": jnp.ones(spikes.WINDOW, jnp.float32),
          "count": jnp.asarray(spikes.WINDOW, jnp.int32)}


@pytest.mark.parametrize("skip", [True, False])
def test_skip_spikes_drops_exactly_the_flagged_update(skip):
  """Inside the jitted step: a flagged step leaves params and opt_state bit for bit as they
  were (the step counter and the window advance); without skip_spikes the same step updates."""
  # No warm-up of the LR: the first update moves every parameter.
  config = _config(f"train.skip_spikes={str(skip).lower()},train.spike_zscore=6,"
                   "train.warmup_steps=0")
  setup = train_lib.make_setup(config, jax.devices()[:1])
  state = train_lib.init_state(setup)
  state = dict(state, spike=_flagging_window(np.log(config.model.vocab_size)))
  before = jax.device_get(state)
  tokens = train_lib.global_batch(setup, next(data_lib.make_train_iterator(config)))
  after, step_metrics = train_lib.make_train_step(setup)(state, tokens)
  assert float(step_metrics["spike"]) == 1.0 and float(step_metrics["loss_z"]) > 6
  after = jax.device_get(after)
  assert int(after["step"]) == 1 and int(after["spike"]["count"]) == spikes.WINDOW + 1
  old = jax.tree.leaves((before["params"], before["opt_state"]))
  new = jax.tree.leaves((after["params"], after["opt_state"]))
  unchanged = [np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(old, new)]
  assert all(unchanged) if skip else not all(unchanged)
  # The spike's own per-layer statistics came out of the step (taken before the update).
  assert float(step_metrics["spike/residual_rms/layer_00"]) > 0


# --- a short run ------------------------------------------------------------------------------


def _records(workdir, split):
  return [r for r in metrics.read_metrics(workdir) if r["split"] == split]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("spikes") / "reference")
  summary = train_lib.train(_config(), workdir)
  return dict(workdir=workdir, summary=summary, train=_records(workdir, "train"),
              spikes=_records(workdir, "spikes"), layers=_records(workdir, "layers"))


def test_every_logged_spike_follows_the_rule_on_the_logged_losses(reference):
  train = {r["step"]: r for r in reference["train"]}
  steps = sorted(train)
  assert steps == list(range(1, STEPS + 1))
  hand = _hand_zscores([(train[s]["loss"], train[s]["grad_norm"]) for s in steps],
                       spikes.WINDOW, WARMUP)
  flagged = {r["step"]: r for r in reference["spikes"]}
  for step, (loss_z, grad_z) in zip(steps, hand):
    np.testing.assert_allclose([train[step]["loss_z"], train[step]["grad_norm_z"]],
                               [loss_z, grad_z], rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
    assert min(abs(loss_z - THRESHOLD), abs(grad_z - THRESHOLD)) > 1e-3 or step <= WARMUP
    assert (step in flagged) == (loss_z > THRESHOLD or grad_z > THRESHOLD), step
  assert 0 < len(flagged) < STEPS - WARMUP
  assert reference["summary"]["loss_spikes"] == len(flagged)
  assert reference["summary"]["skipped_spikes"] == 0


def test_each_spike_is_logged_with_its_running_statistics_and_its_layers(reference):
  train = {r["step"]: r for r in reference["train"]}
  layers = {r["step"]: r for r in reference["layers"]}
  for record in reference["spikes"]:
    step = record["step"]
    previous = np.array([(train[s]["loss"], train[s]["grad_norm"]) for s in range(1, step)])
    np.testing.assert_allclose([record["loss_mean"], record["grad_norm_mean"]],
                               previous.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose([record["loss_std"], record["grad_norm_std"]],
                               previous.std(axis=0, ddof=1), rtol=1e-4)
    assert record["loss"] == train[step]["loss"] and record["skipped"] == 0.0
    # The statistics of the parameters the step started from, on its batch: what the loop
    # logs as `layers` at step - 1 (computed there by a separate program).
    layer_keys = [k for k in layers[step - 1] if k not in ("step", "split")]
    assert "residual_rms/layer_00" in layer_keys and "collapse/token_cosine" in layer_keys
    np.testing.assert_allclose([record[k] for k in layer_keys],
                               [layers[step - 1][k] for k in layer_keys], rtol=1e-5, atol=1e-6)


def test_a_resumed_run_judges_every_step_as_the_uninterrupted_one(reference, tmp_path):
  """The window is in the checkpoint: resumed at step 20, steps 21-30 get the same z-scores
  and the same spikes (an empty window would leave 21-25 unjudged)."""
  workdir = str(tmp_path / "resumed")
  shutil.copytree(reference["workdir"], workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "30"))
  summary = train_lib.train(_config(), workdir)
  assert summary["final_step"] == STEPS

  def judged(records):
    return [(r["step"], r["loss"], r["grad_norm"], r["loss_z"], r["grad_norm_z"])
            for r in records]
  assert judged(_records(workdir, "train")) == judged(reference["train"])
  assert _records(workdir, "spikes") == reference["spikes"]
  assert any(r["step"] > 20 for r in reference["spikes"])
  assert summary["loss_spikes"] == reference["summary"]["loss_spikes"]


def test_the_window_restores_from_the_meta_and_is_empty_in_older_checkpoints(reference,
                                                                             tmp_path):
  """A checkpoint's window holds the run's logged values; one written before the window
  existed (no `spike_window` in its meta) still restores, with an empty window."""
  workdir = str(tmp_path / "old")
  shutil.copytree(reference["workdir"], workdir)
  meta_path = os.path.join(workdir, "checkpoints", "10", "meta", "metadata")
  with open(meta_path) as f:
    meta = json.load(f)
  del meta["spike_window"]
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  config = _config()
  setup = train_lib.make_setup(config)
  train = {r["step"]: r for r in reference["train"]}
  with checkpoint_lib.Checkpointer(workdir, config.checkpoint,
                                   checkpoint_lib.config_fingerprint(config)) as ckpt:
    state, _ = train_lib.restore_state(ckpt, 20, setup)
    window = jax.device_get(state["spike"])
    assert int(window["count"]) == 20
    np.testing.assert_array_equal(window["loss_W"][:20],
                                  np.float32([train[s]["loss"] for s in range(1, 21)]))
    assert not np.any(window["loss_W"][20:])
    state, _ = train_lib.restore_state(ckpt, 10, setup)
    assert int(state["step"]) == 10 and int(state["spike"]["count"]) == 0
