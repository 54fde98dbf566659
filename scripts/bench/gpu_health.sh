#!/usr/bin/env bash
# GPU health benchmark (issue 6) on a machine with 2 GPUs: the NVML monitor against the real devices, its CPU
# cost, and injected XIDs in NCCL jobs (see scripts/bench/gpu_health.py). Run from the repository root where torch
# with CUDA and nvidia-ml-py are installed; wheels the machine lacks (pyzmq, pydantic) may be given in ./.whl.
# Results go to ${OUT:-bench-out}/gpu_health.{json,md}; about 2-3 minutes.
set -uo pipefail
OUT="${OUT:-bench-out}"
mkdir -p "$OUT" /tmp/bin
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! command -v hyperpodrun >/dev/null; then
  printf '#!/bin/sh\nexec %s -m hyperpodrun "$@"\n' "$(command -v python3)" > /tmp/bin/hyperpodrun
  chmod +x /tmp/bin/hyperpodrun
  export PATH="/tmp/bin:$PATH"
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/machine-gpu-health.txt"
timeout 230 python3 scripts/bench/gpu_health.py "$OUT"
echo "== gpu_health exit $?"
