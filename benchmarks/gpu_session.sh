#!/usr/bin/env bash
# bench_accelerator.py on a GPU machine that cannot reach a package index.
#
#   bash benchmarks/gpu_session.sh prepare DEST      # here, with network: DEST gets this
#                                                     # commit's files and wheels/ (Python 3.12)
#   cd DEST && bash benchmarks/gpu_session.sh run OUT_DIR [bench_accelerator.py flags]
#                                                     # (PYTHON=... picks the interpreter)
#                                                     # there: installs wheels/ into a scratch
#                                                     # site, prints the GPU, runs the benchmark
#
# The GPU machine keeps its own jax/jaxlib (and CUDA plugin); the wheels bring the rest of the
# stack. flax 0.12.8 fails to import under jax >= 0.11 (jax.experimental.hijax lost
# HiPrimitive), so the wheels carry flax 0.12.12, the first pinned-stack flax known to run there.
set -euo pipefail

WHEELS=(flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 grain==0.2.18 array_record==0.8.6
        ml_collections==1.1.0 portpicker==1.6.0 tensorboardX==2.6.5 tensorstore==0.1.86
        treescope==0.1.10)

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
    py="${PYTHON:-python3}"
    site="$(mktemp -d)"
    mkdir -p "$out"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" wheels/*.whl
    export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi || true
    "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
    "$py" benchmarks/bench_accelerator.py --out_dir="$out" "$@" 2>&1 | tee "$out/bench_log.txt"
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
