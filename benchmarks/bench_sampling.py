"""Time per generated token with the K/V cache against the full-window re-run, at 256 tokens
of context, on the tiny preset (max_seq_len raised to 512 so that 256 tokens fit with room).

A 256-token prompt, a window of 256 + NEW_TOKENS slots, so every token of both paths is
generated with 256-319 tokens of context. Per-token time = (time of NEW_TOKENS + 1 tokens -
time of 1 token) / NEW_TOKENS: the prefill (or first full step) cancels. Both paths are
compiled before timing; each is timed ROUNDS times, alternating, and the median kept. The
greedy tokens of both paths are compared too.

  nice -n 10 python benchmarks/bench_sampling.py

Writes results/bench/sampling.json. Target: the cached path at least 10x faster per token.
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

from geonorm_jax.data import sources as data_sources
from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import sample
from geonorm_jax.training import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "results" / "bench" / "sampling.json"
PRESET = "tiny,max_seq_len=512"
PROMPT_TOKENS = 256
NEW_TOKENS = 64
ROUNDS = 5
TARGET_RATIO = 10.0


def seconds(model, prompt, num_tokens, use_cache):
  start = time.perf_counter()
  sample.generate(model, prompt, num_tokens, temperature=0.0, use_cache=use_cache,
                  context_len=PROMPT_TOKENS + NEW_TOKENS)
  return time.perf_counter() - start


def main():
  config = config_lib.get_config(PRESET)
  model = model_lib.build(config.model, seed=0)
  text = data_sources.builtin_text()
  prompt = np.frombuffer(text.encode("utf-8")[:PROMPT_TOKENS], np.uint8).astype(np.int32)
  tokens = {}
  for use_cache in (True, False):  # compile both, and keep their tokens
    tokens[use_cache] = sample.generate(model, prompt, NEW_TOKENS, temperature=0.0,
                                        use_cache=use_cache,
                                        context_len=PROMPT_TOKENS + NEW_TOKENS).tolist()
  per_token = {True: [], False: []}
  for _ in range(ROUNDS):
    for use_cache in (True, False):
      many = seconds(model, prompt, NEW_TOKENS + 1, use_cache)
      one = seconds(model, prompt, 1, use_cache)
      per_token[use_cache].append((many - one) / NEW_TOKENS)
  cached, uncached = (statistics.median(per_token[flag]) for flag in (True, False))
  result = {
      "per_token_s_cached": cached, "per_token_s_uncached": uncached,
      "speedup": uncached / cached,
      "rounds_per_token_s": {"cached": per_token[True], "uncached": per_token[False]},
      "same_greedy_tokens": tokens[True] == tokens[False],
      "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
      "context_len": PROMPT_TOKENS + NEW_TOKENS,
      "target_ratio": TARGET_RATIO, "target_met": uncached / cached >= TARGET_RATIO,
      "config": PRESET + " (gpt2 backbone, Pre-LN, untrained weights, seed 0, greedy)",
      "machine": {"platform": platform.platform(), "python": platform.python_version(),
                  "jax": jax.__version__, "devices": str(jax.devices()),
                  "load_average_1_5_15_min": list(os.getloadavg())},
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  OUTPUT.parent.mkdir(parents=True, exist_ok=True)
  OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
  print(f"per token: cached {cached * 1e3:.2f} ms, uncached {uncached * 1e3:.2f} ms "
        f"({uncached / cached:.1f}x), same tokens: {result['same_greedy_tokens']} -> {OUTPUT}")


if __name__ == "__main__":
  main()
