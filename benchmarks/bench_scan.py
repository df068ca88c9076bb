"""Does model.scan_layers cut the train step's compile time? A 48-layer model of tiny width,
unrolled against scanned.

For each layout: the train step (train.make_train_step, per-layer statistics on) is lowered
and compiled from scratch (the persistent compilation cache is off), then run; one step's
time is the median of the timed steps after the first. Both layouts start from the same
seed, so they hold the same parameters, and their losses are reported side by side.

  nice -n 10 python benchmarks/bench_scan.py

Writes results/bench/scan.json. Target: the scanned step compiles at least 5x faster.
"""
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import numpy as np

from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "results" / "bench" / "scan.json"
NUM_LAYERS = 48
MODEL = f"tiny,num_layers={NUM_LAYERS},d_model=32,num_heads=2,seq_len=64,batch_size=8"
TIMED_STEPS = 5
TARGET_RATIO = 5.0


def measure(scan_layers):
  config = config_lib.get_config(f"{MODEL},scan_layers={str(scan_layers).lower()}")
  setup = train.make_setup(config, jax.devices()[:1])
  state = train.init_state(setup)
  step = train.make_train_step(setup)
  rng = np.random.default_rng(0)
  batches = [train.global_batch(setup, {"tokens": rng.integers(0, 256, (8, 65))})
             for _ in range(TIMED_STEPS + 1)]
  start = time.perf_counter()
  lowered = step.lower(state, batches[0])
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  compiled_at = time.perf_counter()
  losses, step_s = [], []
  for tokens in batches:
    began = time.perf_counter()
    state, metrics = compiled(state, tokens)
    losses.append(float(metrics["loss"]))  # waits for the step
    step_s.append(time.perf_counter() - began)
  return {"lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
          "lower_and_compile_s": compiled_at - start,
          "step_s_median": statistics.median(step_s[1:]), "step_s": step_s, "losses": losses}


def main():
  jax.config.update("jax_enable_compilation_cache", False)
  unrolled = measure(False)
  scanned = measure(True)
  ratio = unrolled["lower_and_compile_s"] / scanned["lower_and_compile_s"]
  result = {
      "unrolled": unrolled, "scanned": scanned,
      "compile_ratio_unrolled_over_scanned": ratio,
      "step_ratio_unrolled_over_scanned": unrolled["step_s_median"] / scanned["step_s_median"],
      "max_loss_difference": max(abs(a - b) for a, b in zip(unrolled["losses"],
                                                            scanned["losses"])),
      "target_ratio": TARGET_RATIO, "target_met": ratio >= TARGET_RATIO,
      "config": MODEL + " (train step with per-layer statistics, 1 CPU device)",
      "machine": {"platform": platform.platform(), "python": platform.python_version(),
                  "jax": jax.__version__, "cpu_count": os.cpu_count(),
                  "load_average_1_5_15_min": list(os.getloadavg())},
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  OUTPUT.parent.mkdir(parents=True, exist_ok=True)
  OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
  print(f"lower+compile: unrolled {unrolled['lower_and_compile_s']:.1f} s, scanned "
        f"{scanned['lower_and_compile_s']:.1f} s ({ratio:.1f}x); one step: unrolled "
        f"{unrolled['step_s_median'] * 1e3:.1f} ms, scanned {scanned['step_s_median'] * 1e3:.1f} ms"
        f" -> {OUTPUT}")


if __name__ == "__main__":
  main()
