"""Calibration: our trainer on nanoGPT's CPU recipe for tinyshakespeare, against nanoGPT's ~1.88.

  python experiments/calibration.py [--variants=pre] [--seeds=0,1,2] [--jobs=N] [--print]

Each run is `python -m geonorm_jax train --config=configs/nanogpt_cpu.py:<variant>` in
runs/calibration/<variant>/seed<S> (the recipe and what differs from nanoGPT: the config's
docstring). 3 runs x about 2 minutes on both cores of this 2-core CPU (about 3.3 minutes when
two run at once, one core each). Writes results/calibration/{results.csv, table.md,
config.json}: the final validation loss per seed, its mean against the target 1.90 (nanoGPT's
README: about 1.88), and each run's wall time; --note says how the runs shared the machine.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax.studies import sweep  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = "configs/nanogpt_cpu.py"
TARGET = 1.90
NANOGPT = 1.88


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sweep.add_arguments(parser, ("pre",), root="runs/calibration")
  parser.add_argument("--out", default=os.path.join(REPO, "results", "calibration"))
  parser.add_argument("--note", default="", help="how the runs were run (for config.json)")
  args = parser.parse_args()
  runs = [sweep.Run(f"{variant}/seed{seed}", CONFIG_FILE,
                    sweep.variant_overrides(variant) + ",progress_bar=false", seed, args.root,
                    labels=(("variant", variant),))
          for variant in args.variants.split(",") for seed in map(int, args.seeds.split(","))]
  rows = sweep.execute(args, runs)
  for row, run in zip(rows, [r for r in runs if r.summary() is not None]):
    row["wall_s"] = run.summary().get("wall_s", float("nan"))
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  lines = [f"nanoGPT's CPU recipe on character-level tinyshakespeare (`{CONFIG_FILE}`), seeds "
           f"{args.seeds} (experiments/calibration.py). nanoGPT's README: validation loss about "
           f"{NANOGPT}; target: mean <= {TARGET}.", "",
           "| variant | seeds | validation loss | min-max | meets target |", "|---|---|---|---|---|"]
  for s in sweep.aggregate(rows, ["variant"], "final_eval_loss"):
    lines.append(f"| {s['variant']} | {s['n']} | {s['mean']:.3f} +- {s['std']:.3f} | "
                 f"{s['min']:.3f}-{s['max']:.3f} | {'yes' if s['mean'] <= TARGET else 'no'} |")
  lines += ["", "| run | validation loss | tokens/s | wall (s) |", "|---|---|---|---|"]
  lines += [f"| {row['name']} | {row['final_eval_loss']:.4f} | {row['tokens_per_s']:.0f} | "
            f"{row['wall_s']:.0f} |" for row in rows]
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  sweep.write_config(os.path.join(args.out, "config.json"), config_file=CONFIG_FILE,
                     seeds=args.seeds, variants=args.variants, target=TARGET, nanogpt=NANOGPT,
                     note=args.note)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
