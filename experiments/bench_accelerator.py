"""Training throughput and MFU of GPT-2 124M (bf16, seq 1024) on the accelerator JAX sees.

  python experiments/bench_accelerator.py                    # pre, geonorm, simplenorm (+ probes)
  python experiments/bench_accelerator.py --size=tiny --dtype=float32 --seq_len=128 \
      --batch_size=4 --steps=2 --windows=2                   # CPU smoke of every code path

One process, one prepared run of a few minutes on an H100/H200-class GPU. In order:
  1. the chip's bf16 matmul rate on random 8192^3 operands (the measured ceiling);
  2. the training step of each `--placements` entry, as the repository builds it (its state
     initialised on the host: see `init_state_on_host`): one compile step and one more warm-up, then `--windows` timed windows of `--steps` steps each, each
     window closed by reading its last loss (so every step in it has finished);
  3. probes of the two suspected slow paths, outside the training step: causal attention
     (the model's einsum + softmax against jax.nn.dot_product_attention, cuDNN on a GPU) and
     the LM head + cross-entropy (float32 operands, as the model does, against bf16 operands
     with float32 accumulation; vocabulary 50257 against 50304 = 393 * 128);
  4. `--proposals`: the training step again with the model changes those probes suggest,
     patched in for this process only (see `proposed_model_changes`), to measure what the
     changes would buy before anyone edits model.py. The first of these runs before the probes.
     Probes and proposals are skipped once `--budget_s` has run out.

MFU = tokens/s * FLOPs/token / peak. FLOPs/token is 6 N + 12 L d T (PaLM appendix B, nanoGPT's
estimate_mfu) with N the parameters that sit in matmuls: every parameter except the position
table and, for an untied model, the input embedding. A tied embedding is also the LM head, a
matmul of 2 V d FLOPs per token forward, so it stays in N as nanoGPT keeps it.
(`train.flops_per_token` drops it; the JSON records that count too, as `repo_flops_per_token`.)
Two denominators: the datasheet's dense peak (metrics.device_peak_flops) and the rate measured
in step 1.

Writes `<out_dir>/accelerator_<device_kind>.json` after every run, so a cut-off run keeps what
it measured, and prints a table last.
"""
import argparse
import contextlib
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

from geonorm_jax import config as config_lib
from geonorm_jax import data as data_lib
from geonorm_jax import losses, metrics, model as model_lib, train

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


def _config_string(args, placement, vocab_size=None):
  text = (f"{args.size},placement={placement},dtype={args.dtype},seq_len={args.seq_len},"
          f"max_seq_len={max(args.seq_len, 256)},batch_size={args.batch_size},"
          f"steps={2 + args.steps * args.windows},warmup_steps=1,progress_bar=false")
  return text + (f",vocab_size={vocab_size}" if vocab_size else "")


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


def time_training(args, placement, vocab_size=None):
  """Tokens/s of the repository's jitted train step; byte tokens fit any vocabulary."""
  config = config_lib.get_config(_config_string(args, placement, vocab_size))
  setup = train.make_setup(config)
  started = time.perf_counter()
  state = init_state_on_host(config, setup)
  init_s = time.perf_counter() - started
  step_fn = train.make_train_step(setup)
  batches = data_lib.make_train_iterator(config)
  arrays = [train.global_batch(setup, next(batches)) for _ in range(2 + args.steps)]
  started = time.perf_counter()
  state, step_metrics = step_fn(state, arrays[0])
  float(step_metrics["loss"])
  compile_s = time.perf_counter() - started
  state, step_metrics = step_fn(state, arrays[1])
  float(step_metrics["loss"])
  tokens_per_step = args.batch_size * args.seq_len
  window_rates = []
  for _ in range(args.windows):
    started = time.perf_counter()
    for batch in arrays[2:]:
      state, step_metrics = step_fn(state, batch)
    final_loss = float(step_metrics["loss"])
    window_rates.append(args.steps * tokens_per_step / (time.perf_counter() - started))
  spec = setup.spec
  flops = 6.0 * matmul_params(setup) + 12.0 * spec.num_layers * spec.d_model * args.seq_len
  return {
      "placement": placement, "vocab_size": spec.vocab_size, "init_state_on_host_s": init_s,
      "first_step_s_incl_compile": compile_s,
      "tokens_per_s": statistics.median(window_rates), "tokens_per_s_windows": window_rates,
      "step_ms": 1e3 * tokens_per_step / statistics.median(window_rates),
      "matmul_params": matmul_params(setup), "model_flops_per_token": flops,
      "repo_flops_per_token": train.flops_per_token(setup, args.seq_len),
      "final_loss": final_loss, "loss_is_finite": math.isfinite(final_loss),
  }


def _fused_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale, impl=None):
  """The model's causal_attention through jax.nn.dot_product_attention (cuDNN on a GPU)."""
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale=scale,
                                      is_causal=True,
                                      implementation="cudnn" if _on_gpu() else None)


def _bf16_head_logits(self, x_BxLxD):
  """Transformer.logits with bf16 operands and float32 accumulation (the model casts to float32)."""
  if self.final_norm is not None:
    x_BxLxD = self.final_norm(x_BxLxD)
  head_DxV = self.embed[...].T if self.head is None else self.head[...]
  logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD.astype(jnp.bfloat16),
                            head_DxV.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  if self.s_z is not None:
    logits_BxLxV = logits_BxLxV * self.s_z()
  return logits_BxLxV


