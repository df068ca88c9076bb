"""Update balance: does Pre-LN give its lower layers larger gradients than its upper ones?

  python experiments/update_balance.py [--scale=judge|paper] [--seeds=0,1,2] [--quick]
      [--variants=pre,geonorm,peri] [--lr=4e-3] [--jobs=N] [--print]

The quantity. GeoNorm's motivation (arXiv 2601.22095, as its summaries put it) is that
Pre-Norm "suffers from gradient imbalance across layers": the lower blocks receive larger
gradients than the upper ones. So the deciding number of a run is the gradient norm ratio: the
first block's gradient norm over the last block's (grad_norm/layer_XX, which train.py logs
every log_every steps with layer statistics on), each the mean over the logged steps after the
run's warmup.
The update-to-parameter ratio ||Delta W|| / ||W|| of the same blocks (update_ratio/layer_XX,
the optimizer's step) is reported beside it and decides nothing: AdamW divides each
coordinate's step by its own gradient scale, so it evens out what the gradients do not.
Every placement trains at its own tuned peak LR (claims.ZOO_LRS: the norm zoo's judge-scale
table, results/norm_zoo/table.md): Pre-LN and Peri-LN at 4e-3, GeoNorm at 2e-3. A gradient
ratio read from a run that has come apart measures the divergence, not the placement: at
Pre-LN's 4e-3, GeoNorm came apart in 2 of 3 seeds (one's loss jumped after step 410, the
other's stayed near the unigram loss from step 90 to 1000) while its first block's gradient
norm rose from about 0.3 to a median over the run of 491 and 3760 (the third seed: 0.22), the
last block's staying near 0.1 (results/update_balance_shared_lr).
--lr=X trains every variant at X instead: the shared-LR comparison.
Judge scale: configs/judge.py (tiny model, 2000 steps x 16 x 128 characters of
tinyshakespeare), layer statistics every 25 steps; 3 placements x 3 seeds = 9 runs, about
9 x 3.8 = 34 minutes on this 2-core machine, two runs at once. --quick: 150 steps, one seed.
Paper scale: configs/geonorm_paper.py:125m. Writes results/update_balance/{results.csv,
curves.csv, table.md, config.json, verdict.json, per_layer.png,
first_last_over_training.png}.
Verdict (stats.py; 95% t intervals over the seeds, on the log of the ratio). A ratio within
[1/MARGIN, MARGIN], MARGIN = 1.25, counts as balanced: the equivalence margin, small beside
the several-fold imbalance the paper's argument is about. Reproduced when both (an
intersection, no correction) Pre-LN's ratio is above MARGIN (the interval of its mean log
ratio minus log MARGIN above 0) and above GeoNorm's (paired over the seeds, which share the
init and data order). Otherwise not at this scale (contradicted at paper scale) when, Holm
over the two, Pre-LN's ratio is below MARGIN (balanced, or larger in the upper blocks) or below
GeoNorm's; unresolved otherwise.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import claims, stats  # pylint: disable=g-import-not-at-top

NAME = "update_balance"
CLAIM = "Pre-LN gives lower layers larger gradients than upper ones (GeoNorm's motivation)"
PAPER_NUMBER = "qualitative (GeoNorm paper's motivation)"
MARGIN = 1.25  # first/last gradient norm ratios within [1/MARGIN, MARGIN] count as balanced
SCALES = {
    "judge": claims.Scale("configs/judge.py", "layer_stats_every=25", "0,1,2",
                          "judge scale: tiny model (4 blocks x 128, untied head), "
                          "character-level tinyshakespeare, 2000 steps x 16 x 128 tokens, "
                          "cosine to 0.1x (configs/judge.py); each variant at the peak LR "
                          "in the table."),
    "paper": claims.Scale("configs/geonorm_paper.py", "125m,layer_stats_every=100", "0,1,2",
                          "GeoNorm's 125M (12 x 768, RoPE, untied), 20k steps x 0.5M tokens "
                          "(configs/geonorm_paper.py); one stated LR."),
}
CURVES = (("train", "loss"), ("train", "grad_norm/layer_*"), ("train", "update_ratio/layer_*"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "geonorm", "peri"))
  parser.add_argument("--lr", default=None, help="peak LR of every variant (the shared-LR "
                      "comparison); default each variant's claims.ZOO_LRS[scale]")


def grid(args, scale):
  del scale
  steps = claims.steps_overrides(150) if args.quick else ""
  runs = []
  for name, overrides in claims.variant_list(args):
    lr = claims.zoo_lr(args, name)
    runs.append(claims.variant(name, claims.join(overrides, f"lr={lr}", steps), variant=name,
                               lr=float(lr)))
  return runs


def row_extra(run, workdir_config):
  del run
  return {"warmup_steps": workdir_config["train"]["warmup_steps"]}


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
  return row.get("warmup_steps") or max(1, row["steps"] // 10)


def _ratio(means):
  return float(means[0] / means[-1]) if len(means) else float("nan")


def _log(x):
  return math.log(x) if x > 0 and math.isfinite(x) else float("nan")


def verdict_of(by_variant):
  """(holds, {test: Difference}) on {variant: rows with grad_imbalance}: the docstring's rule.
  Each Difference is of log ratios: Pre-LN's minus log MARGIN, and Pre-LN's minus GeoNorm's."""
  if "pre" not in by_variant:
    return None, {}
  pre = {r["seed"]: _log(r["grad_imbalance"]) for r in by_variant["pre"]}
  diffs = {"Pre-LN above the margin": stats.difference(pre, {s: math.log(MARGIN) for s in pre})}
  if "geonorm" in by_variant:
    geo = {r["seed"]: _log(r["grad_imbalance"]) for r in by_variant["geonorm"]}
    diffs["Pre-LN above GeoNorm"] = stats.difference(pre, geo)
  if len(diffs) == 2 and all(d.outcome == "higher" for d in diffs.values()):
    return True, diffs
  if any(o == "lower" for o in stats.outcomes(diffs).values()):
    return False, diffs
  return None, diffs


