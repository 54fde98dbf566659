#!/usr/bin/env bash
# GPU health benchmark (issue 6) on a machine with 2 GPUs: the NVML monitor against the real devices, its CPU
# cost, and injected XIDs in NCCL jobs (see scripts/bench/gpu_health.py). Run from the repository root where torch
# with CUDA and nvidia-ml-py are installed; wheels the machine lacks (pyzmq, pydantic) may be given in ./.whl.
# Results go to ${OUT:-bench-out}/gpu_health.{json,md}; about 2-3 minutes.
set -uo pipefail
source scripts/bench/gpu_env.sh
timeout 230 python3 scripts/bench/gpu_health.py "$OUT"
echo "== gpu_health exit $?"
