#!/usr/bin/env bash
# What an in-process restart prints on a GPU host besides the job's own lines: the same small job (one rank,
# NCCL, 3 exceptions) run twice under hyperpodrun --inprocess-restart, with the environment as it is and with
# the extra variables given in NOISE_ENV; the console of each goes to $OUT/noise-<n>.log and the count of each
# known noise pattern is printed. Run from the repository root on the GPU machine:
#   OUT=bench-out NOISE_ENV="TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_ENABLE_MONITORING=0" bash scripts/bench/gpu_restart_noise.sh
set -uo pipefail
source scripts/bench/gpu_env.sh
patterns=("recvValue failed" "should dump" "c10::Error" "Exception raised from" "Traceback" "NCCL WARN")
run() {   # run NAME [VAR=VALUE ...]
  local name=$1; shift
  local out; out=$(mktemp -d)
  env "$@" SYSTEM=hpr-inprocess DEVICE=cuda DIM=2048 LAYERS=4 BATCH=1024 STEPS=24 STEP_SLEEP=0 CKPT_EVERY=1000 \
    FAULT_KIND=raise FAULT_STEPS=4,9,14 FAULT_RANKS=0 OUT_DIR="$out" \
    timeout 240 hyperpodrun --nproc-per-node 1 --inprocess-restart --standby-workers 1 \
      --log-dir "$out/logs" scripts/bench/recovery_worker.py > "$OUT/noise-$name.log" 2>&1
  echo "== $name (rc=$?): $(wc -l < "$OUT/noise-$name.log") console lines, $(cat "$out"/steps.rank0.jsonl 2>/dev/null | wc -l) steps"
  for p in "${patterns[@]}"; do printf '  %-24s %s\n' "$p" "$(grep -c -- "$p" "$OUT/noise-$name.log")"; done
  rm -rf "$out"
}
run default
# shellcheck disable=SC2086
run with-env ${NOISE_ENV:-}