def _as_ratio(d, offset=0.0):
  """A Difference of logs as a ratio interval: 'x1.23 [x1.10, x1.37]'."""
  return (f"x{math.exp(d.mean + offset):.2f} [x{math.exp(d.low + offset):.2f}, "
          f"x{math.exp(d.high + offset):.2f}]" if math.isfinite(d.mean) else "-")


def summarize(rows, curves, config):
  for row in rows:
    ratios = layer_means(curves, row, "update_ratio/", _warmup(row))
    grads = layer_means(curves, row, "grad_norm/", _warmup(row))
    row["imbalance"] = _ratio(ratios)
    row["grad_imbalance"] = _ratio(grads)
  by_variant = {name: runs for (name,), runs in claims.group(rows, "variant").items()}
  table = ["| variant | lr | seeds | gradient norm, first / last block (decides) | update "
           "ratio, first / last block | per-block gradient norm (mean over seeds) | validation "
           "loss |", "|---|---|---|---|---|---|---|"]
  for name, runs in by_variant.items():
    per_block = np.mean([layer_means(curves, r, "grad_norm/", _warmup(r)) for r in runs], 0)
    lrs = sorted({f"{float(r['lr']):g}" for r in runs if r.get("lr")})  # each run's label
    table.append(f"| {name} | {', '.join(lrs) or '-'} | {len(runs)} | "
                 f"{claims.cell(runs, 'grad_imbalance')} | {claims.cell(runs, 'imbalance')} | "
                 + ", ".join(f"{v:.2e}" for v in np.atleast_1d(per_block))
                 + f" | {claims.cell(runs, 'final_eval_loss')} |")
  holds, diffs = verdict_of(by_variant)
  table += ["", "Means over the logged steps after the run's warmup. Gradient norm: of a "
            "block's parameters. Update ratio: ||Delta W|| / ||W|| of one optimizer step over "
            f"a block's parameters. Balanced: a ratio within [1/{MARGIN:g}, {MARGIN:g}]. "
            + (f"Every variant at lr {config['args']['lr']} (shared)."
               if config["args"].get("lr") else "Each variant at its tuned lr.")]
  texts = []
  if "Pre-LN above the margin" in diffs:
    texts.append(f"Pre-LN's first/last gradient norm ratio "
                 f"{_as_ratio(diffs['Pre-LN above the margin'], math.log(MARGIN))} "
                 f"({diffs['Pre-LN above the margin'].level:.0%} t interval over "
                 f"{diffs['Pre-LN above the margin'].n} seeds; balanced within x{MARGIN:g})")
  if "Pre-LN above GeoNorm" in diffs:
    texts.append(f"Pre-LN's over GeoNorm's {_as_ratio(diffs['Pre-LN above GeoNorm'])} "
                 "(paired)")
  texts.append("update ratio first/last (not deciding): " + ", ".join(
      f"{name} {claims.cell(runs, 'imbalance')}" for name, runs in by_variant.items()))
  result = "; ".join(texts) + "." if texts else "Pre-LN not run."

  def per_layer(figure):
    for index, (prefix, label) in enumerate((("grad_norm/", "gradient norm"),
                                             ("update_ratio/", "update / parameter norm"))):
      axes = figure.add_subplot(1, 2, index + 1)
      for i, (name, runs) in enumerate(by_variant.items()):
        means = np.asarray([layer_means(curves, r, prefix, _warmup(r)) for r in runs])
        if means.ndim < 2 or not means.shape[1]:
          continue
        blocks = np.arange(means.shape[1])
        axes.errorbar(blocks, means.mean(0), yerr=means.std(0, ddof=1) if len(runs) > 1 else
                      None, marker="o", capsize=3, color=f"C{i}", label=name)
      axes.set_yscale("log")
      axes.set_xlabel("block (0 = nearest the input)")
      axes.set_ylabel(f"{label} (mean after warmup)")
      axes.legend(fontsize=8)
      axes.grid(alpha=0.3)
    figure.suptitle("per-block gradients and optimizer steps (mean +- std over seeds)",
                    fontsize=9)

  def over_training(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, (name, runs) in enumerate(by_variant.items()):
      for r, run_row in enumerate(runs):
        keys = _layers(curves, run_row["name"], "grad_norm/")
        if not keys:
          continue
        for key, style in ((keys[0], "-"), (keys[-1], ":")):
          steps, ys = claims.curve(curves, run_row["name"], key)
          axes.plot(steps, ys, ls=style, color=f"C{i}", lw=1,
                    label=f"{name}, {key.split('/')[1]}" if r == 0 else None)
    axes.set_yscale("log")
    axes.set_xlabel("training step")
    axes.set_ylabel("gradient norm of the block")
    axes.set_title("first (solid) and last (dotted) block over training, every seed",
                   fontsize=9)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
  figures = {"per_layer.png": per_layer, "first_last_over_training.png": over_training}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
