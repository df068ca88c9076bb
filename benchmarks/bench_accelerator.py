"""Training throughput and MFU of GPT-2 124M (bf16, seq 1024) on the accelerator JAX sees.

  python benchmarks/bench_accelerator.py                    # the default runs below (+ probes)
  python benchmarks/bench_accelerator.py --size=tiny --dtype=float32 --seq_len=128 \
      --batch_size=4 --steps=2 --windows=2 --vocab_size=0    # CPU smoke of every code path

One process, one prepared run of a few minutes on an H100/H200-class GPU. In order:
  1. the chip's bf16 matmul rate on random 8192^3 operands (the measured ceiling);
  2. the training step of each `--runs` entry, as the repository builds it (its state
     initialised on the host: see `init_state_on_host`): one compile step and one more
     warm-up, then `--windows` timed windows of `--steps` steps each, each window closed by
     reading its last loss (so every step in it has finished). A run is a placement followed
     by config overrides ("pre,attention=dense,vocab_size=50257"), laid over the GPU recipe:
     model.attention=auto (cuDNN's fused kernel on a GPU in bf16) and the vocabulary padded to
     `--vocab_size` (50304 = 393 * 128; byte tokens fit any vocabulary). The default list is
     the three placements of the issue, then the unfused baseline, a doubled batch,
     scan_layers and the loss in sequence chunks, each against the first run, and GeoNorm
     compiled with the barrier option (a run ending in @keep_barriers), against the second;
  3. after the first three runs, probes of the two costly pieces outside the training step:
     causal attention (dense einsum + softmax against the fused kernel) and the LM head +
     cross-entropy (float32 against bf16 operands; vocabulary 50257 against 50304).
     Runs and probes are skipped once `--budget_s` has run out.

MFU = tokens/s * FLOPs/token / peak. FLOPs/token is 6 N + 12 L d T (PaLM appendix B, nanoGPT's
estimate_mfu) with N the parameters that sit in matmuls: every parameter except the position
table and, for an untied model, the input embedding. A tied embedding is also the LM head, a
matmul of 2 V d FLOPs per token forward, so it stays in N as nanoGPT keeps it.
(`train.flops_per_token` drops it; the JSON records that count too, as `repo_flops_per_token`.)
Two denominators: the datasheet's dense peak (metrics.device_peak_flops) and the rate measured
in step 1.

Writes `<out_dir>/accelerator_<device_kind>[_<tag>].json` after every run, so a cut-off run
keeps what it measured, and prints a table last.
"""
import argparse
import json
import math
import os
import platform
import statistics
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np

from geonorm_jax.data import windows as data_lib
from geonorm_jax.nn import losses, model as model_lib
from geonorm_jax.training import compile_options
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PADDED_GPT2_VOCAB = 50304  # 50257 rounded up to a multiple of 128


def _on_gpu():
  return jax.devices()[0].platform == "gpu"


