"""What happens inside the placements that stall: per-layer statistics over training.

  python experiments/stream_probe.py [--variants=pre,post,deepnorm,mixln,geonorm,dyt]
      [--ties=true,false] [--lr=1e-3] [--seeds=0,1,2] [--jobs=1]

Uses the placement sweep's runs (same names, same root: finished runs are reused, missing
ones are trained) and reads their per-layer statistics (logged every train.layer_stats_every
steps): the collapse diagnostics (token cosine of the head inputs, logit spread), the residual
stream's RMS after each block, the angle each block turns the stream, the angle each of its
sublayers (attention, MLP) turns it, mean and max over tokens (for GeoNorm the geodesic angle
alpha_k |v|/|x| it takes), and the gradient norm per block at the last step. Writes
results/stream_probe/{results.json, table.md}.
"""
import argparse
import json
import os

import numpy as np

from geonorm_jax.studies import sweep
from geonorm_jax.training import metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = "configs/shakespeare.py"


def _layer_values(row, prefix):
  return [row[k] for k in sorted(k for k in row if k.startswith(prefix + "/layer_"))]


# (field, logged statistic): the sublayer angles at the last check, per block.
SUBLAYER_FIELDS = tuple((f"{statistic}_{sublayer}_last_check", f"{statistic}/{sublayer}")
                        for statistic in ("sublayer_angle", "sublayer_angle_max")
                        for sublayer in ("attn", "mlp"))


def _probe(run):
  rows = metrics.read_metrics(run.workdir)
  layers = [r for r in rows if r["split"] == "layers"]
  last_train = [r for r in rows if r["split"] == "train" and "grad_norm/layer_00" in r][-1]
  return {
      "steps": [r["step"] for r in layers],
      "token_cosine": [r["collapse/token_cosine"] for r in layers],
      "logit_spread": [r["collapse/logit_spread"] for r in layers],
      "residual_rms_last_check": _layer_values(layers[-1], "residual_rms"),
      "stream_angle_last_check": _layer_values(layers[-1], "stream_angle"),
      # NaN per block where the run predates the sublayer statistics.
      **{field: (_layer_values(layers[-1], statistic) or
                 [float("nan")] * len(_layer_values(layers[-1], "stream_angle")))
         for field, statistic in SUBLAYER_FIELDS},
      "grad_norm_per_block_last_step": [last_train[k] for k in sorted(last_train)
                                        if k.startswith("grad_norm/layer_")],
      "final_eval_loss": (run.summary() or {}).get("final_eval_loss"),
      # DyT only (NaN elsewhere): fraction of the final DyT's saturated tanh units.
      "tanh_saturated_final_last_check": layers[-1].get("collapse/tanh_saturated_final",
                                                        float("nan")),
  }


def _mean(lists):
  return np.mean(np.asarray(lists, float), axis=0).round(4).tolist()


def _mean_and_max(result, sublayer):
  """'0.0123 (0.0456), ...': a sublayer's angle per block, mean (max) over tokens."""
  return ", ".join(f"{mean:.4f} ({peak:.4f})" for mean, peak in
                   zip(result[f"sublayer_angle_{sublayer}_last_check"],
                       result[f"sublayer_angle_max_{sublayer}_last_check"]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sweep.add_arguments(parser, ("pre", "post", "deepnorm", "mixln", "geonorm", "dyt"),
                      root="runs/placement_sweep")
  parser.add_argument("--ties", default="true,false")
  parser.add_argument("--lr", default="1e-3")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--out", default=os.path.join(REPO, "results", "stream_probe"))
  args = parser.parse_args()
  runs = sweep.placement_grid(args.variants.split(","), args.ties.split(","), [args.lr],
                              list(map(int, args.seeds.split(","))), args.steps, CONFIG_FILE,
                              args.root)
  sweep.execute(args, runs)
  grouped = {}
  for run in runs:
    if run.summary() is not None:
      labels = dict(run.labels)
      grouped.setdefault(f"{labels['variant']}/{labels['head']}", []).append(_probe(run))
  results = {}
  for key, probes in grouped.items():
    results[key] = {"seeds": len(probes), "steps": probes[0]["steps"],
                    **{field: _mean([p[field] for p in probes]) for field in
                       ("token_cosine", "logit_spread", "residual_rms_last_check",
                        "stream_angle_last_check", "grad_norm_per_block_last_step",
                        "final_eval_loss", "tanh_saturated_final_last_check",
                        *(field for field, _ in SUBLAYER_FIELDS))}}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"lr": args.lr, "steps": args.steps, "seeds": args.seeds, "runs": results}, f,
              indent=2)
  lines = [f"Tiny model, tinyshakespeare (`{CONFIG_FILE}` cut to {args.steps} steps), lr "
           f"{args.lr}, means over seeds {args.seeds} (experiments/stream_probe.py). Token "
           "cosine of the head inputs at each check (1.0 = collapsed); residual RMS after the "
           "embedding and each block, angle (radians) each block turns the stream, and each of "
           "its sublayers, mean (max) over tokens, all at the last check; gradient norm per "
           "block at the last step.", "",
           "| variant/head | eval loss | token cosine over checks | residual RMS | block angle "
           "| attention angle | MLP angle | grad norm per block |",
           "|---|---|---|---|---|---|---|---|"]
  for key, r in results.items():
    lines.append(f"| {key} | {r['final_eval_loss']:.3f} | "
                 f"{' -> '.join(f'{v:.2f}' for v in r['token_cosine'])} | "
                 f"{r['residual_rms_last_check']} | {r['stream_angle_last_check']} | "
                 f"{_mean_and_max(r, 'attn')} | {_mean_and_max(r, 'mlp')} | "
                 f"{r['grad_norm_per_block_last_step']} |")
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
