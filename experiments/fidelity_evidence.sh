#!/usr/bin/env bash
# The fidelity evidence in one go: every placement on tinyshakespeare (3 seeds, 500 steps),
# the tied/untied sweep (150 steps, lr 1e-3, 3 seeds) and the stream probe over its runs.
#   JOBS=12 bash experiments/fidelity_evidence.sh      # e.g. on one GPU, 12 processes at once
# On a GPU, processes share the chip: no preallocation, and float32 matmuls in full float32
# (TF32 would make the numbers differ from a CPU run's).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-1}
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
python experiments/shakespeare.py --jobs="$JOBS" "$@"
python experiments/placement_sweep.py --lrs=1e-3 --jobs="$JOBS"
python experiments/stream_probe.py --report_only
