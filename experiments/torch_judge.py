"""Torch judge: the judge recipe trained by an independent PyTorch trainer, on our batches
from our initial parameters, to tell a result of the recipe from a bug of our trainer.

  python experiments/torch_judge.py --placement=peri --lr=4e-3 --seed=0 \\
      [--steps=2000] [--config=on_divergence=skip,dt=0.1] [--threads=1]
      [--out=results/torch_judge/peri_lr0.004_seed0]

The run it mirrors is norm_zoo's at the judge scale: `python -m geonorm_jax train
--config=configs/judge.py:on_divergence=skip,placement=P,lr=LR --config.seed=S
--config.data.seed=S` (studies/sweep.load_config; --config's default is norm_zoo's
on_divergence=skip). What is shared with it is only what must be identical for the comparison
to mean something:
  - the data: our train iterator (data/windows.make_train_iterator, the same batches in the
    same order for the seed) and our fixed validation batches (make_eval_batches);
  - the initial parameters: our model's init for the seed (train.init_state), loaded by
    dotted name into tests/torch_reference.py's ReferenceTransformer with strict=True.
Everything else is written again here: the model is the reference (every placement's wiring
from its equations, tests/test_torch_reference.py), the loss is float32 cross-entropy, the
update is global-norm clipping, then torch.optim.AdamW (the same update as optax.adamw:
bias-corrected moments, eps outside the square root, decoupled decay multiplied by the
scheduled LR) with decay on the block matrices only (optim._decays' rule, re-stated in
`decays`), and the LR schedule is re-derived from its formula (`learning_rate`), not called.
tests/test_torch_judge.py checks that on a small model this trainer's per-step losses are our
trainer's to float32 precision.

--steps stops the run after that many steps of the recipe's schedule (the schedule still
spans train.steps, so a short run is the first steps of the full one); it evaluates every
train.eval_every steps and after its last step, on the train.eval_batches batches our trainer
evaluates on. Placements the reference cannot train as we do are refused by name: nGPT (its
after-step projection) and the z-loss, LR multipliers, spike skipping, scanned layers and a
compute dtype other than float32.
Cost: Pre-LN's judge step took 435 ms in eager PyTorch on one thread of this 2-core CPU while
a training sweep ran on both cores (--steps=50: 34 s in all, with the JAX init and one
evaluation), so a 2000-step run is about 15 minutes there. Writes
OUT/metrics.csv (step, split, loss, grad_norm, lr: every training step, every evaluation) and
OUT/summary.json (final losses, the arguments, the torch version, wall and step times), and
prints one line per evaluation.
"""
import argparse
import csv
import json
import math
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the reference model lives with the tests
import torch  # noqa: E402  pylint: disable=g-import-not-at-top
import torch.nn.functional as F  # noqa: E402  pylint: disable=g-import-not-at-top

import torch_reference  # noqa: E402  pylint: disable=g-import-not-at-top
from geonorm_jax.data import windows as data_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from geonorm_jax.studies import sweep  # noqa: E402  pylint: disable=g-import-not-at-top

CONFIG_FILE = "configs/judge.py"
SCHEDULES = ("cosine",)


def load_config(placement, lr, seed, overrides="", config_file=CONFIG_FILE):
  """What the sweeps train for (placement, lr, seed): config_file's get_config with
  placement, lr and `overrides`, seed and data seed set to `seed`."""
  items = [f"placement={placement}"] + ([f"lr={lr}"] if lr is not None else []) + [overrides]
  return sweep.load_config(config_file, ",".join(filter(None, items)), seed)


def check_supported(config, spec):
  """One clear error naming the field for what this trainer does not implement as ours does."""
  m, t = config.model, config.train
  refused = [
      (spec.placement.after_update is not None or not spec.placement.weight_decay,
       f"model.placement={spec.placement.name} (its after-step projection and decay rule are "
       "not in this trainer)"),
      (m.z_loss != 0, f"model.z_loss={m.z_loss} (the objective here is the cross-entropy)"),
      (not m.norm_gain, "model.norm_gain=false (the reference always has gains)"),
      (m.dtype != "float32", f"model.dtype={m.dtype} (this trainer computes in float32)"),
      (m.scan_layers, "model.scan_layers=true (stacked parameters have other names)"),
      (t.schedule not in SCHEDULES, f"train.schedule={t.schedule} (only {SCHEDULES})"),
      (bool(t.lr_multipliers), f"train.lr_multipliers={t.lr_multipliers!r}"),
      (t.skip_spikes, "train.skip_spikes=true (the spike rule is not in this trainer)"),
  ]
  for bad, what in refused:
    if bad:
      raise ValueError(f"this trainer does not implement {what}")


