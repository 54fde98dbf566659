#!/usr/bin/env bash
# A shorter GPU sequence for scripts/bench/gpu_recovery_all.sh (SEQ=scripts/bench/gpu_recovery_fast_seq.sh):
# the restart phases in isolation, then hyperpodrun in-process (exception and SIGKILL, FAULTS_HPR each) and
# torchrun + torch.save checkpoints (FAULTS each) on the same script and schedule, merged into one report.
#   p   scripts/bench/gpu_restart_phases.py: NCCL abort variants, restore copy paths, gc
#   c1  hyperpodrun --inprocess-restart --standby-workers 1, and the calibration job
#   c1i (INLINE_FAULTS > 0) hyperpodrun in-process with HYPERPODRUN_NCCL_ABORT_BACKGROUND=0 (the NCCL abort in
#       the restarting thread: the fallback), exceptions only
#   c1s (STAGED_RUN=1) c1 again with CheckpointManager(stage_on_device=True), c1's calibration
#   c2  torchrun, c1's calibration
# PHASES=0 skips p. Before them, where asked: OVERHEAD=1 the snapshot overhead (o,
# scripts/bench/gpu_snapshot_overhead.py, OVERHEAD_ARGS), STANDBY_MEM=1 a standby's memory (m,
# scripts/bench/gpu_standby_memory.py), TORCH_API=1 what this torch offers to shrink or revoke a group (t).
set -uo pipefail
OUT="$W/env"
source scripts/bench/gpu_env.sh
common=(--gpu --interval 8 --warmup 10 --kinds "${KINDS:-raise,kill}")
stage() { echo "== $1 $(date +%T)"; shift; "$@"; echo "== rc=$? $(date +%T)"; }
mkdir -p "$W/p" "$W/o" "$W/m" "$W/t"
[ "${TORCH_API:-0}" = 1 ] && stage t python3 -c "
import torch, torch.distributed as d, torch.distributed.distributed_c10d as c, torch._C._distributed_c10d as cc
print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())
print('shrink_group', hasattr(d, 'shrink_group'), [n for n in dir(c) if 'SHRINK' in n])
b = getattr(cc, 'ProcessGroupNCCL', None)
print('ProcessGroupNCCL', [n for n in dir(b) if any(k in n.lower() for k in ('shrink', 'abort', 'revoke', 'split', 'merge'))])
print('Backend', [n for n in dir(cc.Backend) if any(k in n.lower() for k in ('shrink', 'abort', 'revoke'))])
" > "$W/t/torch-api.txt" 2>&1
[ "${OVERHEAD:-0}" = 1 ] && stage o timeout "${OVERHEAD_S:-300}" python3 scripts/bench/gpu_snapshot_overhead.py --out "$W/o" ${OVERHEAD_ARGS:-}
[ "${STANDBY_MEM:-0}" = 1 ] && stage m timeout 300 python3 scripts/bench/gpu_standby_memory.py --out "$W/m"
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
  if [ "${STAGED_RUN:-0}" = 1 ]; then
    stage c1s env STAGED=1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1s" --systems hpr-inprocess \
      --faults "$FAULTS_HPR" --calibrated "$cal"
  fi
  stage c2 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c2" --systems torchrun --faults "$FAULTS" \
    --calibrated "$cal"
  parts=$(for c in c1 c2; do [ -e "$W/$c/recovery.json" ] && printf '%s,' "$W/$c"; done)
  stage merged python3 scripts/bench/recovery.py --merge "${parts%,}" --out "$W/merged"
fi
echo "sequence done $(date +%T)"
touch "$W/done"
