#!/usr/bin/env bash
# The side-by-side recovery benchmark on the GPU machine (scripts/bench/recovery.py --gpu: NCCL, one rank per
# GPU, a 1.07B-parameter bf16 MLP with Adam), in one command. Carry .whl (scripts/bench/gpu_env.sh): pyzmq and
# pydantic, and for the NVRx rows nvidia-resiliency-ext (0.7.0, --no-deps) with httpx and defusedxml.
#   OUT=bench-out bash scripts/bench/gpu_recovery.sh [recovery.py flags, e.g. --kinds kill,raise]
# Without matplotlib there, draw the picture here afterwards: python scripts/bench/recovery.py --redraw --out DIR
set -euo pipefail
source scripts/bench/gpu_env.sh
python3 scripts/bench/recovery.py --gpu --out "$OUT" "$@"
