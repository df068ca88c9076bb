"""Two sets of runs from claim results folders compared seed by seed: `compare` command.

  python -m geonorm_jax compare results/geonorm_decay:harmonic/blocks/lr0.002/alpha4 \
      results/norm_zoo:post/lr0.004

Each side is FOLDER:RUN, RUN a run name of FOLDER's results.csv without its "/seedN"; its
runs on the selection seed (stage "select", which chose the LR or the knob) are left out, as a
claim's verdict leaves them out. Runs with the same seed share the init seed and the data order, so the two are compared as a
paired difference over their shared seeds (stats.difference: a t interval at the actual
degrees of freedom), which is what a claim experiment does inside one folder; this does it
across two folders, e.g. a cell of one experiment against a baseline of another. The sides
must be runs of one recipe: the same config file, training steps and tokens, else it refuses.
"""
import json
import os

from geonorm_jax.studies import results_folder, stats

KEY = "final_eval_loss"


def runs_of(spec):
  """(folder, run, config file, overrides, {seed: results.csv row}) of FOLDER:RUN."""
  folder, sep, run = spec.partition(":")
  if not sep or not run:
    raise ValueError(f"compare: {spec!r} is not FOLDER:RUN (e.g. results/norm_zoo:pre/lr0.004)")
  rows = results_folder.read_csv(os.path.join(folder, "results.csv"))
  with open(os.path.join(folder, "config.json")) as f:
    config = json.load(f)
  # The selection seed chose the LR (or other knob) of the runs: not a fresh seed.
  by_seed = {row["seed"]: row for row in rows if row["name"] == f"{run}/seed{row['seed']}"
             and row.get("stage") != "select"}
  if not by_seed:
    names = sorted({row["name"].rsplit("/seed", 1)[0] for row in rows})
    raise ValueError(f"compare: {folder} has no run {run!r} on a fresh seed (selection-seed "
                     f"runs do not count); its runs: {', '.join(names)}")
  overrides = config.get("runs", {}).get(f"{run}/seed{min(by_seed)}", "")
  return folder, run, config.get("config_file"), overrides, by_seed


def _check_one_recipe(a, b):
  """Refuse two sides that are not the same recipe (then the data order is not shared)."""
  if a[2] != b[2]:
    raise ValueError(f"compare: {a[0]} uses {a[2]}, {b[0]} uses {b[2]}: not one recipe")
  for key in ("steps", "tokens"):
    values = {row.get(key) for side in (a, b) for row in side[4].values()}
    if len(values) > 1:
      raise ValueError(f"compare: the runs differ in {key} ({sorted(values)}): not one recipe")


def compare(spec_a, spec_b, key=KEY):
  """(lines of text, stats.Difference of A - B in `key` over the shared seeds)."""
  a, b = runs_of(spec_a), runs_of(spec_b)
  _check_one_recipe(a, b)
  values = [{seed: row.get(key) for seed, row in side[4].items()} for side in (a, b)]
  difference = stats.difference(*values)
  lines = []
  for label, side, by_seed in zip("AB", (a, b), values):
    lines.append(f"{label}: {side[0]}:{side[1]} ({side[3]}): " + ", ".join(
        f"seed {seed} {value:.4f}" for seed, value in sorted(by_seed.items())))
  shared = sorted(set(values[0]) & set(values[1]))
  lines.append(f"A - B in {key}, seeds {', '.join(map(str, shared)) or 'none shared'}: "
               f"{difference.describe()}, p = {difference.p:.3g}: {difference.outcome}")
  return lines, difference
