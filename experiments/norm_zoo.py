"""Norm zoo: does GeoNorm reach a lower validation loss than Pre-, Post-, DeepNorm and
Sandwich (Peri-) LN at the same data order, init seed and token budget?

  python experiments/norm_zoo.py [--scale=cpu|paper] [--seeds=0,1,2] [--quick] [--variants=...]
      [--jobs=N] [--print]

Every placement variant of sweep.PLACEMENT_VARIANTS trains the same recipe with the same seeds
(a seed fixes the init and the batch order). CPU scale: configs/shakespeare.py, 15 variants x
3 seeds x ~90 s = about 70 minutes on a quiet 2-core CPU (more than the 30 of the other
claims); --quick cuts each run to 150 steps and one seed (about 8 minutes). Paper scale:
configs/geonorm_paper.py:125m (GPT-NeoX-style 125M, seq 2048, 20k steps x 0.5M tokens), an
accelerator job. Writes results/norm_zoo/{results.csv, curves.csv, table.md, config.json,
verdict.json, loss_curves.png}.
Verdict: reproduced when GeoNorm's mean final validation loss is below each baseline's by
more than twice the standard error of the difference (claims.compare), over the seeds.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "norm_zoo"
CLAIM = "GeoNorm reaches a lower validation loss than Pre-, Post-, DeepNorm and Sandwich-Norm"
PAPER_NUMBER = "125M: 1.8792 (Arxiv), 3.4040 (Books3); 1.3B: 3.1759 vs Pre-Norm 3.2067"
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", "", "0,1,2",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 500 steps x 16 x 128 tokens, lr 3e-3 "
                        "(configs/shakespeare.py)."),
    "paper": claims.Scale("configs/geonorm_paper.py", "125m", "0,1,2",
                          "GeoNorm's 125M (12 x 768, RoPE, untied), seq 2048, 20k steps x "
                          "256 x 2048 tokens, lr 6e-4 (configs/geonorm_paper.py)."),
}
CURVES = (("train", "loss"), ("eval", "loss"))
BASELINES = ("pre", "post", "deepnorm", "peri")
DEFAULT_VARIANTS = ("pre", "post", "peri", "peri_dt0.1", "deepnorm", "geonorm",
                    "geonorm_constant", "geonorm_sqrt", "geonorm_linear", "geonorm_linear_paper",
                    "simplenorm", "lns", "mixln", "ngpt", "dyt")


def add_arguments(parser):
  claims.add_variants_argument(parser, DEFAULT_VARIANTS)


def grid(args, scale):
  del scale
  steps = claims.steps_overrides(150) if args.quick else ""
  return [claims.variant(name, claims.join(overrides, steps), variant=name)
          for name, overrides in claims.variant_list(args)]


def summarize(rows, curves, config):
  by_variant = claims.group(rows, "variant")
  table = ["| variant | seeds | final validation loss | min-max | step time (ms) | parameters |",
           "|---|---|---|---|---|---|"]
  for (name,), runs in sorted(by_variant.items(),
                              key=lambda item: claims.mean_spread(claims.values(
                                  item[1], "final_eval_loss"))[0]):
    loss = claims.values(runs, "final_eval_loss")
    table.append(f"| {name} | {len(runs)} | {claims.fmt(loss)} | {min(loss):.3f}-{max(loss):.3f}"
                 f" | {1e3 * claims.mean_spread(claims.values(runs, 'step_time_s'))[0]:.0f} | "
                 f"{runs[0]['params']:,} |")
  table += ["", "Step time: the trainer's tokens/s over its last log window, converted to a "
            "step (mean over seeds; noisy on a shared machine)."]
  geo = claims.values(by_variant.get(("geonorm",), []), "final_eval_loss")
  outcomes = {b: claims.compare(geo, claims.values(by_variant[(b,)], "final_eval_loss"))
              for b in BASELINES if (b,) in by_variant}
  if not len(geo) or not outcomes:
    holds = None
  elif any(o == "higher" for o in outcomes.values()):
    holds = False
  elif len(outcomes) == len(BASELINES) and all(o == "lower" for o in outcomes.values()):
    holds = True
  else:
    holds = None
  result = (f"GeoNorm (harmonic) {claims.fmt(geo)} against "
            + "; ".join(f"{b} {claims.cell(by_variant[(b,)], 'final_eval_loss')} "
                        f"({outcomes[b]})" for b in outcomes) + ".")
  figures = {"loss_curves.png": lambda fig: claims.plot_curves(
      fig, curves, rows, lambda row: row["variant"], split="eval",
      ylabel="validation loss (nats/token)",
      title=f"{config['experiment']}: every placement, same data order and seeds")}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
