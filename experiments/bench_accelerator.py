"""Training throughput and MFU on whatever devices JAX sees (meant for a GPU/TPU machine).

  python experiments/bench_accelerator.py                       # GPT-2 124M, bf16, seq 1024
  python experiments/bench_accelerator.py --size=tiny --dtype=float32 --steps=5   # CPU smoke

Trains `--steps` steps on the built-in corpus (after one compile step), reads the loss of the
last step so every step has finished, and writes results/bench/accelerator_<device>.json with
tokens/s, MFU (model FLOPs / the device's peak in metrics.device_peak_flops) and the config.
"""
import argparse
import json
import os
import platform
import time

import jax

from geonorm_jax import config as config_lib
from geonorm_jax import data as data_lib
from geonorm_jax import metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gpt2_124m")
  parser.add_argument("--placement", default="pre")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args()
  # Byte tokens of the built-in corpus fit any vocabulary, so no tokenizer or download is needed.
  config = config_lib.get_config(
      f"{args.size},placement={args.placement},dtype={args.dtype},seq_len={args.seq_len},"
      f"max_seq_len={max(args.seq_len, 256)},batch_size={args.batch_size},steps={args.steps},"
      "warmup_steps=1,progress_bar=false")
  setup = train.make_setup(config)
  state = train.init_state(setup)
  step_fn = train.make_train_step(setup)
  batches = data_lib.make_train_iterator(config)
  started = time.perf_counter()
  state, step_metrics = step_fn(state, train.global_batch(setup, next(batches)))
  float(step_metrics["loss"])
  compile_s = time.perf_counter() - started
  tokens = [train.global_batch(setup, next(batches)) for _ in range(args.steps)]
  started = time.perf_counter()
  for batch in tokens:
    state, step_metrics = step_fn(state, batch)
  final_loss = float(step_metrics["loss"])
  elapsed = time.perf_counter() - started
  tokens_per_s = args.steps * args.batch_size * args.seq_len / elapsed
  device = jax.devices()[0]
  peak = metrics.device_peak_flops(device.device_kind, args.dtype, config.train.peak_flops)
  flops = train.flops_per_token(setup, args.seq_len)
  result = {
      "device_kind": device.device_kind, "num_devices": jax.device_count(),
      "size": args.size, "placement": args.placement, "dtype": args.dtype,
      "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
      "first_step_s_incl_compile": compile_s, "tokens_per_s": tokens_per_s,
      "model_flops_per_token": flops, "peak_flops_per_device": peak,
      "mfu": metrics.mfu(tokens_per_s, flops, jax.device_count(), peak),
      "final_loss": final_loss, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
  }
  out_dir = os.path.join(REPO, "results", "bench")
  os.makedirs(out_dir, exist_ok=True)
  name = device.device_kind.lower().replace(" ", "_")
  with open(os.path.join(out_dir, f"accelerator_{name}.json"), "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
