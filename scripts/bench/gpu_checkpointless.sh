#!/usr/bin/env bash
# Checkpointless state on 2 GPUs: step-time overhead of per-step snapshots (none / sync / offload) for a
# >= 1B-parameter model with AdamW under DDP and FSDP2, the snapshot copy time, peak memory, and the time
# to restore after a SIGKILL. Run from the repository root; results go to ${OUT:-bench-out}/ckpt-*.
set -uo pipefail
source scripts/bench/gpu_env.sh
W=scripts/bench/ckpt_gpu_worker.py
for s in ${STRATEGIES:-ddp fsdp2}; do
  rm -rf /dev/shm/hyperpodrun-$(id -u)
  timeout "${MEASURE_TIMEOUT:-240}" hyperpodrun --nproc-per-node 2 --log-dir "$OUT/logs" --rdzv-id "ckpt-$s" \
    $W --strategy "$s" --measure --out "$OUT/ckpt-$s.json" ${EXTRA:-} 2>&1 | tail -5
  echo "== $s exit ${PIPESTATUS[0]}"
done
rm -rf /dev/shm/hyperpodrun-$(id -u)
timeout "${RESTORE_TIMEOUT:-240}" hyperpodrun --nproc-per-node 2 --inprocess-restart --log-dir "$OUT/logs" \
  --rdzv-id ckpt-restore $W --strategy fsdp2 --fault-step 6 --out "$OUT/ckpt-restore.jsonl" ${EXTRA:-} 2>&1 | tail -12
echo "== restore exit ${PIPESTATUS[0]}"
rm -rf /dev/shm/hyperpodrun-$(id -u)
python3 scripts/bench/ckpt_summary.py "$OUT"
