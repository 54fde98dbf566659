#!/usr/bin/env bash
# Lightning + CheckpointlessCallback on 2 GPUs (DDP over NCCL): recovery after a SIGKILL of one rank
# mid-epoch, against the fault-free run (scripts/bench/lightning_recovery.py). Run from the repository root
# where torch with CUDA and lightning are installed; wheels the machine lacks (pyzmq, pydantic) may be given
# in ./.whl. Results go to ${OUT:-bench-out}/lightning-gpu.json; about 3 minutes.
set -uo pipefail
source scripts/bench/gpu_env.sh
timeout 400 python3 scripts/bench/lightning_recovery.py --accel gpu --nproc 2 --steps 40 --kill-step 21 \
  --width 4096 --depth 4 --runs "${RUNS:-3}" --out "$OUT/lightning-gpu.json"
echo "== lightning exit $?"
