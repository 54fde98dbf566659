#!/usr/bin/env bash
# The GPU part of the in-process restart benchmark (2 GPUs, NCCL), run from the repository root on a machine
# where torch with CUDA is installed. Wheels the machine lacks (pyzmq, pydantic) may be given in ./.whl.
# Results (JSON + markdown) go to ${OUT:-bench-out}.
set -uo pipefail
OUT="${OUT:-bench-out}"
mkdir -p "$OUT" /tmp/bin
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
printf '#!/bin/sh\nexec %s -m hyperpodrun "$@"\n' "$(command -v python3)" > /tmp/bin/hyperpodrun
chmod +x /tmp/bin/hyperpodrun
export PATH="/tmp/bin:$PATH" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  lscpu | grep 'Model name'; } | tee "$OUT/machine.txt"
for sync in ${SYNC_MODES:-item poll}; do
  timeout "${MODE_TIMEOUT:-280}" python3 scripts/bench/inprocess_bench.py --backend nccl --nproc-per-node 2 \
    --dim 4096 --layers 6 --batch 1024 --fault-buf-mb 256 --sync "$sync" \
    --faults "${FAULTS:-10}" --baseline-faults "${BASELINE_FAULTS:-5}" ${EXTRA:-} \
    --out "$OUT/gpu-$sync.json" --md "$OUT/gpu-$sync.md" 2>&1 | tail -60
  echo "== sync=$sync exit ${PIPESTATUS[0]}"
done
