"""How much memory does training take? Per device for every paper size, on the host for small runs.

Device memory: the train step (train.make_train_step: forward, backward, AdamW update, state
donated) of every size in config.SIZES but `tiny`, lowered on abstract arrays and compiled
for fake CPU devices (`jax_num_cpu_devices`, one subprocess per device count, since the
count is fixed before JAX starts), read from `compiled.memory_analysis()`: nothing is
allocated. Meshes of 8, 64 and 256 devices, pure FSDP (`mesh.fsdp=N`) and FSDP x tensor
(`mesh.tensor=4`, `mesh.fsdp=N/4`). Each size at its paper context (SEQ_LEN) and 8,192
tokens per data-parallel replica (8 x 1024 for GPT-2, 4 x 2048, 2 x 4096, 1 x 8192), float32
parameters and compute (the config default). Per device:

  params      bytes of the parameter shards this device holds
  arguments   params + AdamW state + the batch (the donated input)
  temporaries XLA's temporary buffers (activations, gradients, collectives)
  total       arguments + outputs - aliased (outputs written into the donated input) + temps

Compiling billions of parameters for 256 devices takes too long on a small CPU, so each
(size, mesh) is compiled at LAYERS (1 and 2 blocks) and extrapolated linearly in the number
of blocks to the full depth; `--check_linearity` compiles a few at full or larger depth to
measure how far the extrapolation is off, written next to the table (`--part=linearity`
reruns only those).

Host memory: peak resident memory (ru_maxrss, from os.wait4 on the child) of whole training
runs in subprocesses: configs/shakespeare.py for 50 steps, and a 10M model (6 layers, d=384,
6 heads, batch 16 x 256) for 10 steps.

Largest model of the tiny family (4k layers, d=128k, 4k heads, batch 16 x 128) whose train
step fits 24 GiB on one device (less ~1 GiB for the runtime), with and without model.remat,
from the same compiled memory analysis on one CPU device, extrapolated from 1 and 2 blocks.

Loss chunks: the same device measurement (8 devices, FSDP) of a model with a large vocabulary at
model.loss_chunks = 1, 4, 16 (losses.chunked_loss_terms: the head and cross-entropy in
sequence slices, each remade in the backward pass), to show what the B x L x V logits cost.

  python benchmarks/bench_memory.py               # everything (an hour or more on 2 cores)
  python benchmarks/bench_memory.py --part=device --devices=8

Writes results/bench/memory.json and results/bench/memory.md (parts not rerun are kept).
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "results" / "bench"

PAPER_SIZES = ("gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1.5b", "geonorm_125m",
               "geonorm_1.3b", "llama2_1b", "llama2_7b", "llama3_8b")
SEQ_LEN = {"gpt2": 1024, "geonorm": 2048, "llama2": 4096, "llama3": 8192}
TOKENS_PER_REPLICA = 8192
DEVICE_COUNTS = (8, 64, 256)
TENSOR = 4
LAYERS = (1, 2)
GIB = 2**30
FITS_GIB = (16, 95)
HOST_LIMIT_GIB = 24
# Only LLVM's effort: the HLO passes, fusion and buffer assignment that memory_analysis
# reports are unchanged (same bytes as the default options, checked on gpt2_124m), and the
# compile is faster.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
FIELDS = ("params", "arguments", "outputs", "aliased", "temporaries", "total")


def seq_len(size):
  return SEQ_LEN[size.split("_")[0]]


def mesh_axes(kind, num_devices):
  """(data, fsdp, tensor) of a mesh kind."""
  if kind == "fsdp":
    return 1, num_devices, 1
  if kind == "fsdp_tensor":
    return 1, num_devices // TENSOR, TENSOR
  raise ValueError(f"mesh kind {kind!r}: choose fsdp or fsdp_tensor")


def config_for(size, kind, num_devices, num_layers=None, seq=None, extra="",
               tokens_per_replica=TOKENS_PER_REPLICA):
  from geonorm_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  data, fsdp, tensor = mesh_axes(kind, num_devices)
  seq = seq or seq_len(size)
  per_replica = max(1, tokens_per_replica // seq)
  items = [size, f"mesh.data={data},mesh.fsdp={fsdp},mesh.tensor={tensor}",
           f"data.seq_len={seq},data.batch_size={per_replica * data * fsdp}",
           "train.progress_bar=false"]
  if num_layers:
    items.append(f"num_layers={num_layers}")
  if extra:
    items.append(extra)
  return config_lib.get_config(",".join(items))


def step_memory(config, num_devices):
  """Per-device bytes of the compiled train step of `config` on the first num_devices."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  setup = train.make_setup(config, devices=jax.devices()[:num_devices])
  abstract = train.sharded_abstract_state(setup)
  tokens = jax.ShapeDtypeStruct((config.train.grad_accum, config.data.batch_size,
                                 config.data.seq_len + 1), jnp.int32,
                                sharding=setup.batch_sharding)
  started = time.perf_counter()
  lowered = train.make_train_step(setup).lower(abstract, tokens)
  compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
  compile_s = time.perf_counter() - started
  memory = compiled.memory_analysis()
  shard_bytes = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  row = {
      "num_params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(abstract["params"]))),
      "params": int(sum(shard_bytes(x) for x in jax.tree.leaves(abstract["params"]))),
      "arguments": int(memory.argument_size_in_bytes),
      "outputs": int(memory.output_size_in_bytes),
      "aliased": int(memory.alias_size_in_bytes),
      "temporaries": int(memory.temp_size_in_bytes),
      "compile_s": compile_s,
      "seq_len": int(config.data.seq_len),
      "batch_per_replica": int(config.data.batch_size) // (config.mesh.data * config.mesh.fsdp),
  }
  row["total"] = row["arguments"] + row["outputs"] - row["aliased"] + row["temporaries"]
  return row