@contextlib.contextmanager
def proposed_model_changes(attention, bf16_head):
  """Swap in the proposed model.py changes for this process only, restoring them after.

  The patched functions compute the same function as model.py's (the attention probe checks
  the fused kernel against a float32 reference); they exist here only until model.py has them.
  """
  saved = model_lib.causal_attention, model_lib.Transformer.logits
  if attention:
    model_lib.causal_attention = _fused_attention
  if bf16_head:
    model_lib.Transformer.logits = _bf16_head_logits
  try:
    yield
  finally:
    model_lib.causal_attention, model_lib.Transformer.logits = saved


def probe_attention(args, heads, head_dim):
  """Forward + backward ms of one layer's attention, model einsum vs fused, and their errors."""
  shape = (args.batch_size, args.seq_len, heads, head_dim)
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, cotangent = (jax.random.normal(key, shape, dtype) for key in keys)
  scale = 1.0 / math.sqrt(head_dim)

  # Every array is an argument: a closed-over one would be baked into the executable.
  def fwd_bwd(attention):
    def loss(q, k, v, cotangent):
      return jnp.sum(attention(q, k, v, scale).astype(jnp.float32) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  f32 = lambda t: t.astype(jnp.float32)
  ref_value, ref_grads = fwd_bwd(model_lib.causal_attention)(f32(q), f32(k), f32(v), cotangent)
  out = {"shape_BxLxHxK": list(shape)}
  for name, attention in (("model_einsum", model_lib.causal_attention),
                          ("fused", _fused_attention)):
    try:
      fn = fwd_bwd(attention)
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
    rows.append(f"{run['name']:<32} {run['tokens_per_s']:>12,.0f} {run['step_ms']:>8.1f} "
                f"{100 * run['mfu_vs_datasheet']:>7.1f}% {100 * run['mfu_vs_measured']:>7.1f}% "
                f"{run['first_step_s_incl_compile']:>7.1f}s {run['final_loss']:>7.3f}")
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gpt2_124m")
  parser.add_argument("--placements", default="pre,geonorm,simplenorm")
  parser.add_argument("--proposals", default="pre,geonorm,simplenorm",
                      help="placements to rerun with the proposed changes ('' = none)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
  parser.add_argument("--windows", type=int, default=3)
  parser.add_argument("--budget_s", type=float, default=0.0,
                      help="start no probe or proposal run past this many seconds (0 = no limit)")
  parser.add_argument("--probe_device_init", action="store_true",
                      help="last, time train.init_state on the accelerator with the threefry "
                      "kernel lowering (may take minutes if that does not help)")
  parser.add_argument("--out_dir", default=os.path.join(REPO, "results", "bench"))
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
      "runs": [], "probes": {}, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
  }
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir,
                      f"accelerator_{device.device_kind.lower().replace(' ', '_')}.json")

  def record(name, run, changes):
    denominator = jax.device_count()
    run = {"name": name, "changes": changes, **run,
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

  for placement in filter(None, args.placements.split(",")):
    record(placement, time_training(args, placement), [])
  spec = train.make_setup(config_lib.get_config(_config_string(args, "pre"))).spec
  vocab = PADDED_GPT2_VOCAB if spec.vocab_size == 50257 else None
  changes = ["fused causal attention", "bf16 LM head"] + ([f"vocab {vocab}"] if vocab else [])
  proposals = list(filter(None, args.proposals.split(",")))

  def run_probes():
    result["probes"]["attention"] = probe_attention(args, spec.num_heads, spec.head_dim)
    result["probes"]["head"] = probe_head(args, spec.d_model)
    print(json.dumps(result["probes"]), flush=True)

  # The first proposal run comes before the probes: alone it says whether the target is in reach.
  for index, placement in enumerate(proposals):
    if index == 1 and in_budget():
      run_probes()
    if not in_budget():
      print(f"budget spent: skipping proposal run for {placement}", flush=True)
      continue
    try:
      with proposed_model_changes(attention=True, bf16_head=True):
        record(f"{placement}+proposed", time_training(args, placement, vocab), changes)
    except Exception as e:  # e.g. no cuDNN attention kernel: keep the baselines and probes
      result["probes"][f"{placement}+proposed_error"] = f"{type(e).__name__}: {e}"[:500]
      print(result["probes"][f"{placement}+proposed_error"], flush=True)
  if len(proposals) < 2 and in_budget():
    run_probes()
  # Last: if the kernel lowering does not cure the slow compile, only this probe is lost.
  if args.probe_device_init and in_budget():
    result["probes"]["device_init_threefry_kernel"] = probe_device_init(args, "pre")
    print(json.dumps(result["probes"]["device_init_threefry_kernel"]), flush=True)
  result["total_s"] = time.perf_counter() - started
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\n{device.device_kind}: matmul {matmul['flops_per_s'] / 1e12:.0f} TFLOP/s measured, "
        f"{table_peak / 1e12:.0f} datasheet; batch {args.batch_size} x {args.seq_len}")
  print(f"{'run':<32} {'tokens/s':>12} {'step_ms':>8} {'MFU(ds)':>8} {'MFU(ms)':>8} "
        f"{'compile':>8} {'loss':>7}")
  print("\n".join(_summary_rows(result)))
  print(json.dumps(result["probes"], indent=1))
  print(f"wrote {path} in {result['total_s']:.0f}s")


if __name__ == "__main__":
  main()
