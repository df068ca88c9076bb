"""How fast does the data loader deliver tokens, compared with what training consumes?

Runs the train iterator on the builtin corpus (batch 16 x seq 128, no worker processes)
pinned to one CPU core, and reports the median tokens/s over several timed runs. Tokens
are counted as the trainer counts them: batch * seq_len predicted positions per batch.
The loader should deliver at least 10x the tiny model's training tokens/s, so when
`geonorm_jax.training.train.benchmark_tokens_per_s(config, steps)` exists it is measured too.

  python benchmarks/bench_data.py

Writes results/bench/data.json. Takes well under a minute.
"""
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

from geonorm_jax.data import windows as data
from geonorm_jax.training import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

OUTPUT = REPO_ROOT / "results" / "bench" / "data.json"
TIMED_RUNS = 7
BATCHES_PER_RUN = 300
WARMUP_BATCHES = 50
TRAIN_BENCH_STEPS = 20
TARGET_RATIO = 10.0


def bench_config(sampling: str):
  config = config_lib.get_config("tiny")  # the model whose training speed the loader must beat
  config.data.source = "builtin"
  config.data.batch_size = 16
  config.data.seq_len = 128
  config.data.sampling = sampling
  config.data.num_workers = 0
  return config


def loader_rates_on_one_core() -> tuple[dict[str, list[float]], str]:
  """Loader tokens/s per sampling, measured pinned to one core (the number is per core).

  The affinity is restored afterwards: training is measured on every core, as it runs.
  """
  if not hasattr(os, "sched_setaffinity"):
    pinning = "not pinned (no sched_setaffinity on this platform)"
    return {s: loader_tokens_per_s(bench_config(s)) for s in data.SAMPLINGS}, pinning
  all_cores = os.sched_getaffinity(0)
  core = min(all_cores)
  os.sched_setaffinity(0, {core})
  try:
    rates = {s: loader_tokens_per_s(bench_config(s)) for s in data.SAMPLINGS}
  finally:
    os.sched_setaffinity(0, all_cores)
  return rates, f"loader pinned to core {core}; training unpinned"


def loader_tokens_per_s(config) -> list[float]:
  """tokens/s of each timed run, after a warm-up that also loads and checks the corpus."""
  # process 0 of 1, given explicitly: the loader alone, without importing jax.
  iterator = data.make_train_iterator(config, process_index=0, process_count=1)
  for _ in range(WARMUP_BATCHES):
    next(iterator)
  tokens_per_batch = config.data.batch_size * config.data.seq_len
  rates = []
  for _ in range(TIMED_RUNS):
    start = time.perf_counter()
    for _ in range(BATCHES_PER_RUN):
      next(iterator)
    rates.append(BATCHES_PER_RUN * tokens_per_batch / (time.perf_counter() - start))
  return rates


def train_tokens_per_s(config) -> tuple[float | None, str]:
  """The trainer's own throughput benchmark, when the trainer provides one."""
  try:
    from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, f"skipped: geonorm_jax.training.train not importable ({e})"
  if not hasattr(train, "benchmark_tokens_per_s"):
    return None, "skipped: geonorm_jax.training.train has no benchmark_tokens_per_s"
  rate = float(train.benchmark_tokens_per_s(config, TRAIN_BENCH_STEPS))
  return rate, f"train.benchmark_tokens_per_s(config, {TRAIN_BENCH_STEPS})"


def machine_info(pinning: str) -> dict:
  return dict(
      platform=platform.platform(),
      processor=platform.processor() or platform.machine(),
      python=platform.python_version(),
      cpu_count=os.cpu_count(),
      # other jobs share this machine; a high load explains a low or noisy number
      load_average_1_5_15_min=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
      pinning=pinning,
  )


def main():
  rates, pinning = loader_rates_on_one_core()
  config = bench_config("random")  # the base config's sampling, reported as the headline
  loader_rate = statistics.median(rates["random"])
  train_rate, train_note = train_tokens_per_s(config)
  ratio = None if train_rate is None else loader_rate / train_rate
  result = dict(
      tokens_per_s=loader_rate,
      tokens_per_s_by_sampling={s: statistics.median(r) for s, r in rates.items()},
      runs_tokens_per_s={s: r for s, r in rates.items()},
      timed_runs=TIMED_RUNS,
      batches_per_run=BATCHES_PER_RUN,
      tokens_counted="batch_size * seq_len per batch (predicted positions)",
      train_tokens_per_s=train_rate,
      train_note=train_note,
      loader_over_train=ratio,
      target_ratio=TARGET_RATIO,
      target_met=None if ratio is None else ratio >= TARGET_RATIO,
      config=config.data.to_dict(),
      machine=machine_info(pinning),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )
  OUTPUT.parent.mkdir(parents=True, exist_ok=True)
  OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps({k: result[k] for k in (
      "tokens_per_s", "tokens_per_s_by_sampling", "train_tokens_per_s", "train_note",
      "loader_over_train")}, indent=2))
  print(f"wrote {OUTPUT}")


if __name__ == "__main__":
  main()
