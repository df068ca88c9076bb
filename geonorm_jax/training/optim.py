"""The optimizer: global-norm clipping -> AdamW (decay on matrices only) -> LR schedule,
with per-parameter-group LR multipliers chosen by regular expressions on parameter paths."""
import re

import jax
import jax.numpy as jnp
import optax

from geonorm_jax.nn import paths

SCHEDULES = ("cosine", "wsd", "linear", "constant")
DECAY_SCOPES = ("matrices", "all")


def learning_rate_schedule(train_config):
  """Linear warmup, then cosine to min_lr_ratio*lr, warmup-stable-decay, a straight line to
  min_lr_ratio*lr (SimpleGPT's schedule, with min_lr_ratio 0), or constant.

  Warmup gives update t (0-based) the rate lr (t+1)/W, as nanoGPT does: the first update
  already moves (a warmup from 0 would spend the first step on nothing).
  """
  c = train_config
  if c.schedule not in SCHEDULES:
    raise ValueError(f"train.schedule={c.schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
  if c.warmup_steps < 0 or c.warmup_steps > c.steps:
    raise ValueError(f"train.warmup_steps={c.warmup_steps} must lie in [0, train.steps={c.steps}]")
  warmup_steps = max(c.warmup_steps, 1)
  warmup = optax.linear_schedule(c.lr / warmup_steps, c.lr, warmup_steps - 1 or 1)
  remaining = max(c.steps - c.warmup_steps, 1)
  floor = c.lr * c.min_lr_ratio
  if c.schedule == "cosine":
    after = optax.cosine_decay_schedule(c.lr, remaining, alpha=c.min_lr_ratio)
  elif c.schedule == "wsd":
    decay_steps = max(int(round(c.decay_fraction * c.steps)), 1)
    stable = max(remaining - decay_steps, 0)
    after = optax.join_schedules(
        [optax.constant_schedule(c.lr), optax.linear_schedule(c.lr, floor, decay_steps)], [stable])
  elif c.schedule == "linear":
    after = optax.linear_schedule(c.lr, floor, remaining)
  else:
    after = optax.constant_schedule(c.lr)
  return optax.join_schedules([warmup, after], [c.warmup_steps])


def _decays(path, decay_embeddings, scope="matrices"):
  """scope matrices: weight decay on the block matrices; never on gains, biases, DyT/nGPT
  scales; the vocabulary matrices (embedding, positions and an untied head) follow
  decay_embeddings, so a tied and an untied model get the same decay on them.
  scope all: on every parameter (SimpleGPT's recipe).
  """
  if scope == "all":
    return True
  last = path.split(".")[-1]
  if last in ("embed", "positions", "head"):
    return decay_embeddings
  return last == "kernel"


def parse_multipliers(text):
  pairs = []
  for item in filter(None, (t.strip() for t in text.split(","))):
    pattern, sep, value = item.rpartition("=")
    if not sep:
      raise ValueError(f"train.lr_multipliers item {item!r} is not regex=multiplier")
    try:
      pairs.append((re.compile(pattern), float(value)))
    except (re.error, ValueError) as e:
      raise ValueError(f"train.lr_multipliers item {item!r}: {e}") from None
  return pairs


def _leaf_map(fn, params):
  """fn(path string) for every array of params, keeping the params' structure."""
  return jax.tree_util.tree_map_with_path(lambda p, _: fn(paths.path_to_string(p)), params)


def multiplier_tree(params, text):
  """LR multiplier per leaf: the first matching regex (re.search on the path) wins, else 1."""
  pairs = parse_multipliers(text)

  def multiplier(path):
    for pattern, value in pairs:
      if pattern.search(path):
        return value
    return 1.0
  return _leaf_map(multiplier, params)


def scale_by_tree(multipliers):
  """Multiply each update by a fixed per-leaf number (an LR multiplier after the schedule)."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, m: u * jnp.asarray(m, u.dtype), updates, multipliers), state
  return optax.GradientTransformation(init, update)


def make_optimizer(train_config, params, weight_decay=True):
  """The optax chain; weight_decay=False turns decay off for placements that forbid it (nGPT)."""
  c = train_config
  for field in ("lr", "steps"):
    if getattr(c, field) <= 0:
      raise ValueError(f"train.{field}={getattr(c, field)} must be positive")
  schedule = learning_rate_schedule(c)
  if c.weight_decay_scope not in DECAY_SCOPES:
    raise ValueError(f"train.weight_decay_scope={c.weight_decay_scope!r} is unknown; valid: "
                     f"{', '.join(DECAY_SCOPES)}")
  decay_mask = _leaf_map(lambda path: _decays(path, c.decay_embeddings, c.weight_decay_scope),
                         params)
  parts = []
  if c.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(c.clip_norm))
  parts.append(optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps,
                           weight_decay=c.weight_decay if weight_decay else 0.0, mask=decay_mask))
  if c.lr_multipliers:
    parts.append(scale_by_tree(multiplier_tree(params, c.lr_multipliers)))
  return optax.chain(*parts), schedule
