"""Init angles: how far each sublayer turns the residual stream at initialisation, Pre-LN beside
GeoNorm at several step sizes alpha, on the judge-scale model.

  python experiments/init_angles.py [--alphas=1,4,16,32,64] [--schedules=harmonic,constant]
      [--seeds=0,1,2]

GeoNorm's angle is theta = alpha_k |v| / |x| on the sphere; with the init std of 0.02 the
sublayer outputs are small, so at alpha 1 the stream barely turns, while Pre-LN's first block
moves its stream (small embedding, normalised sublayer inputs) by a large angle. This measures
which alpha makes GeoNorm's angles at init those of Pre-LN: a reading that sets the alpha grid
of geonorm_decay. No training: one forward pass per model on the first training batch of each
seed (seconds of CPU). Writes results/init_angles/{results.csv, table.md, config.json}: per
model and block the attention and MLP angle (mean over tokens, then mean over seeds).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.data import windows as data  # pylint: disable=g-import-not-at-top
from geonorm_jax.studies import sweep
from geonorm_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = "configs/judge.py"


def angles(overrides, seed):
  """{(sublayer, block): mean angle at init} of the model that `overrides` gives."""
  config = sweep.load_config(CONFIG_FILE, overrides, seed)
  setup = train.make_setup(config)
  state = train.init_state(setup)
  batch = train.global_batch(setup, next(iter(data.make_train_iterator(config))))
  stats = train.make_stream_stats(setup)(state["params"], batch)
  return {(sub, block): float(stats[f"sublayer_angle/{sub}/layer_{block:02d}"])
          for sub in ("attn", "mlp") for block in range(config.model.num_layers)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--alphas", default="1,4,16,32,64")
  parser.add_argument("--schedules", default="harmonic,constant")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--out", default=os.path.join(REPO, "results", "init_angles"))
  args = parser.parse_args()
  models = [("pre", "placement=pre")] + [
      (f"geonorm {schedule} alpha {alpha}",
       f"placement=geonorm,geo_schedule={schedule},geo_alpha={alpha}")
      for schedule in args.schedules.split(",") for alpha in args.alphas.split(",")]
  rows = []
  for name, overrides in models:
    for seed in map(int, args.seeds.split(",")):
      for (sub, block), value in angles(overrides, seed).items():
        rows.append({"model": name, "seed": seed, "sublayer": sub, "block": block + 1,
                     "angle": value})
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  blocks = sorted({row["block"] for row in rows})
  lines = [f"Angle (radians) each sublayer turns the residual stream at initialisation, "
           f"`{CONFIG_FILE}` model, first training batch, mean over tokens and over seeds "
           f"{args.seeds} (experiments/init_angles.py).", "",
           "| model | attention, blocks " + "-".join(map(str, [blocks[0], blocks[-1]]))
           + " | MLP, blocks " + "-".join(map(str, [blocks[0], blocks[-1]])) + " |",
           "|---|---|---|"]
  for name, _ in models:
    cell = lambda sub: ", ".join(
        f"{np.mean([r['angle'] for r in rows if r['model'] == name and r['sublayer'] == sub and r['block'] == b]):.4f}"
        for b in blocks)
    lines.append(f"| {name} | {cell('attn')} | {cell('mlp')} |")
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  sweep.write_config(os.path.join(args.out, "config.json"), config_file=CONFIG_FILE,
                     alphas=args.alphas, schedules=args.schedules, seeds=args.seeds)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
