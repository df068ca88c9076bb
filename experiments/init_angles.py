"""Init angles: how far each sublayer turns the residual stream at initialisation, Pre-LN beside
Peri-LN and GeoNorm at several step sizes alpha, on the judge-scale model.

  python experiments/init_angles.py [--alphas=1,4,16,32,64] [--schedules=harmonic,constant]
      [--seeds=0,1,2] [--variants=pre,peri,peri_embed_norm]

GeoNorm's angle is theta = alpha_k |v| / |x| on the sphere; with the init std of 0.02 the
sublayer outputs are small, so at alpha 1 the stream barely turns, while Pre-LN's first block
moves its stream (small embedding, normalised sublayer inputs) by a large angle. This measures
which alpha makes GeoNorm's angles at init those of Pre-LN: a reading that sets the alpha grid
of geonorm_decay. Peri-LN adds normalised sublayer outputs (RMS about 1) to the stream, which
enters block 1 at the embedding's scale (init std 0.02) unless model.embed_norm normalises it
(the `peri_embed_norm` variant): the stream's RMS entering block 1 and the head input's token
cosine (collapse.py: 1 = every token the same) show how much of the token survives block 1.
No training: one forward pass per model on the first training batch of each seed (seconds of
CPU). Writes results/init_angles/{results.csv, table.md, config.json}: per model and block the
attention and MLP angle (mean over tokens, then mean over seeds), and per model the stream RMS
entering block 1 and the token cosine.
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
  """({(sublayer, block): mean angle at init}, {stream RMS entering block 1, token cosine}) of
  the model that `overrides` gives."""
  config = sweep.load_config(CONFIG_FILE, overrides, seed)
  setup = train.make_setup(config)
  state = train.init_state(setup)
  batch = train.global_batch(setup, next(iter(data.make_train_iterator(config))))
  stats = train.make_stream_stats(setup)(state["params"], batch)
  by_block = {(sub, block): float(stats[f"sublayer_angle/{sub}/layer_{block:02d}"])
              for sub in ("attn", "mlp") for block in range(config.model.num_layers)}
  return by_block, {"embedding_rms": float(stats["residual_rms/layer_00"]),
                    "token_cosine": float(stats["collapse/token_cosine"])}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--alphas", default="1,4,16,32,64")
  parser.add_argument("--schedules", default="harmonic,constant")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--variants", default="pre,peri,peri_embed_norm",
                      help="sweep variants (studies/sweep.py) beside GeoNorm's alphas")
  parser.add_argument("--out", default=os.path.join(REPO, "results", "init_angles"))
  args = parser.parse_args()
  models = [(name, sweep.variant_overrides(name)) for name in args.variants.split(",")] + [
      (f"geonorm {schedule} alpha {alpha}",
       f"placement=geonorm,geo_schedule={schedule},geo_alpha={alpha}")
      for schedule in args.schedules.split(",") for alpha in args.alphas.split(",")]
  rows, stream = [], {}
  for name, overrides in models:
    for seed in map(int, args.seeds.split(",")):
      by_block, stream[name, seed] = angles(overrides, seed)
      for (sub, block), value in by_block.items():
        rows.append({"model": name, "seed": seed, "sublayer": sub, "block": block + 1,
                     "angle": value, **stream[name, seed]})
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  blocks = sorted({row["block"] for row in rows})
  lines = [f"Angle (radians) each sublayer turns the residual stream at initialisation, "
           f"`{CONFIG_FILE}` model, first training batch, mean over tokens and over seeds "
           f"{args.seeds} (experiments/init_angles.py).", "",
           "| model | attention, blocks " + "-".join(map(str, [blocks[0], blocks[-1]]))
           + " | MLP, blocks " + "-".join(map(str, [blocks[0], blocks[-1]]))
           + " | stream RMS entering block 1 | token cosine of the head input |",
           "|---|---|---|---|---|"]
  for name, _ in models:
    cell = lambda sub: ", ".join(
        f"{np.mean([r['angle'] for r in rows if r['model'] == name and r['sublayer'] == sub and r['block'] == b]):.4f}"
        for b in blocks)
    mean = lambda key: np.mean([v[key] for (model, _), v in stream.items() if model == name])
    lines.append(f"| {name} | {cell('attn')} | {cell('mlp')} | {mean('embedding_rms'):.4f} | "
                 f"{mean('token_cosine'):.3f} |")
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  sweep.write_config(os.path.join(args.out, "config.json"), config_file=CONFIG_FILE,
                     alphas=args.alphas, schedules=args.schedules, seeds=args.seeds,
                     variants=args.variants)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
