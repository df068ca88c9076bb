"""Range checks of the train, checkpoint and mesh sections (and a few model fields whose bad
values only show up as NaN much later), each error one line naming the field.

`check_fields(config)` reads numbers only: no files, no devices, no JAX. The model's structural
checks live in spec.py, the data's in data.py; train.validate runs all three.
"""
import math

from geonorm_jax.training import spikes

DIVERGENCE_POLICIES = ("stop", "skip")
DISTRIBUTED_MODES = ("auto", "true", "false")
WANDB_MODES = ("off", "online", "offline")
# Characters W&B refuses in a project name and in a run id (its own checks, which fail only
# when the run starts, in a message that names no field of ours).
_WANDB_PROJECT_CHARS = "/\\#?%:"
_WANDB_ID_CHARS = ":;,#?/'"


class _Checker:
  """Reads dotted fields of a config; the first bad one raises, naming itself and its value."""

  def __init__(self, config):
    self.config = config

  def _value(self, field):
    section, name = field.split(".")
    return self.config[section][name]

  def fail(self, field, requirement):
    raise ValueError(f"{field}={self._value(field)!r} {requirement}")

  def finite(self, field):
    value = self._value(field)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      self.fail(field, "must be a number")
    if not math.isfinite(value):
      self.fail(field, "must be finite")
    return value

  def positive(self, field):
    if not self.finite(field) > 0:
      self.fail(field, "must be positive")

  def non_negative(self, field, meaning_of_zero=""):
    if self.finite(field) < 0:
      self.fail(field, "must be >= 0" + (f" ({meaning_of_zero})" if meaning_of_zero else ""))

  def within(self, field, low, high, high_open=False):
    value = self.finite(field)
    if value < low or value > high or (high_open and value == high):
      self.fail(field, f"must lie in [{low}, {high}{')' if high_open else ']'}")

  def choice(self, field, valid):
    if str(self._value(field)).lower() not in valid:
      self.fail(field, f"is unknown; valid: {', '.join(valid)}")


def check_fields(config):
  """Raises ValueError naming the first field of train/checkpoint/mesh (or model extras)
  whose value cannot give a meaningful run."""
  check = _Checker(config)
  # steps and lr first: the schedule's checks (warmup <= steps) would otherwise blame the
  # wrong field for train.steps=0.
  for field in ("train.steps", "train.lr", "train.grad_accum", "train.eval_every",
                "train.eval_batches", "train.log_every", "train.peak_flops"):
    check.positive(field)
  check.within("train.warmup_steps", 0, config.train.steps)
  check.within("train.min_lr_ratio", 0.0, 1.0)
  check.within("train.decay_fraction", 0.0, 1.0)
  check.within("train.b1", 0.0, 1.0, high_open=True)
  check.within("train.b2", 0.0, 1.0, high_open=True)
  check.non_negative("train.eps")
  check.non_negative("train.weight_decay")
  check.non_negative("train.clip_norm", "0 = no clipping")
  check.non_negative("train.layer_stats_every", "0 = off")
  check.non_negative("train.hessian_every", "0 = off")
  if config.train.hessian_every:
    check.positive("train.hessian_steps")
  check.non_negative("train.sample_tokens")
  check.choice("train.on_divergence", DIVERGENCE_POLICIES)
  check.non_negative("train.give_up_steps", "0 = never")
  check.non_negative("train.spike_zscore", "0 = off")
  # A standard deviation needs two values; a warm-up longer than the window never ends.
  check.within("train.spike_warmup", 2, spikes.WINDOW)
  check.choice("train.wandb", WANDB_MODES)
  if str(config.train.wandb).lower() != "off":
    _check_wandb_names(check, config.train)

  check.non_negative("checkpoint.every", "0 = only the final step")
  check.non_negative("checkpoint.keep_last", "0 = keep all")
  check.non_negative("checkpoint.keep_every", "0 = off")

  check.choice("mesh.distributed", DISTRIBUTED_MODES)
  for axis in ("data", "fsdp", "tensor"):
    size = config.mesh[axis]
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{axis}={size} must be positive or -1 (fill from the device count)")
  check.non_negative("mesh.num_processes", "0 = from the environment")
  if config.mesh.process_id < -1:
    check.fail("mesh.process_id", "must be >= 0 (or -1 = from the environment)")

  # Model fields that spec.resolve accepts but that make the loss NaN (or meaningless) later.
  for field in ("model.geo_alpha", "model.ngpt_alpha_init", "model.rope_theta"):
    check.positive(field)


def _check_wandb_names(check, train):
  if not train.wandb_project.strip():
    check.fail("train.wandb_project", "must name a W&B project")
  if len(train.wandb_project) > 128:
    check.fail("train.wandb_project", "must be at most 128 characters")
  for name, refused in (("wandb_project", _WANDB_PROJECT_CHARS), ("wandb_id", _WANDB_ID_CHARS)):
    found = sorted(set(refused) & set(train[name]))
    if found:
      check.fail(f"train.{name}", f"may not contain {' '.join(found)} (W&B refuses them)")
  if train.wandb_id != train.wandb_id.strip():
    check.fail("train.wandb_id", "may not start or end with whitespace")
