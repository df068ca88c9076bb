"""Every placement on character-level tinyshakespeare at the default recipe, several seeds.

  python experiments/shakespeare.py [--variants=pre,post,...] [--seeds=0,1,2] [--jobs=1] [--print]

The recipe is configs/shakespeare.py (tiny model, untied head, 500 steps x 16 x 128, lr 3e-3);
each run is `python -m geonorm_jax train --config=configs/shakespeare.py:<variant>` in
runs/shakespeare/<variant>/seed<S> (`--print` lists the commands). Writes
results/shakespeare/{results.csv, table.md, config.json}: the final validation loss per
variant (mean, sample std, min-max over seeds) against the target of 2.5, and the collapse
diagnostics of the last check.
"""
import argparse
import os

from geonorm_jax.studies import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = "configs/shakespeare.py"
TARGET = 2.5
DEFAULT_VARIANTS = ("pre", "post", "peri", "peri_dt0.1", "reordered", "deepnorm", "geonorm",
                    "geonorm_constant", "geonorm_sqrt", "geonorm_linear", "geonorm_linear_paper",
                    "simplenorm", "lns", "mixln", "ngpt", "dyt")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sweep.add_arguments(parser, DEFAULT_VARIANTS, root="runs/shakespeare")
  parser.add_argument("--extra", default="", help="overrides added to every run, e.g. steps=50")
  parser.add_argument("--out", default=os.path.join(REPO, "results", "shakespeare"))
  args = parser.parse_args()
  runs = []
  for variant in args.variants.split(","):
    for seed in map(int, args.seeds.split(",")):
      overrides = ",".join(filter(None, [sweep.variant_overrides(variant), args.extra,
                                         "progress_bar=false"]))
      runs.append(sweep.Run(f"{variant}/seed{seed}", CONFIG_FILE, overrides, seed, args.root,
                            labels=(("variant", variant),)))
  rows = sweep.execute(args, runs)
  os.makedirs(args.out, exist_ok=True)
  sweep.write_csv(os.path.join(args.out, "results.csv"), rows)
  stats = {s["variant"]: s for s in sweep.aggregate(rows, ["variant"], "final_eval_loss")}
  cosine = {s["variant"]: s for s in sweep.aggregate(rows, ["variant"], "token_cosine")}
  lines = [f"Character-level tinyshakespeare, `{CONFIG_FILE}` (extra overrides: "
           f"`{args.extra or 'none'}`), seeds {args.seeds} (experiments/shakespeare.py). "
           "Validation loss after the last step: mean +- sample std (min-max) over seeds; "
           f"target < {TARGET}. Token cosine: mean cosine between different tokens' head "
           "inputs at the last check (1.0 = collapsed).", "",
           "| variant | seeds | validation loss | min-max | below target | token cosine |",
           "|---|---|---|---|---|---|"]
  for variant, s in stats.items():
    below = "yes" if s["max"] < TARGET else ("no" if s["min"] >= TARGET else "some seeds")
    lines.append(f"| {variant} | {s['n']} | {s['mean']:.3f} +- {s['std']:.3f} | "
                 f"{s['min']:.3f}-{s['max']:.3f} | {below} | {cosine[variant]['mean']:.3f} |")
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  sweep.write_config(os.path.join(args.out, "config.json"), config_file=CONFIG_FILE,
                     extra=args.extra, seeds=args.seeds,
                     variants={v: sweep.PLACEMENT_VARIANTS[v] for v in stats})
  print("\n".join(lines))


if __name__ == "__main__":
  main()
