#!/usr/bin/env bash
# The GPU part of the in-process restart benchmark (2 GPUs, NCCL), run from the repository root on a machine
# where torch with CUDA is installed. Wheels the machine lacks (pyzmq, pydantic) may be given in ./.whl.
# Results (JSON + markdown) go to ${OUT:-bench-out}.
set -uo pipefail
source scripts/bench/gpu_env.sh
for sync in ${SYNC_MODES:-item poll}; do
  timeout "${MODE_TIMEOUT:-280}" python3 scripts/bench/inprocess_bench.py --backend nccl --nproc-per-node 2 \
    --dim 4096 --layers 6 --batch 1024 --fault-buf-mb 256 --sync "$sync" \
    --faults "${FAULTS:-10}" --baseline-faults "${BASELINE_FAULTS:-5}" ${EXTRA:-} \
    --out "$OUT/gpu-$sync.json" --md "$OUT/gpu-$sync.md" 2>&1 | tail -60
  echo "== sync=$sync exit ${PIPESTATUS[0]}"
done
