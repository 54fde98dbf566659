#!/usr/bin/env bash
# A shorter GPU sequence for scripts/bench/gpu_recovery_all.sh (SEQ=scripts/bench/gpu_recovery_fast_seq.sh):
# the restart phases in isolation, then hyperpodrun in-process (exception and SIGKILL, FAULTS_HPR each) and
# torchrun + torch.save checkpoints (FAULTS each) on the same script and schedule, merged into one report.
#   p   scripts/bench/gpu_restart_phases.py: NCCL abort variants, restore copy paths, gc
#   c1  hyperpodrun --inprocess-restart --standby-workers 1, and the calibration job
#   c1i (INLINE_FAULTS > 0) hyperpodrun in-process with HYPERPODRUN_NCCL_ABORT_BACKGROUND=0 (the NCCL abort in
#       the restarting thread: the fallback), exceptions only
#   c2  torchrun, c1's calibration
# PHASES=0 skips p.
set -uo pipefail
OUT="$W/env"
source scripts/bench/gpu_env.sh
common=(--gpu --interval 8 --warmup 10 --kinds "${KINDS:-raise,kill}")
stage() { echo "== $1 $(date +%T)"; shift; "$@"; echo "== rc=$? $(date +%T)"; }
mkdir -p "$W/p"
[ "${PHASES:-1}" = 0 ] || stage p timeout "${PHASES_S:-240}" python3 scripts/bench/gpu_restart_phases.py --reps "${PHASE_REPS:-3}" --out "$W/p/phases.json"
stage c1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
cal=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['meta']; print(f\"{m['step_s']},{m['save_s']}\")" \
      "$W/c1/recovery.json") || cal=""
if [ -n "$cal" ]; then
  echo "calibrated: $cal"
  if [ "${INLINE_FAULTS:-0}" -gt 0 ]; then
    stage c1i env HYPERPODRUN_NCCL_ABORT_BACKGROUND=0 python3 scripts/bench/recovery.py --gpu --interval 8 --warmup 10 \
      --kinds raise --out "$W/c1i" --systems hpr-inprocess --faults "$INLINE_FAULTS" --calibrated "$cal"
  fi
  stage c2 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c2" --systems torchrun --faults "$FAULTS" \
    --calibrated "$cal"
  parts=$(for c in c1 c2; do [ -e "$W/$c/recovery.json" ] && printf '%s,' "$W/$c"; done)
  stage merged python3 scripts/bench/recovery.py --merge "${parts%,}" --out "$W/merged"
fi
echo "sequence done $(date +%T)"
touch "$W/done"
