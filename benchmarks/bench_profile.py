"""Where a train step's time goes, ours against the PyTorch yardstick, on one core.

bench_train times the two steps (tiny and 10m models); this says what the difference is made of. On one core every
operation runs alone, so the profilers' operation times add up to the step (the file keeps
both sums next to the step times as a check) and sort into four groups:

  linear matmuls   ours: the 2-D dots (projections, MLP, head, their gradients);
                   torch: aten::mm and aten::addmm
  attention core   ours: every operation on a rank >= 4 array (heads split out: scores, mask,
                   softmax, probabilities x values, their gradients and layout copies);
                   torch: its fused scaled_dot_product_attention forward and backward
  MLP activation   ours: the other operations on the 4d-wide MLP hidden (GELU and its
                   gradient); torch: aten::gelu and aten::gelu_backward
  everything else  norms, residuals, embeddings, loss, AdamW, clipping, copies

  python benchmarks/bench_profile.py [--models=tiny,10m]

(about 4 minutes; writes results/bench/profile.json)
"""
import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import statistics
import tempfile

if __name__ == "__main__":  # one core, before JAX and torch size their thread pools
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import jax  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_train  # noqa: E402

OUTPUT = bench_train.REPO_ROOT / "results" / "bench" / "profile.json"
STEPS = 5
GROUPS = ("linear matmuls", "attention core", "MLP activation", "everything else")


def _hlo_instructions(hlo_text):
  """{instruction name: (dims of its result, whether it is or calls a dot)} of compiled HLO."""
  bodies = dict(re.findall(r"^%([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo_text, re.M | re.S))
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
    if m:
      called = re.search(r"calls=%([\w.\-]+)", line)
      is_dot = m.group(3) == "dot" or bool(called and " dot(" in bodies.get(called.group(1), ""))
      out[m.group(1)] = (tuple(int(x) for x in m.group(2).split(",") if x), is_dot)
  return out


def _jax_group(dims, is_dot, hidden):
  if len(dims) >= 4:
    return "attention core"
  if is_dot:
    return "linear matmuls"
  if dims and dims[-1] == hidden:
    return "MLP activation"
  return "everything else"


def profile_ours(stepper, config, batches):
  batch = bench_train.train.global_batch(stepper.setup, {"tokens": batches[0]})
  instructions = _hlo_instructions(stepper.step_fn.lower(stepper.state, batch).compile()
                                   .as_text())
  hidden = 4 * config.model.d_model
  step_ms = _median_step_ms(stepper, batches)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      _run_profiled_steps(stepper, batches)
    trace = next(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(trace))["traceEvents"]
  groups = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e["name"] in instructions:
      groups[_jax_group(*instructions[e["name"]], hidden)] += e["dur"] / 1e3 / STEPS
  return step_ms, groups


def profile_torch(config, spec, batches):
  step, _ = bench_train.torch_stepper(config, spec)
  step_ms = _median_step_ms(step, batches)
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    _run_profiled_steps(step, batches)
  groups = collections.Counter()
  for e in prof.key_averages():
    if e.key in ("aten::mm", "aten::addmm"):
      group = "linear matmuls"
    elif "scaled_dot_product" in e.key:
      group = "attention core"
    elif e.key in ("aten::gelu", "aten::gelu_backward"):
      group = "MLP activation"
    else:
      group = "everything else"
    groups[group] += e.self_cpu_time_total / 1e3 / STEPS
  return step_ms, groups


def _median_step_ms(step, batches):
  """Milliseconds per step, the median of 5 rounds of 2 steps (after one warm-up step)."""
  return 1e3 * statistics.median(bench_train.timed_rounds({"step": step}, batches, 5, 2)["step"])


def _run_profiled_steps(step, batches):
  for i in range(STEPS):
    bench_train._finish(step(batches[i % len(batches)]))


def profile_model(model):
  config = bench_train.make_config(model)
  batches = bench_train.make_batches(config)
  stepper = bench_train.JaxStepper(config)
  ours_ms, ours = profile_ours(stepper, config, batches)
  torch_ms, theirs = profile_torch(config, stepper.setup.spec, batches)
  out = {
      "config": bench_train.MODELS[model] or "tiny preset",
      "step_ms": {"ours": ours_ms, "torch": torch_ms},
      "profiled_ms": {"ours": sum(ours.values()), "torch": sum(theirs.values())},
      "groups_ms": {g: {"ours": ours[g], "torch": theirs[g]} for g in GROUPS},
      # A 1.25x PyTorch's tokens/s is this step time.
      "target_step_ms": torch_ms / bench_train.TARGET_RATIO,
  }
  print(model, json.dumps(out), flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="tiny,10m")
  args = parser.parse_args()
  os.chdir(bench_train.REPO_ROOT)
  torch.set_num_threads(1)
  result = {"date": bench_train._now(), "cpu_cores_used": 1, "steps_profiled": STEPS,
            "placement": "pre", "dtype": "float32", "jax": jax.__version__,
            "torch": torch.__version__, "loadavg_before": os.getloadavg()}
  result["models"] = {model: profile_model(model) for model in args.models.split(",")}
  result["loadavg_after"] = os.getloadavg()
  OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
  print("wrote", OUTPUT)


if __name__ == "__main__":
  main()
