#!/usr/bin/env bash
# The stages of scripts/bench/gpu_recovery_all.sh (run by it, in its own session); W is the work folder.
set -uo pipefail
OUT="$W/env"
source scripts/bench/gpu_env.sh
common=(--gpu --interval 8 --warmup 10)
stage() { echo "== $1 $(date +%T)"; shift; python3 scripts/bench/recovery.py "$@"; echo "== rc=$? $(date +%T)"; }
stage c1 "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
cal=$(python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['meta']; print(f\"{m['step_s']},{m['save_s']}\")" \
      "$W/c1/recovery.json") || cal=""
if [ -n "$cal" ]; then
  echo "calibrated: $cal"
  stage c2 "${common[@]}" --out "$W/c2" --systems torchrun,hpr-process --faults "$FAULTS" --calibrated "$cal"
  stage c3 "${common[@]}" --out "$W/c3" --systems nvrx --faults "$FAULTS" --calibrated "$cal"
  parts=$(for c in c1 c2 c3; do [ -e "$W/$c/recovery.json" ] && printf '%s,' "$W/$c"; done)
  stage merged --merge "${parts%,}" --out "$W/merged"
fi
echo "sequence done $(date +%T)"
touch "$W/done"
