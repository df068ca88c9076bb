"""Why do some placements sit at the unigram loss early on? Per-layer statistics, 150 steps.

  python experiments/stream_probe.py [--placements=geonorm,pre,post] [--lr=3e-3]

Trains the tiny model on character-level tinyshakespeare (the placement sweep's recipe) with
per-layer statistics every 50 steps, and writes results/stream_probe/{results.json,results.md}:
the angle each block turns the residual stream (stream_angle), the stream's RMS after each
block, and the gradient norm per block at the last step.
"""
import argparse
import json
import os
import shutil

from geonorm_jax import config as config_lib
from geonorm_jax import metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")


def _layer_values(row, prefix):
  return [round(row[k], 4) for k in sorted(k for k in row if k.startswith(prefix + "/layer_"))]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--placements", default="geonorm,pre,post")
  parser.add_argument("--lr", default="3e-3")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--workdir", default="/tmp/stream_probe")
  args = parser.parse_args()
  results = {}
  for placement in args.placements.split(","):
    workdir = os.path.join(args.workdir, placement)
    shutil.rmtree(workdir, ignore_errors=True)
    config = config_lib.get_config(
        f"tiny,data.source=text,data.path={DATA},steps={args.steps},lr={args.lr},"
        f"warmup_steps={args.steps // 10},eval_every={args.steps},eval_batches=8,"
        f"checkpoint.every={args.steps},progress_bar=false,layer_stats_every=50,"
        f"placement={placement}")
    summary = train.train(config, workdir)
    rows = metrics.read_metrics(workdir)
    layers = [r for r in rows if r["split"] == "layers"]
    last_train = [r for r in rows if r["split"] == "train" and "grad_norm/layer_00" in r][-1]
    results[placement] = {
        "final_eval_loss": summary["final_eval_loss"],
        "stream_angle": {r["step"]: _layer_values(r, "stream_angle") for r in layers},
        "residual_rms": {r["step"]: _layer_values(r, "residual_rms") for r in layers},
        "grad_norm_per_block_last_step": _layer_values(last_train, "grad_norm"),
    }
  out_dir = os.path.join(REPO, "results", "stream_probe")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump({"lr": args.lr, "steps": args.steps, "placements": results}, f, indent=2)
  lines = [f"Tiny model, tinyshakespeare, lr {args.lr}, {args.steps} steps "
           "(experiments/stream_probe.py). Angles in radians per block; gradient norms per block "
           "at the last step.", "",
           "| placement | eval loss | stream angle per block (step 0 -> 50 -> 100) | "
           "grad norm per block (last step) |", "|---|---|---|---|"]
  for placement, r in results.items():
    angles = " -> ".join(str(v) for v in r["stream_angle"].values())
    lines.append(f"| {placement} | {r['final_eval_loss']:.4f} | {angles} | "
                 f"{r['grad_norm_per_block_last_step']} |")
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