def _median_seconds(fn, args, repeats, warmup=2):
  """Median wall time of fn(*args) with the result blocked on; warm-up calls compile first."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - started)
  return statistics.median(times)


def _rel_err(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def measure_matmul_rate(dtype, queued=10, rounds=3):
  """FLOP/s of square matmuls on random operands (8192 on an accelerator, 512 on a CPU).

  `queued` products are dispatched back to back and blocked on once, so the host's dispatch
  and sync latency (about a fifth of one 8192^3 product on an H200) stays out of the rate.
  """
  n = 8192 if jax.devices()[0].platform != "cpu" else 512
  key_a, key_b = jax.random.split(jax.random.key(0))
  a = jax.random.normal(key_a, (n, n), dtype)
  b = jax.random.normal(key_b, (n, n), dtype)
  matmul = jax.jit(jnp.matmul)

  def queue(a, b):
    return [matmul(a, b) for _ in range(queued)]
  seconds = _median_seconds(queue, (a, b), repeats=rounds) / queued
  return {"n": n, "flops_per_s": 2 * n ** 3 / seconds, "seconds": seconds}


def matmul_params(setup):
  """Parameters that multiply activations: all but the position table and an untied input table."""
  spec = setup.spec
  total = model_lib.count_params(setup.abstract_state["params"])
  positions = spec.max_seq_len * spec.d_model if spec.backbone == "gpt2" else 0
  input_table = 0 if spec.tie_embeddings else spec.vocab_size * spec.d_model
  return total - positions - input_table


# pre,loss_chunks=8: the head + loss in sequence slices (never the whole B x L x V logits),
# the largest remaining cost of the step on the H200 (28 ms of 78); not yet run on a GPU.
# geonorm@keep_barriers: GeoNorm compiled with the CPU's barrier option (compile_options),
# which made its CPU step 1.108x -> 1.061x Pre-LN's; whether the GPU pipeline gains is unknown.
DEFAULT_RUNS = ("pre;geonorm;simplenorm;pre,attention=dense,vocab_size=50257;"
                "pre,batch_size=64;pre,scan_layers=true;pre,loss_chunks=8;"
                "geonorm@keep_barriers")
KEEP_BARRIERS_SUFFIX = "@keep_barriers"


def _config_string(args, run):
  """The bench's settings, then the run's placement and overrides (later items win)."""
  text = (f"{args.size},dtype={args.dtype},seq_len={args.seq_len},"
          f"max_seq_len={max(args.seq_len, 256)},batch_size={args.batch_size},"
          f"steps={2 + args.steps * args.windows},warmup_steps=1,progress_bar=false")
  if args.vocab_size:
    text += f",vocab_size={args.vocab_size}"
  return f"{text},placement={run}"


def init_state_on_host(config, setup):
  """train.init_state run on the CPU backend, then moved into the accelerator's shardings.

  On an H200 (jax 0.11.2) XLA took 3m10s to compile train.init_state's jit for GPT-2 124M,
  against 25 s for the whole train step; the CPU backend compiles it in seconds.
  """
  host_setup = train.make_setup(config, devices=jax.devices("cpu")[:1])
  return jax.device_put(train.init_state(host_setup), setup.state_shardings)


def probe_device_init(args, placement):
  """Seconds for train.init_state on the accelerator with threefry lowered to its GPU kernel.

  jax_threefry_gpu_kernel_lowering swaps XLA's inlined threefry rounds (87 copies here) for
  one kernel call, which JAX documents as the cure for slow PRNG compiles on GPU.
  """
  setup = train.make_setup(config_lib.get_config(_config_string(args, placement)))
  previous = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  try:
    started = time.perf_counter()
    jax.block_until_ready(train.init_state(setup))
    return {"placement": placement, "init_state_s_incl_compile": time.perf_counter() - started}
  finally:
    jax.config.update("jax_threefry_gpu_kernel_lowering", previous)


def time_training(args, run):
  """Tokens/s of the repository's jitted train step; byte tokens fit any vocabulary.

  A run ending in @keep_barriers compiles with compile_options.KEEP_BARRIERS whatever the
  backend (the project applies it on CPUs only)."""
  keep_barriers = run.endswith(KEEP_BARRIERS_SUFFIX)
  config = config_lib.get_config(_config_string(args, run.removesuffix(KEEP_BARRIERS_SUFFIX)))
  setup = train.make_setup(config)
  started = time.perf_counter()
  state = init_state_on_host(config, setup)
  init_s = time.perf_counter() - started
  step_fn = train.make_train_step(
      setup, compiler_options=compile_options.KEEP_BARRIERS if keep_barriers else None)
  batches = data_lib.make_train_iterator(config)
  arrays = [train.global_batch(setup, next(batches)) for _ in range(2 + args.steps)]
  started = time.perf_counter()
  state, step_metrics = step_fn(state, arrays[0])
  float(step_metrics["loss"])
  compile_s = time.perf_counter() - started
  state, step_metrics = step_fn(state, arrays[1])
  float(step_metrics["loss"])
  tokens_per_step = config.data.batch_size * config.data.seq_len
  window_rates = []
  for _ in range(args.windows):
    started = time.perf_counter()
    for batch in arrays[2:]:
      state, step_metrics = step_fn(state, batch)
    final_loss = float(step_metrics["loss"])
    window_rates.append(args.steps * tokens_per_step / (time.perf_counter() - started))
  spec = setup.spec
  flops = 6.0 * matmul_params(setup) + 12.0 * spec.num_layers * spec.d_model * config.data.seq_len
  return {
      "placement": spec.placement.name, "attention": model_lib.attention_impl(spec),
      "keep_barriers": keep_barriers,
      "batch_size": config.data.batch_size, "scan_layers": bool(config.model.scan_layers),
      "vocab_size": spec.vocab_size, "init_state_on_host_s": init_s,
      "first_step_s_incl_compile": compile_s,
      "tokens_per_s": statistics.median(window_rates), "tokens_per_s_windows": window_rates,
      "step_ms": 1e3 * tokens_per_step / statistics.median(window_rates),
      "matmul_params": matmul_params(setup), "model_flops_per_token": flops,
      "repo_flops_per_token": train.flops_per_token(setup, args.seq_len),
      "final_loss": final_loss, "loss_is_finite": math.isfinite(final_loss),
  }


def probe_attention(args, heads, head_dim):
  """Forward + backward ms of one layer's attention, dense einsum vs fused, and their errors."""
  shape = (args.batch_size, args.seq_len, heads, head_dim)
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, cotangent = (jax.random.normal(key, shape, dtype) for key in keys)
  scale = 1.0 / math.sqrt(head_dim)

  # Every array is an argument: a closed-over one would be baked into the executable.
  def fwd_bwd(impl):
    def loss(q, k, v, cotangent):
      out = model_lib.causal_attention(q, k, v, scale, impl)
      return jnp.sum(out.astype(jnp.float32) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  f32 = lambda t: t.astype(jnp.float32)
  ref_value, ref_grads = fwd_bwd("dense")(f32(q), f32(k), f32(v), cotangent)
  fused = "cudnn" if _on_gpu() else "blocked"
  out = {"shape_BxLxHxK": list(shape), "fused_impl": fused}
  for name, impl in (("dense", "dense"), ("fused", fused)):
    try:
      fn = fwd_bwd(impl)
      value, grads = fn(q, k, v, cotangent)
      out[name] = {
          "fwd_bwd_ms": 1e3 * _median_seconds(fn, (q, k, v, cotangent), repeats=10),
          "rel_err_grads_vs_f32": max(_rel_err(g, r) for g, r in zip(grads, ref_grads)),
          "rel_err_value_vs_f32": _rel_err(value, ref_value),
      }
    except Exception as e:  # a missing cuDNN kernel must not cost the rest of the run
      out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
  return out


def probe_head(args, d_model):
  """Forward + backward ms of LM head + cross-entropy: float32 vs bf16 operands, two vocabularies."""
  tokens = args.batch_size * args.seq_len
  keys = jax.random.split(jax.random.key(2), 3)
  x_1xTxD = jax.random.normal(keys[0], (1, tokens, d_model), jnp.float32)
  out = {"tokens": tokens}
  for vocab in (50257, PADDED_GPT2_VOCAB):
    w_DxV = 0.02 * jax.random.normal(keys[1], (d_model, vocab), jnp.float32)
    targets_1xT = jax.random.randint(keys[2], (1, tokens), 0, 50257)
    for operands in ("float32", "bfloat16"):
      def loss(x, w, targets, operands=operands):
        logits = jnp.einsum("bld,dv->blv", x.astype(operands), w.astype(operands),
                            preferred_element_type=jnp.float32)
        return losses.cross_entropy(logits, targets)[0]
      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      out[f"vocab{vocab}_{operands}_fwd_bwd_ms"] = 1e3 * _median_seconds(
          fn, (x_1xTxD, w_DxV, targets_1xT), repeats=10)
  return out


def _summary_rows(result):
  rows = []
  for run in result["runs"]:
    rows.append(f"{run['name']:<40} {run['tokens_per_s']:>12,.0f} {run['step_ms']:>8.1f} "
                f"{100 * run['mfu_vs_datasheet']:>7.1f}% {100 * run['mfu_vs_measured']:>7.1f}% "
                f"{run['first_step_s_incl_compile']:>7.1f}s {run['final_loss']:>7.3f}")
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gpt2_124m")
  parser.add_argument("--runs", default=DEFAULT_RUNS,
                      help="';'-separated runs: a placement, then config overrides")
  parser.add_argument("--vocab_size", type=int, default=PADDED_GPT2_VOCAB,
                      help="vocabulary of every run unless it overrides it (0 = the size's)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
  parser.add_argument("--windows", type=int, default=3)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no probe or run (after the first) past this many seconds "
                      "(0 = no limit)")
  parser.add_argument("--probe_device_init", action="store_true",
                      help="last, time train.init_state on the accelerator with the threefry "
                      "kernel lowering (may take minutes if that does not help)")
  parser.add_argument("--out_dir", default=os.path.join(REPO, "results", "bench"))
  parser.add_argument("--tag", default="", help="appended to the results file's name")
  args = parser.parse_args()
  started = time.perf_counter()
  device = jax.devices()[0]
  table_peak = metrics.device_peak_flops(device.device_kind, args.dtype, float("nan"))
  matmul = measure_matmul_rate(jnp.dtype(args.dtype))
  result = {
      "device_kind": device.device_kind, "platform": device.platform,
      "num_devices": jax.device_count(), "jax": jax.__version__, "flax": flax.__version__,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "size": args.size, "dtype": args.dtype, "seq_len": args.seq_len,
      "batch_size": args.batch_size, "steps_per_window": args.steps, "windows": args.windows,
      "peak_flops_datasheet": table_peak, "matmul_rate_measured": matmul,
      "runs": [], "probes": {}, "errors": {}, "host": platform.node(),
      "date": time.strftime("%Y-%m-%d"),
  }
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir,
                      f"accelerator_{device.device_kind.lower().replace(' ', '_')}"
                      f"{'_' + args.tag if args.tag else ''}.json")

  def record(name, run):
    denominator = jax.device_count()
    run = {"name": name, **run,
           "mfu_vs_datasheet": metrics.mfu(run["tokens_per_s"], run["model_flops_per_token"],
                                           denominator, table_peak),
           "mfu_vs_measured": metrics.mfu(run["tokens_per_s"], run["model_flops_per_token"],
                                          denominator, matmul["flops_per_s"])}
    result["runs"].append(run)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
    print(json.dumps(run), flush=True)

  def in_budget():
    return not args.budget_s or time.perf_counter() - started < args.budget_s

  for index, run in enumerate(filter(None, args.runs.split(";"))):
    if index == 3 and in_budget():
      spec = train.make_setup(config_lib.get_config(_config_string(args, "pre"))).spec
      result["probes"]["attention"] = probe_attention(args, spec.num_heads, spec.head_dim)
      result["probes"]["head"] = probe_head(args, spec.d_model)
      print(json.dumps(result["probes"]), flush=True)
    if index and not in_budget():
      print(f"budget spent: skipping run {run}", flush=True)
      continue
    try:
      record(run, time_training(args, run))
    except Exception as e:  # e.g. out of memory at a doubled batch: keep the other runs
      result["errors"][run] = f"{type(e).__name__}: {e}"[:500]
      print(f"run {run} failed: {result['errors'][run]}", flush=True)
  # Last: if the kernel lowering does not cure the slow compile, only this probe is lost.
  if args.probe_device_init and in_budget():
    result["probes"]["device_init_threefry_kernel"] = probe_device_init(args, "pre")
    print(json.dumps(result["probes"]["device_init_threefry_kernel"]), flush=True)
  result["total_s"] = time.perf_counter() - started
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{device.device_kind}: matmul {matmul['flops_per_s'] / 1e12:.0f} TFLOP/s measured, "
        f"{table_peak / 1e12:.0f} datasheet; batch {args.batch_size} x {args.seq_len}")
  print(f"{'run':<40} {'tokens/s':>12} {'step_ms':>8} {'MFU(ds)':>8} {'MFU(ms)':>8} "
        f"{'compile':>8} {'loss':>7}")
  print("\n".join(_summary_rows(result)))
  print(json.dumps(result["probes"], indent=1))
  print(f"wrote {path} in {result['total_s']:.0f}s")


if __name__ == "__main__":
  main()
