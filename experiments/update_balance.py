"""Update balance: does Pre-LN give its lower layers larger updates than its upper ones?

  python experiments/update_balance.py [--scale=cpu|paper] [--seeds=0,1,2] [--quick]
      [--variants=pre,geonorm,peri] [--jobs=N] [--print]

Reads what train.py logs every log_every steps with layer statistics on: per block, the
gradient norm (grad_norm/layer_XX) and the update-to-parameter ratio ||Delta W|| / ||W||
(update_ratio/layer_XX, the optimizer's step over the block's parameters). Averaged over the
logged steps after warmup. The imbalance of a run: the first block's mean update ratio over
the last block's (> 1: lower layers move more). CPU scale: configs/shakespeare.py (500 steps),
9 runs, about 14 minutes on a quiet 2-core CPU; --quick: 150 steps, one seed. Paper scale:
configs/geonorm_paper.py:125m. Writes results/update_balance/{results.csv, curves.csv,
table.md, config.json, verdict.json, per_layer.png, first_last_over_training.png}.
Verdict: reproduced when Pre-LN's imbalance exceeds 1 in every seed and exceeds GeoNorm's
(claims.compare over seeds); not reproduced when Pre-LN's is below 1 in every seed.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "update_balance"
CLAIM = "Pre-LN gives lower layers larger updates (GeoNorm's motivation)"
PAPER_NUMBER = "qualitative (GeoNorm paper's motivation)"
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", "layer_stats_every=25", "0,1,2",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 500 steps x 16 x 128 tokens, lr 3e-3."),
    "paper": claims.Scale("configs/geonorm_paper.py", "125m,layer_stats_every=100", "0,1,2",
                          "GeoNorm's 125M (12 x 768, RoPE, untied), 20k steps x 0.5M tokens, "
                          "lr 6e-4 (configs/geonorm_paper.py)."),
}
CURVES = (("train", "loss"), ("train", "grad_norm/layer_"), ("train", "update_ratio/layer_"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "geonorm", "peri"))


def grid(args, scale):
  del scale
  steps = claims.steps_overrides(150) if args.quick else ""
  return [claims.variant(name, claims.join(overrides, steps), variant=name)
          for name, overrides in claims.variant_list(args)]


def _layers(curves, name, prefix):
  return sorted({c["key"] for c in curves if c["name"] == name and c["key"].startswith(prefix)})


def layer_means(curves, row, prefix, warmup):
  """[mean over logged steps after warmup] per block, in block order."""
  out = []
  for key in _layers(curves, row["name"], prefix):
    steps, ys = claims.curve(curves, row["name"], key)
    out.append(float(np.mean(ys[steps > warmup])) if np.any(steps > warmup) else float("nan"))
  return np.asarray(out)


def _warmup(row):
  return max(1, row["steps"] // 10)


def summarize(rows, curves, config):
  for row in rows:
    ratios = layer_means(curves, row, "update_ratio/", _warmup(row))
    grads = layer_means(curves, row, "grad_norm/", _warmup(row))
    row["imbalance"] = ratios[0] / ratios[-1] if len(ratios) else float("nan")
    row["grad_imbalance"] = grads[0] / grads[-1] if len(grads) else float("nan")
  by_variant = claims.group(rows, "variant")
  table = ["| variant | seeds | update ratio, first / last block | gradient norm, first / last "
           "block | per-block update ratio (mean over seeds) |", "|---|---|---|---|---|"]
  for (name,), runs in by_variant.items():
    per_block = np.mean([layer_means(curves, r, "update_ratio/", _warmup(r)) for r in runs], 0)
    table.append(f"| {name} | {len(runs)} | {claims.cell(runs, 'imbalance')} | "
                 f"{claims.cell(runs, 'grad_imbalance')} | "
                 + ", ".join(f"{v:.2e}" for v in per_block) + " |")
  table += ["", "Means over the logged steps after warmup (a tenth of the run). Update ratio: "
            "||Delta W|| / ||W|| of one optimizer step over a block's parameters."]
  holds = None
  if ("pre",) in by_variant:
    pre = claims.values(by_variant[("pre",)], "imbalance")
    if np.all(pre < 1):
      holds = False
    elif np.all(pre > 1):
      geo = claims.values(by_variant.get(("geonorm",), []), "imbalance")
      outcome = claims.compare(pre, geo) if len(geo) else "unresolved"
      holds = True if outcome == "higher" else (False if outcome == "lower" else None)
  result = "first/last block update ratio: " + "; ".join(
      f"{name} {claims.cell(runs, 'imbalance')}" for (name,), runs in by_variant.items()) + "."

  def per_layer(figure):
    for index, (prefix, label) in enumerate((("update_ratio/", "update / parameter norm"),
                                             ("grad_norm/", "gradient norm"))):
      axes = figure.add_subplot(1, 2, index + 1)
      for i, ((name,), runs) in enumerate(by_variant.items()):
        means = np.asarray([layer_means(curves, r, prefix, _warmup(r)) for r in runs])
        blocks = np.arange(means.shape[1])
        axes.errorbar(blocks, means.mean(0), yerr=means.std(0, ddof=1) if len(runs) > 1 else
                      None, marker="o", capsize=3, color=f"C{i}", label=name)
      axes.set_yscale("log")
      axes.set_xlabel("block (0 = nearest the input)")
      axes.set_ylabel(f"{label} (mean after warmup)")
      axes.legend(fontsize=8)
      axes.grid(alpha=0.3)
    figure.suptitle("per-block optimizer steps (mean +- std over seeds)", fontsize=9)

  def over_training(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((name,), runs) in enumerate(by_variant.items()):
      for r, run_row in enumerate(runs):
        keys = _layers(curves, run_row["name"], "update_ratio/")
        for key, style in ((keys[0], "-"), (keys[-1], ":")):
          steps, ys = claims.curve(curves, run_row["name"], key)
          axes.plot(steps, ys, ls=style, color=f"C{i}", lw=1,
                    label=f"{name}, {key.split('/')[1]}" if r == 0 else None)
    axes.set_yscale("log")
    axes.set_xlabel("training step")
    axes.set_ylabel("update / parameter norm per step")
    axes.set_title("first (solid) and last (dotted) block over training, every seed",
                   fontsize=9)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
  figures = {"per_layer.png": per_layer, "first_last_over_training.png": over_training}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
