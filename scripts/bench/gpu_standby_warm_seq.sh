#!/usr/bin/env bash
# A GPU sequence for scripts/bench/gpu_recovery_all.sh (SEQ=scripts/bench/gpu_standby_warm_seq.sh): what the
# standby's kernel warm-up (agent/workers/kernel_warm.py) changes, side by side in one invocation.
#   w    scripts/bench/gpu_standby_warm.py: cold / warm / eager standby processes, the script's top and first steps
#   c1   hyperpodrun --inprocess-restart --standby-workers 1 (kernel warm-up on: the default), and the calibration
#   c1n  the same with HYPERPODRUN_STANDBY_KERNEL_WARM=0, c1's calibration (C1N=0 skips it)
#   c2   torchrun + torch.save checkpoints, c1's calibration (C2=0 skips it)
# KINDS (default kill), FAULTS_HPR and FAULTS as in gpu_recovery_fast_seq.sh; INTERVAL: steps between faults (8).
set -uo pipefail
OUT="$W/env"
source scripts/bench/gpu_env.sh
common=(--gpu --interval "${INTERVAL:-8}" --warmup 10 --kinds "${KINDS:-kill}")
stage() { echo "== $1 $(date +%T)"; shift; "$@"; echo "== rc=$? $(date +%T)"; }
mkdir -p "$W/w"
[ "${WARM_ROUNDS:-3}" -gt 0 ] && stage w timeout "${WARM_S:-400}" python3 scripts/bench/gpu_standby_warm.py --out "$W/w" --rounds "${WARM_ROUNDS:-3}" --variants "${WARM_VARIANTS:-cold,warm,eager}"
stage c1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
cal=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['meta']; print(f\"{m['step_s']},{m['save_s']}\")" \
      "$W/c1/recovery.json") || cal=""
if [ -n "$cal" ]; then
  echo "calibrated: $cal"
  [ "${C1N:-1}" = 1 ] && stage c1n env HYPERPODRUN_STANDBY_KERNEL_WARM=0 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1n" \
    --systems hpr-inprocess --faults "$FAULTS_HPR" --calibrated "$cal"
  [ "${C2:-1}" = 1 ] && stage c2 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c2" --systems torchrun --faults "$FAULTS" \
    --calibrated "$cal"
  parts=$(for c in c1 c2; do [ -e "$W/$c/recovery.json" ] && printf '%s,' "$W/$c"; done)
  stage merged python3 scripts/bench/recovery.py --merge "${parts%,}" --out "$W/merged"
fi
echo "sequence done $(date +%T)"
touch "$W/done"
