"""The README's main job: GeoNorm (harmonic step sizes) against Pre-LN, on any machine.

    python -m geonorm_jax main --workdir=runs/main      (or: make run)

Trains the `tiny` model twice on the built-in corpus (CPython's documentation, no download),
once per placement, with the same parameter seed, data seed and budget, so the two runs see
the same batches in the same order. Then writes, under the workdir:

  geonorm/, pre/        each run's metrics.jsonl, tensorboard events, checkpoints, config
  loss_curves.png       train and eval loss against step, both runs
  summary.md / .csv     final losses, tokens/s and wall time, read back from the runs

and prints the table and a sample from the run with the lower eval loss. Rerunning with the
same workdir resumes (or skips) finished runs instead of training again.
"""
import os
import time

from geonorm_jax.nn import sample
from geonorm_jax.studies import report
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train

# The step count keeps the whole job under ~7 minutes on a 2-core CPU: measured 6 min 7 s for
# `python -m geonorm_jax main` (both runs, plot, sample) on a 2-core machine shared with other
# jobs (load average ~6), about half of that in CPU time.
STEPS = 250
EVAL_EVERY = 50
SAMPLE_PROMPT = "The "
SAMPLE_TOKENS = 200  # bytes, since the tiny model reads byte tokens

RUNS = {
    # display name -> (subfolder, preset overrides)
    "GeoNorm (harmonic)": ("geonorm", "placement=geonorm,geo_schedule=harmonic"),
    "Pre-LN": ("pre", "placement=pre"),
}


def make_config(placement_overrides, steps=STEPS):
  """The shared recipe; only the placement differs between the runs."""
  shared = (f"tiny,data.source=builtin,train.steps={steps},"
            f"train.eval_every={min(EVAL_EVERY, steps)},train.progress_bar=true,"
            f"train.layer_stats_every={min(EVAL_EVERY, steps)},"
            f"checkpoint.every={steps}")
  config = config_lib.get_config(f"{shared},{placement_overrides}")
  config.seed = 0  # parameters
  config.data.seed = 0  # batch order
  # The preset's warmup, unless a short (smoke-test) run would spend most of itself warming up.
  config.train.warmup_steps = min(config.train.warmup_steps, steps // 5)
  return config


def run(workdir, steps=STEPS):
  """Trains both runs, writes the comparison, prints the table and a sample; returns rows."""
  run_dirs = {}
  for name, (subfolder, overrides) in RUNS.items():
    run_dir = os.path.join(workdir, subfolder)
    print(f"\n== {name}: {steps} steps -> {run_dir}", flush=True)
    started = time.perf_counter()
    train.train(make_config(overrides, steps), run_dir)
    print(f"== {name}: done in {time.perf_counter() - started:.1f} s", flush=True)
    run_dirs[name] = run_dir

  rows = report.compare_runs(run_dirs, workdir,
                             title="GeoNorm (harmonic) vs Pre-LN, tiny model, built-in corpus")
  print()
  print(report.markdown_table(rows))
  print(f"Plot: {os.path.join(workdir, report.PLOT_FILENAME)}; "
        f"table: {os.path.join(workdir, report.TABLE_FILENAME)}")

  best = report.best_run(rows)
  config, model = train.load_model(run_dirs[best["placement"]])
  text = sample.generate_text(model, config, SAMPLE_PROMPT, SAMPLE_TOKENS, temperature=0.8,
                              seed=0)
  print(f"\nSample from {best['placement']} (lower eval loss), temperature 0.8:\n")
  print(SAMPLE_PROMPT + text)
  return rows