def reference_hyper(config, spec):
  """The reference's hyperparameters from config.model. The `auto` fields go in as None so
  that the reference resolves them from the backbone itself; a different resolution on
  either side is a strict-load error, not a silent difference."""
  m = config.model
  auto = lambda text: None if text == "auto" else text
  boolean = lambda text: None if text == "auto" else text == "true"
  fields = {name: m[name] for name in (
      "backbone", "num_layers", "d_model", "num_heads", "num_kv_heads", "vocab_size",
      "max_seq_len", "norm_eps", "rope_theta", "qk_norm", "qk_norm_scope", "dt", "embed_norm",
      "geo_alpha", "geo_schedule", "geo_counter", "geo_theta_max", "geo_sublayer_input",
      "geo_radius", "mixln_fraction", "ngpt_alpha_init")}
  # d_ff=0 means a backbone's rounding rule; the width is a shape, which the strict load checks.
  return torch_reference.Hyper(
      **fields, placement=spec.placement.name, d_ff=spec.d_ff, norm_kind=auto(m.norm_kind),
      norm_bias=boolean(m.norm_bias), tie_embeddings=boolean(m.tie_embeddings))


def initial_weights(config):
  """(spec, {dotted name: float32 array}) of our model's initial parameters for config.seed,
  made as train.init_state makes them (on one device: the values do not depend on the mesh)."""
  import jax  # pylint: disable=g-import-not-at-top
  from geonorm_jax.nn import paths  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  setup = train.make_setup(config, jax.devices()[:1])  # validates every field, data included
  params = jax.device_get(train.init_state(setup)["params"])
  leaves = [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(params)]
  return setup.spec, dict(zip(paths.leaf_paths(params), leaves))


def reference_model(config, spec, weights):
  model = torch_reference.ReferenceTransformer(reference_hyper(config, spec))
  # strict: a parameter on one side only, or of another shape, is an error here.
  model.load_state_dict({name: torch.from_numpy(value.copy()) for name, value in weights.items()},
                        strict=True)
  return model


def learning_rate(train_config, update):
  """The LR of update `update` (0-based), written from optim.learning_rate_schedule's
  definition (not called): warmup gives update t the rate lr (t+1)/W; then a half cosine from
  lr down to min_lr_ratio lr over the remaining steps, flat at the floor after them."""
  c = train_config
  if update < c.warmup_steps:
    return c.lr * (update + 1) / c.warmup_steps
  remaining = max(c.steps - c.warmup_steps, 1)
  progress = min(update - c.warmup_steps, remaining) / remaining
  return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def decays(name, train_config):
  """Whether weight decay applies to the parameter `name` (a dotted name). scope matrices:
  the block matrices (every `kernel`), the vocabulary matrices (embed, positions, an untied
  head) only with decay_embeddings, never a gain, bias or scalar; scope all: everything."""
  if train_config.weight_decay_scope == "all":
    return True
  last = name.split(".")[-1]
  if last in ("embed", "positions", "head"):
    return train_config.decay_embeddings
  return last == "kernel"


def make_optimizer(model, train_config):
  c = train_config
  named = list(model.named_parameters())
  groups = [{"params": [p for n, p in named if decays(n, c)], "weight_decay": c.weight_decay},
            {"params": [p for n, p in named if not decays(n, c)], "weight_decay": 0.0}]
  # torch's AdamW: p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), optax.adamw's update
  # (decay on the parameters before the step, times the scheduled lr).
  return torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr, betas=(c.b1, c.b2),
                           eps=c.eps, foreach=False)


def clip_by_global_norm(parameters, max_norm):
  """Scales every gradient by max_norm / |g| when the global norm |g| exceeds max_norm
  (no epsilon in the divisor, unlike torch.nn.utils.clip_grad_norm_); returns |g|."""
  grads = [p.grad for p in parameters if p.grad is not None]
  norm = torch.sqrt(sum(torch.sum(g.float() ** 2) for g in grads))
  if max_norm > 0 and norm >= max_norm:
    for g in grads:
      g.mul_(max_norm / norm)
  return float(norm)


def cross_entropy(model, tokens_BxL1):
  logits_BxLxV = model(tokens_BxL1[:, :-1]).float()
  return F.cross_entropy(logits_BxLxV.reshape(-1, logits_BxLxV.shape[-1]),
                         tokens_BxL1[:, 1:].reshape(-1))


def evaluate(model, eval_batches):
  """Mean over the fixed validation batches of each batch's mean cross-entropy, as ours."""
  with torch.no_grad():
    return float(np.mean([float(cross_entropy(model, batch)) for batch in eval_batches]))


