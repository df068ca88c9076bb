"""LR tolerance: does SimpleNorm train at 3-10x the peak learning rate of Pre-LN?

  python experiments/lr_tolerance.py [--scale=cpu|paper] [--seeds=0] [--quick]
      [--variants=pre,pre_qknorm,simplenorm,geonorm,peri] [--lrs=1e-3,...,1]
      [--max_loss=3.0] [--jobs=N] [--print]

A run is stable when (1) no step was non-finite (train.on_divergence=skip counts them), (2)
its train loss never rose above its step-1 value after warmup (claims.diverged; every step is
logged) and (3) its final validation loss is below --max_loss (CPU default 3.0, clearly under
the ~3.3 nats of a model that only learned character frequencies; paper default 6.0).
The largest stable LR of a variant: the largest grid LR at which every seed is stable; its
ratio to Pre-LN's is the claim's number (a lower bound when it is the grid's largest).
CPU scale: configs/shakespeare.py cut to 300 steps, 5 variants x 7 LRs (1e-3 to 1), about 30
minutes on a quiet 2-core CPU; --quick: pre and simplenorm only. Paper scale:
configs/llama.py:llama2_1b (SimpleGPT's 1B size). Writes results/lr_tolerance/{results.csv,
curves.csv, table.md, config.json, verdict.json, loss_vs_lr.png}.
Verdict: reproduced when SimpleNorm's largest stable LR is at least 3x Pre-LN's; not
reproduced when it is below that; unresolved when Pre-LN is stable at no LR or at the grid's
largest (the ratio then has no upper end: extend --lrs).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "lr_tolerance"
CLAIM = "SimpleNorm trains at 3-10x the peak learning rate of Pre-LN"
PAPER_NUMBER = "3-10x; 7B loss 2.208 vs 2.290, 1B 2.446 vs 2.478 (SimpleGPT)"
LRS = {"cpu": "1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1", "paper": "3e-4,1e-3,3e-3,1e-2"}
MAX_LOSS = {"cpu": 3.0, "paper": 6.0}
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", claims.steps_overrides(300), "0",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 300 steps x 16 x 128 tokens, cosine schedule."),
    "paper": claims.Scale("configs/llama.py", "llama2_1b,steps=20000,warmup_steps=2000",
                          "0", "LLaMA-2 1B (18 x 2048), seq 4096, 20k steps x 1024 x 4096 "
                          "tokens (configs/llama.py; SimpleGPT's 1B ran 60k steps)."),
}
CURVES = (("train", "loss"), ("eval", "loss"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "pre_qknorm", "simplenorm", "geonorm", "peri"))
  parser.add_argument("--lrs", default=None, help="default 1e-3..1 (cpu), 3e-4..1e-2 (paper)")
  parser.add_argument("--max_loss", type=float, default=None)


def grid(args, scale):
  del scale
  variants = claims.variant_list(args)
  if args.quick:
    variants = [v for v in variants if v[0] in ("pre", "simplenorm")]
  args.max_loss = args.max_loss or MAX_LOSS[args.scale]
  return [claims.variant(f"{name}/lr{lr}", claims.join(overrides, f"lr={lr},log_every=1,"
                                                      "on_divergence=skip"),
                         variant=name, lr=float(lr))
          for name, overrides in variants for lr in (args.lrs or LRS[args.scale]).split(",")]


def stable(row, curves, max_loss):
  return (not claims.diverged(row, curves, max(1, row["steps"] // 10))
          and row["final_eval_loss"] < max_loss)


def largest_stable(rows, curves, max_loss):
  """variant -> largest LR at which every seed is stable (None if none)."""
  out = {}
  for (name, lr), runs in claims.group(rows, "variant", "lr").items():
    out.setdefault(name, None)
    if all(stable(r, curves, max_loss) for r in runs):
      out[name] = max(lr, out[name] or 0)
  return out


def summarize(rows, curves, config):
  max_loss = config["args"]["max_loss"]
  grid_max = max(row["lr"] for row in rows)
  table = ["| variant | lr | seeds | stable seeds | final validation loss |",
           "|---|---|---|---|---|"]
  for (name, lr), runs in claims.group(rows, "variant", "lr").items():
    table.append(f"| {name} | {lr:g} | {len(runs)} | "
                 f"{sum(stable(r, curves, max_loss) for r in runs)}/{len(runs)} | "
                 f"{claims.cell(runs, 'final_eval_loss')} |")
  best = largest_stable(rows, curves, max_loss)
  pre = best.get("pre")
  ratio = lambda lr: ("-" if lr is None or not pre else
                      f"{'>=' if lr == grid_max else ''}{lr / pre:g}x")
  table += ["", "| variant | largest stable lr | ratio to pre |", "|---|---|---|"]
  table += [f"| {name} | {lr if lr is not None else 'none'} | {ratio(lr)} |"
            for name, lr in best.items()]
  table += ["", f"Stable: no non-finite step, train loss never above its step-1 value after "
            f"warmup, final validation loss < {max_loss:g}."]
  holds = None
  # With Pre-LN stable at the grid's largest LR, the ratio has no upper end: unresolved.
  if pre and pre < grid_max and "simplenorm" in best:
    # Grid LRs are decimal: 0.3 / 0.1 is 2.9999999999999996 in binary floating point.
    holds = (best["simplenorm"] or 0) / pre >= 3 * (1 - 1e-9)
  result = ("largest stable lr: " + ", ".join(f"{n} {lr}" for n, lr in best.items())
            + f"; simplenorm / pre = {ratio(best.get('simplenorm'))}.")

  def draw(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((name,), runs) in enumerate(claims.group(rows, "variant").items()):
      lrs, means, _ = claims.curve_over(runs, "lr", "final_eval_loss")
      axes.plot(lrs, means, marker="o", color=f"C{i}", label=name)
      cells = claims.group(runs, "lr")
      bad = [lr for lr in lrs if not all(stable(r, curves, max_loss) for r in cells[(lr,)])]
      axes.plot(bad, [means[lrs.index(lr)] for lr in bad], "x", ms=10, color=f"C{i}")
    axes.axhline(max_loss, color="grey", ls=":", label=f"stability threshold {max_loss:g}")
    axes.set_xscale("log")
    axes.set_xlabel("peak learning rate")
    axes.set_ylabel("final validation loss (nats/token)")
    axes.set_title("final loss vs peak LR (mean over seeds; x = unstable)", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
  return claims.Summary(table, claims.verdict(config, holds), result, {"loss_vs_lr.png": draw})


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
