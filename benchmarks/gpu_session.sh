#!/usr/bin/env bash
# bench_accelerator.py on a GPU machine that cannot reach a package index.
#
#   bash benchmarks/gpu_session.sh prepare DEST      # here, with network: DEST gets this
#                                                     # commit's files and wheels/ (Python 3.12)
#   cd DEST && bash benchmarks/gpu_session.sh run OUT_DIR [bench_accelerator.py flags]
#                                                     # (PYTHON=... picks the interpreter)
#                                                     # there: installs wheels/ into a scratch
#                                                     # site, prints the GPU, runs the benchmark
#   bash benchmarks/gpu_session.sh claims OUT_DIR SECONDS 'EXPERIMENT FLAGS' ...
#                                                     # there: claim experiments side by side,
#                                                     # each stopped after SECONDS, their
#                                                     # finished runs collected (--report_only)
#                                                     # and results/<claim>/ packed into OUT_DIR
#
# The GPU machine keeps its own jax/jaxlib (and CUDA plugin); the wheels bring the rest of the
# stack. flax 0.12.8 fails to import under jax >= 0.11 (jax.experimental.hijax lost
# HiPrimitive), so the wheels carry flax 0.12.12, the first pinned-stack flax known to run there.
set -euo pipefail

WHEELS=(flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 grain==0.2.18 array_record==0.8.6
        ml_collections==1.1.0 portpicker==1.6.0 tensorboardX==2.6.5 tensorstore==0.1.86
        treescope==0.1.10)

install_wheels() {  # wheels/ (or .whl/, the device tool's carried folder) into a scratch site
  local site
  site="$(mktemp -d)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      $(ls wheels/*.whl 2>/dev/null || ls .whl/*.whl)
  export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
}

py="${PYTHON:-python3}"
case "${1:-}" in
  prepare)
    dest="${2:?usage: prepare DEST}"
    mkdir -p "$dest/wheels"
    git archive HEAD | tar -x -C "$dest"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest/wheels" \
        "${WHEELS[@]}"
    du -sh "$dest"
    ;;
  run)
    out="${2:?usage: run OUT_DIR [flags]}"
    shift 2
    mkdir -p "$out"
    install_wheels
    nvidia-smi || true
    "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    "$py" benchmarks/bench_accelerator.py --out_dir="$out" "$@" 2>&1 | tee "$out/bench_log.txt"
    ;;
  claims)
    out="${2:?usage: claims OUT_DIR SECONDS 'EXPERIMENT FLAGS' ...}"
    seconds="${3:?usage: claims OUT_DIR SECONDS 'EXPERIMENT FLAGS' ...}"
    shift 3
    mkdir -p "$out"
    install_wheels
    # Many small runs share the one GPU: each process takes memory as it needs it, and float32
    # matmuls stay float32 (no TF32), as on the CPU where the judge scale's LRs were tuned.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
    "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    pids=()
    for command in "$@"; do
      name="$(basename "${command%% *}" .py)"
      # timeout leads a process group of its own (the experiment and the runs it starts) and
      # signals the whole group, so the runs stop with their checkpoints written.
      timeout -s INT "$seconds" "$py" $command >"$out/$name.log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}" || true
    sleep 5
    for pid in "${pids[@]}"; do  # any run of that group still going; nothing else on the machine
      kill -- "-$pid" 2>/dev/null || true
    done
    folders=()
    for command in "$@"; do
      name="$(basename "${command%% *}" .py)"
      "$py" $command --report_only >>"$out/$name.log" 2>&1 || true
      folders+=("results/$name")
    done
    find runs/claims -name train.log | tar -czf "$out/claims_results.tar.gz" "${folders[@]}" -T -
    ls -la "$out"
    ;;
  *)
    sed -n '2,18p' "$0"
    exit 2
    ;;
esac