def train(config, steps=None, log=print, initial=None):
  """Trains the reference from our init on our batches; returns (rows, summary). rows: one
  dict per training step and per evaluation (step, split, loss, grad_norm, lr). initial:
  initial_weights(config) when already made (several runs of one model and seed)."""
  from geonorm_jax.nn import spec as spec_lib  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  c = config.train
  last_step = c.steps if steps is None else steps
  if not 0 < last_step <= c.steps:
    raise ValueError(f"--steps={last_step} must lie in [1, train.steps={c.steps}]")
  check_supported(config, spec_lib.resolve(config.model))  # before anything compiles
  spec, weights = initial_weights(config) if initial is None else initial
  model = reference_model(config, spec, weights)
  optimizer = make_optimizer(model, c)
  parameters = list(model.parameters())
  train_iter = data_lib.make_train_iterator(config)
  as_tensor = lambda batch: torch.from_numpy(np.asarray(batch["tokens"], np.int64))
  eval_batches = [as_tensor(b) for b in data_lib.make_eval_batches(config)]
  rows, updates, skipped, step_times = [], 0, 0, []
  eval_loss, train_loss = float("nan"), float("nan")
  for step in range(1, last_step + 1):
    tokens_BxL1 = as_tensor(next(train_iter))
    tick = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = cross_entropy(model, tokens_BxL1)
    loss.backward()
    grad_norm = clip_by_global_norm(parameters, c.clip_norm)
    train_loss = loss.item()
    lr = learning_rate(c, updates)
    if math.isfinite(train_loss) and math.isfinite(grad_norm):
      for group in optimizer.param_groups:
        group["lr"] = lr
      optimizer.step()
      updates += 1  # optax's schedule counts updates made: a skipped step does not advance it
    elif c.on_divergence == "skip":
      skipped += 1
    else:
      raise FloatingPointError(f"step {step}: loss {train_loss}, gradient norm {grad_norm} "
                               "(train.on_divergence=stop)")
    step_times.append(time.perf_counter() - tick)
    rows.append(dict(step=step, split="train", loss=train_loss, grad_norm=grad_norm, lr=lr))
    if step % c.eval_every == 0 or step == last_step:
      eval_loss = evaluate(model, eval_batches)
      rows.append(dict(step=step, split="eval", loss=eval_loss, grad_norm="", lr=""))
      log(f"step {step}: eval {eval_loss:.4f}, train {train_loss:.4f}, lr {lr:.3g}, "
          f"{1000 * np.median(step_times):.0f} ms/step (median)")
  summary = dict(final_step=last_step, final_eval_loss=eval_loss, final_train_loss=train_loss,
                 skipped_steps=skipped, wall_s=time.perf_counter() - started,
                 step_s_median=float(np.median(step_times)),
                 step_s_mean_after_first=float(np.mean(step_times[1:] or step_times)),
                 torch_version=torch.__version__, torch_threads=torch.get_num_threads(),
                 machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
  return rows, summary


def write(out, rows, summary):
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "metrics.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["step", "split", "loss", "grad_norm", "lr"])
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--placement", default="pre")
  parser.add_argument("--lr", type=float, default=None, help="peak LR; default the recipe's")
  parser.add_argument("--seed", type=int, default=0, help="params init and data order both")
  parser.add_argument("--steps", type=int, default=None,
                      help="stop after this many updates; default train.steps (2000)")
  parser.add_argument("--config", default="on_divergence=skip",
                      help="more get_config items (default: norm_zoo's), e.g. dt=0.1")
  parser.add_argument("--config_file", default=CONFIG_FILE)
  # One thread: on this 2-core machine shared with a sweep (one run per core), two torch
  # threads spin against the other runs (1.17 s a step against 0.47 s with one, measured).
  parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
  parser.add_argument("--out", default=None,
                      help="default results/torch_judge/<placement>_lr<lr>_seed<seed>")
  args = parser.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  try:
    config = load_config(args.placement, args.lr, args.seed, args.config, args.config_file)
    rows, summary = train(config, args.steps)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"torch_judge: {e}") from None
  out = args.out or os.path.join(REPO, "results", "torch_judge",
                                 f"{args.placement}_lr{config.train.lr:g}_seed{args.seed}")
  summary["args"] = dict(vars(args), lr=config.train.lr, steps=summary["final_step"], out=out)
  write(out, rows, summary)
  print(f"final eval loss {summary['final_eval_loss']:.4f} after {summary['final_step']} "
        f"steps; wrote {out}")


if __name__ == "__main__":
  main()
