"""Every placement side by side: same model size, data order, seed and budget, at several LRs.

  python experiments/placement_sweep.py [--steps=150] [--lrs=1e-3,3e-3] [--placements=pre,...]

Trains the tiny model (4 layers, d 128) on character-level tinyshakespeare for each
placement x peak learning rate and writes results/placement_sweep/{results.csv,results.md}.
The runs are sequential in one process, so their tokens/s are comparable.
"""
import argparse
import csv
import os
import shutil
import time

from geonorm_jax import config as config_lib
from geonorm_jax import placements, report, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")
# geonorm_a4c1: GeoNorm with alpha=4 and a 1-radian clamp, the best of a small sweep of ours.
EXTRA = {"peri_dt0.1": "placement=peri,dt=0.1", "pre_qknorm": "placement=pre,qk_norm=true",
         "geonorm_a4c1": "placement=geonorm,geo_alpha=4,geo_theta_max=1.0"}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--lrs", default="1e-3,3e-3")
  parser.add_argument("--placements", default=",".join(sorted(placements.PLACEMENTS) + sorted(EXTRA)))
  parser.add_argument("--data", default=DATA)
  parser.add_argument("--workdir", default="/tmp/placement_sweep")
  args = parser.parse_args()
  out_dir = os.path.join(REPO, "results", "placement_sweep")
  os.makedirs(out_dir, exist_ok=True)
  rows = []
  for name in args.placements.split(","):
    for lr in args.lrs.split(","):
      overrides = EXTRA.get(name, f"placement={name}")
      config = config_lib.get_config(
          f"tiny,data.source=text,data.path={args.data},steps={args.steps},lr={lr},"
          f"warmup_steps={args.steps // 10},eval_every={args.steps},eval_batches=16,"
          f"checkpoint.every={args.steps},progress_bar=false,{overrides}")
      workdir = os.path.join(args.workdir, f"{name}_lr{lr}")
      shutil.rmtree(workdir, ignore_errors=True)
      started = time.perf_counter()
      summary = train.train(config, workdir)
      rows.append({"placement": name, "lr": lr, "steps": args.steps,
                   "final_train_loss": round(summary["final_train_loss"], 4),
                   "final_eval_loss": round(summary["final_eval_loss"], 4),
                   "tokens_per_s": round(summary["tokens_per_s"]),
                   "wall_s": round(time.perf_counter() - started, 1)})
      print(rows[-1], flush=True)
      _write(rows, out_dir)


def _write(rows, out_dir):
  with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write("Tiny model, character-level tinyshakespeare, batch 16 x 128, cosine schedule, "
            "one seed (experiments/placement_sweep.py).\n\n"
            + report.markdown_table(rows, columns=list(rows[0])))


if __name__ == "__main__":
  main()