def extrapolate(at_layers, full_layers):
  """Linear in the number of blocks, from two compiled depths {layers: row}."""
  (l1, r1), (l2, r2) = sorted(at_layers.items())
  out = {}
  for field in FIELDS + ("num_params",):
    per_layer = (r2[field] - r1[field]) / (l2 - l1)
    out[field] = r1[field] + per_layer * (full_layers - l1)
  return out


def device_jobs(num_devices, sizes, kinds):
  return [{"size": s, "kind": k, "num_devices": num_devices, "num_layers": l}
          for s in sizes for k in kinds for l in LAYERS]


def run_worker(num_devices, jobs_json):
  """In a fresh process: fake devices, then one JSON line per job (a row or its error)."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", num_devices)
  for job in json.loads(jobs_json):
    try:
      config = config_for(job["size"], job["kind"], job["num_devices"], job.get("num_layers"),
                          extra=job.get("extra", ""))
      result = {**job, **step_memory(config, job["num_devices"])}
    except Exception as error:  # pylint: disable=broad-except
      result = {**job, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    print(json.dumps(result), flush=True)


def in_subprocess(num_devices, jobs, log):
  command = [sys.executable, __file__, "--worker", str(num_devices), "--jobs", json.dumps(jobs)]
  env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
  process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT, text=True)
  rows = []
  for line in process.stdout:
    row = json.loads(line)
    rows.append(row)
    log(row)
  process.wait()
  return rows


def full_depth(size):
  from geonorm_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  return int(config_lib.get_config(size).model.num_layers)


def table_rows(compiled_rows):
  """One row per (size, mesh): extrapolated to full depth, or the error."""
  grouped = {}
  for row in compiled_rows:
    grouped.setdefault((row["size"], row["kind"], row["num_devices"]), []).append(row)
  out = []
  for (size, kind, num_devices), rows in grouped.items():
    errors = [r["error"] for r in rows if "error" in r]
    layers = full_depth(size)
    data, fsdp, tensor = mesh_axes(kind, num_devices)
    base = {"size": size, "kind": kind, "num_devices": num_devices,
            "mesh": {"data": data, "fsdp": fsdp, "tensor": tensor}, "num_layers": layers}
    if errors:
      out.append({**base, "error": errors[0]})
      continue
    base["seq_len"], base["batch_per_replica"] = rows[0]["seq_len"], rows[0]["batch_per_replica"]
    at_layers = {r["num_layers"]: r for r in rows}
    values = extrapolate(at_layers, layers) if len(at_layers) >= 2 else dict(rows[0])
    base["from_layers"] = sorted(at_layers)
    base.update({f: values[f] for f in FIELDS + ("num_params",)})
    base["fits"] = {f"{g}GiB": values["total"] <= g * GIB for g in FITS_GIB}
    out.append(base)
  return out


def host_runs():
  """Peak RSS of two short training runs, each in its own subprocess."""
  runs = {
      "shakespeare_50_steps": "configs/shakespeare.py:train.steps=50,train.eval_every=50,"
                              "checkpoint.every=50",
      "10m_10_steps": "configs/tiny.py:num_layers=6,d_model=384,num_heads=6,max_seq_len=256,"
                      "data.seq_len=256,data.batch_size=16,train.steps=10,train.warmup_steps=2,"
                      "train.eval_every=10,checkpoint.every=10",
  }
  out = {}
  for name, config in runs.items():
    with tempfile.TemporaryDirectory() as workdir:
      command = [sys.executable, "-m", "geonorm_jax", "train", f"--config={config}",
                 f"--workdir={workdir}", "--config.train.progress_bar=false"]
      started = time.perf_counter()
      process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
      _, status, usage = os.wait4(process.pid, 0)
      stderr = process.stderr.read().decode()[-500:]
    out[name] = {"command": " ".join(command[1:]), "exit_status": os.waitstatus_to_exitcode(status),
                 "peak_rss_bytes": usage.ru_maxrss * 1024, "wall_s": time.perf_counter() - started,
                 "num_params": _num_params(config)}
    if out[name]["exit_status"]:
      out[name]["stderr_tail"] = stderr
    print(name, out[name], flush=True)
  return out


def _num_params(config_arg):
  """Parameters of the model of a `configs/FILE.py:ARG` argument (abstract, nothing built)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  from geonorm_jax.nn import model as model_lib  # pylint: disable=g-import-not-at-top
  path, _, arg = config_arg.partition(":")
  spec = importlib.util.spec_from_file_location("config_file", REPO_ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  return model_lib.count_params(model_lib.abstract_params(config.model)[1])


def family_extra(k, remat, num_layers=None):
  return (f"num_layers={num_layers or 4 * k},d_model={128 * k},num_heads={4 * k},"
          f"remat={'true' if remat else 'false'}")


# What the Python process and XLA's runtime hold besides the step's buffers: the peak RSS of
# the tiny shakespeare run (host part) was 0.93 GiB, so the compiled total must leave ~1 GiB.
RUNTIME_ALLOWANCE_GIB = 1.0


def largest_tiny_family(limit_gib=HOST_LIMIT_GIB, max_k=24):
  """Largest scale k of the tiny family whose one-device train step fits limit_gib.

  Each k is compiled at 1 and 2 blocks (width 128k) and extrapolated to its 4k blocks, as
  the device table is (within 0.5% of full-depth compiles there): a full 40-block compile
  takes minutes on this CPU.
  """
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  budget = (limit_gib - RUNTIME_ALLOWANCE_GIB) * GIB
  out = {"limit_gib": limit_gib, "runtime_allowance_gib": RUNTIME_ALLOWANCE_GIB}
  for remat in (False, True):
    tried = {}

    def total(k):
      at_layers = {layers: step_memory(
          config_for("tiny", "fsdp", 1, seq=128, extra=family_extra(k, remat, layers),
                     tokens_per_replica=16 * 128), 1) for layers in LAYERS}
      tried[k] = extrapolate(at_layers, 4 * k)
      print("tiny family", k, "remat" if remat else "", tried[k]["total"] / GIB, flush=True)
      return tried[k]["total"]

    low, high = 1, max_k  # fits at low; search the largest k that fits
    if total(low) > budget:
      raise RuntimeError("the tiny model itself does not fit")
    while low < high:
      middle = (low + high + 1) // 2
      if total(middle) <= budget:
        low = middle
      else:
        high = middle - 1
    out["remat" if remat else "no_remat"] = {
        "k": low, "config": family_extra(low, remat), "num_params": int(tried[low]["num_params"]),
        "total_bytes": tried[low]["total"], "temporaries_bytes": tried[low]["temporaries"],
        "next_k_total_bytes": tried.get(low + 1, {}).get("total"),
        "tried": {str(k): v["total"] for k, v in sorted(tried.items())}}
  # Does remat shrink the step's buffers at all here? One block of the tiny model at 64 x 256
  # tokens, where the activations (not the parameters) fill the temporaries.
  out["remat_check"] = {
      "setting": "tiny, 1 block, batch 64 x 256",
      **{f"temporaries_bytes_{'remat' if remat else 'no_remat'}": step_memory(config_for(
          "tiny", "fsdp", 1, seq=256, extra=family_extra(1, remat, 1),
          tokens_per_replica=64 * 256), 1)["temporaries"] for remat in (False, True)}}
  return out


def gib(x):
  return f"{x / GIB:,.2f}"


def markdown(result):
  lines = ["# Memory", "", f"Written by `python benchmarks/bench_memory.py` on {result['date']} "
           f"(jax {result['jax']}).", ""]
  device = result.get("device")
  if device:
    lines += [
        "## Train step, per device (GiB)", "",
        "Compiled memory analysis of train.make_train_step on fake CPU devices (nothing "
        "allocated); float32 parameters and compute; AdamW; no remat. Each size at its paper "
        f"context with {TOKENS_PER_REPLICA:,} tokens per data-parallel replica (batch per "
        "replica x seq). Compiled at 1 and 2 blocks and extrapolated linearly to the full "
        "depth (see the linearity check below). fsdp_tensor: tensor=4. total = arguments + "
        "outputs - aliased + temporaries.", "",
        "| size | devices | mesh (data, fsdp, tensor) | batch x seq per replica | params/device | "
        "arguments | temporaries | total/device | fits 16 GiB | fits 95 GiB |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for row in device["table"]:
      mesh = f"{row['kind']} ({row['mesh']['data']}, {row['mesh']['fsdp']}, {row['mesh']['tensor']})"
      if "error" in row:
        lines.append(f"| {row['size']} | {row['num_devices']} | {mesh} | | "
                     f"not valid: {row['error'][:80]} | | | | | |")
        continue
      batch = f"{row['batch_per_replica']} x {row['seq_len']}"
      yes = lambda b: "yes" if b else "**no**"
      lines.append(f"| {row['size']} | {row['num_devices']} | {mesh} | {batch} | "
                   f"{gib(row['params'])} | {gib(row['arguments'])} | {gib(row['temporaries'])} | "
                   f"{gib(row['total'])} | {yes(row['fits']['16GiB'])} | {yes(row['fits']['95GiB'])} |")
    done = {(r["size"], r["kind"], r["num_devices"]) for r in device["table"]}
    missing = [f"{s} {k} {n}" for n in DEVICE_COUNTS for s in PAPER_SIZES
               for k in ("fsdp", "fsdp_tensor") if (s, k, n) not in done]
    if missing and done and all(r["size"] in PAPER_SIZES for r in device["table"]):
      lines += ["", f"Not compiled in this run: {', '.join(missing)}."]
    checks = device.get("linearity_checks") or []
    if checks:
      lines += ["", "Linearity check (compiled at the stated depth vs extrapolated from 1 and 2 "
                "blocks):", "", "| size | devices | mesh | depth | compiled total | "
                "extrapolated total | difference |", "|---|---|---|---|---|---|---|"]
      for check in checks:
        lines.append(f"| {check['size']} | {check['num_devices']} | {check['kind']} | "
                     f"{check['num_layers']} | {gib(check['compiled_total'])} | "
                     f"{gib(check['extrapolated_total'])} | {100 * check['relative_diff']:+.1f}% |")
  host = result.get("host")
  if host:
    lines += ["", "## Host memory", "", "| run | parameters | peak RSS (GiB) | wall (s) |",
              "|---|---|---|---|"]
    for name, run in host.items():
      lines.append(f"| {name} | {run['num_params'] or '?'} | {gib(run['peak_rss_bytes'])} | "
                   f"{run['wall_s']:.0f} |")
  family = result.get("tiny_family")
  if family:
    lines += ["", f"## Largest tiny-family model in {HOST_LIMIT_GIB} GiB (one device)", "",
              "Scale k: 4k layers, d_model 128k, 4k heads, batch 16 x 128, float32, AdamW; "
              "compiled memory analysis of the train step at 1 and 2 blocks, extrapolated to "
              f"4k blocks; fits when the total is under {HOST_LIMIT_GIB} GiB less "
              f"{family.get('runtime_allowance_gib', 0)} GiB for the Python/XLA runtime.", "",
              "| remat | k | config | parameters | total (GiB) | k+1 total (GiB) |",
              "|---|---|---|---|---|---|"]
    for name in ("no_remat", "remat"):
      row = family[name]
      nxt = gib(row["next_k_total_bytes"]) if row["next_k_total_bytes"] else "-"
      lines.append(f"| {name} | {row['k']} | `{row['config']}` | {row['num_params']:,} | "
                   f"{gib(row['total_bytes'])} | {nxt} |")
    check = family.get("remat_check")
    if check:
      lines += ["", f"remat and the compiled buffers ({check['setting']}): temporaries "
                f"{check['temporaries_bytes_no_remat'] / 2**20:,.1f} MiB without, "
                f"{check['temporaries_bytes_remat'] / 2**20:,.1f} MiB with remat: on the CPU "
                "backend remat buys no memory (why XLA's CPU schedule keeps the activations was not "
                "investigated; the device table above is compiled for CPU devices too)."]
  chunks = result.get("loss_chunks")
  if chunks:
    lines += ["", "## model.loss_chunks: the logits' share (GiB per device)", "",
              "As the device table (fsdp, float32, 1 and 2 blocks extrapolated), at "
              "model.loss_chunks = " + ", ".join(map(str, LOSS_CHUNKS)) + ".", "",
              "| size | devices | batch x seq per replica | loss_chunks | temporaries | "
              "total/device |", "|---|---|---|---|---|---|"]
    for row in chunks["table"]:
      if "error" in row:
        lines.append(f"| {row['size']} | {row['num_devices']} | | {row['loss_chunks']} | "
                     f"error: {row['error'][:80]} | |")
        continue
      lines.append(f"| {row['size']} | {row['num_devices']} | {row['batch_per_replica']} x "
                   f"{row['seq_len']} | {row['loss_chunks']} | {gib(row['temporaries'])} | "
                   f"{gib(row['total'])} |")
  hessian = result.get("hessian")
  if hessian:
    lines += ["", "## Hessian (Lanczos) per device", "", hessian]
  return "\n".join(lines) + "\n"


def load_previous():
  path = RESULTS / "memory.json"
  return json.loads(path.read_text()) if path.exists() else {}


def write(result):
  import jax  # pylint: disable=g-import-not-at-top
  result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
  result["jax"] = jax.__version__
  result["machine"] = {"platform": platform.platform(), "cpu_count": os.cpu_count()}
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "memory.json").write_text(json.dumps(result, indent=2))
  (RESULTS / "memory.md").write_text(markdown(result))


LOSS_CHUNKS = (1, 4, 16)


def loss_chunks_part(sizes, num_devices=8):
  """Per-device memory of each size at each model.loss_chunks, FSDP, full depth extrapolated."""
  jobs = [{"size": size, "kind": "fsdp", "num_devices": num_devices, "num_layers": layers,
           "extra": f"loss_chunks={chunks}", "loss_chunks": chunks}
          for size in sizes for chunks in LOSS_CHUNKS for layers in LAYERS]
  compiled = in_subprocess(num_devices, jobs, lambda r: print(json.dumps(r), flush=True))
  table = [{**row, "loss_chunks": chunks} for chunks in LOSS_CHUNKS
           for row in table_rows([r for r in compiled if r["loss_chunks"] == chunks])]
  table.sort(key=lambda row: (sizes.index(row["size"]), row["loss_chunks"]))
  return {"compiled": compiled, "table": table}


def linearity_checks(compiled_rows, checks):
  """Compile each check (size, kind, devices, depth) and compare with the extrapolation."""
  out = []
  for size, kind, num_devices, layers in checks:
    rows = [r for r in compiled_rows if (r["size"], r["kind"], r["num_devices"]) ==
            (size, kind, num_devices) and "error" not in r]
    if len(rows) < 2:
      continue
    measured = in_subprocess(num_devices, [{"size": size, "kind": kind, "num_devices": num_devices,
                                            "num_layers": layers}], print)[0]
    if "error" in measured:
      continue
    predicted = extrapolate({r["num_layers"]: r for r in rows}, layers)["total"]
    out.append({"size": size, "kind": kind, "num_devices": num_devices, "num_layers": layers,
                "compiled_total": measured["total"], "extrapolated_total": predicted,
                "relative_diff": predicted / measured["total"] - 1})
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", choices=("all", "device", "linearity", "host", "family",
                                         "loss_chunks"),
                      default="all")
  parser.add_argument("--devices", default=",".join(map(str, DEVICE_COUNTS)))
  parser.add_argument("--sizes", default=",".join(PAPER_SIZES))
  parser.add_argument("--kinds", default="fsdp,fsdp_tensor")
  parser.add_argument("--chunk_sizes", default="gpt2_124m,llama3_8b",
                      help="sizes of the loss_chunks part")
  parser.add_argument("--check_linearity", default="gpt2_124m:fsdp:8:12,llama2_7b:fsdp:8:4",
                      help="size:kind:devices:depth,... compiled at that depth to check "
                           "the extrapolation ('' for none)")
  parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--jobs", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    run_worker(args.worker, args.jobs)
    return
  result = load_previous()
  if args.part in ("all", "device"):
    rows = [r for r in result.get("device", {}).get("compiled", [])
            if str(r["num_devices"]) not in args.devices.split(",")]
    for num_devices in map(int, args.devices.split(",")):
      jobs = device_jobs(num_devices, args.sizes.split(","), args.kinds.split(","))
      rows += in_subprocess(num_devices, jobs, lambda r: print(json.dumps(r), flush=True))
      result["device"] = {"compiled": rows, "table": table_rows(rows),
                          "linearity_checks": result.get("device", {}).get("linearity_checks", [])}
      write(result)  # after every device count: a partial table survives an interruption
  if args.part in ("all", "linearity"):
    checks = [c.split(":") for c in filter(None, args.check_linearity.split(","))]
    result["device"]["linearity_checks"] = linearity_checks(
        result["device"]["compiled"], [(s, k, int(n), int(l)) for s, k, n, l in checks])
    write(result)
  if args.part in ("all", "host"):
    result["host"] = host_runs()
    write(result)
  if args.part in ("all", "family"):
    result["tiny_family"] = largest_tiny_family()
    write(result)
  if args.part in ("all", "loss_chunks"):
    result["loss_chunks"] = loss_chunks_part(args.chunk_sizes.split(","))
    write(result)


if __name__ == "__main__":
  main()
