#!/usr/bin/env bash
# The whole GPU recovery comparison (scripts/bench/recovery.py --gpu), as one sequence that may outlast one
# command's time limit: the first call starts it in its own session; every call (the first too) waits up to
# WAIT_S seconds for it to end, then packs what is done into $OUT/gpu-recovery.tar.gz. Run it again while
# the machine is held until the log says "sequence done". Stages, each with the same schedule and model:
#   c1  hyperpodrun in-process (--standby-workers 1), FAULTS_HPR faults per kind, and the calibration job
#   c2  torchrun + torch.save checkpoints, hyperpodrun process-level: FAULTS per kind, c1's calibration
#   c3  NVIDIA Resiliency Extension's inprocess.Wrapper under torchrun: FAULTS per kind, c1's calibration
#   merged  one report of the three (recovery.json, recovery.md, recovery.png)
#   OUT=bench-out bash scripts/bench/gpu_recovery_all.sh
# SEQ picks another sequence of stages (default scripts/bench/gpu_recovery_seq.sh), e.g.
# SEQ=scripts/bench/gpu_recovery_fast_seq.sh: the restart phases, then in-process vs torchrun only.
set -uo pipefail
W="${BENCH_DIR:-/tmp/hpr-gpu-bench}"
WAIT_S="${WAIT_S:-540}"
OUT="${OUT:-bench-out}"
mkdir -p "$OUT"
if [ ! -e "$W/started" ]; then
  mkdir -p "$W" && touch "$W/started"
  FAULTS_HPR="${FAULTS_HPR:-5}" FAULTS="${FAULTS:-3}" W="$W" \
    setsid nohup bash "${SEQ:-scripts/bench/gpu_recovery_seq.sh}" > "$W/log" 2>&1 < /dev/null &
fi
deadline=$((SECONDS + WAIT_S))
while [ ! -e "$W/done" ] && [ $SECONDS -lt $deadline ]; do sleep 2; done
cat "$W/log"
(cd "$W" && tar czf - --exclude='*.pt' log env p o m t w c1 c1i c1n c1s c2 c3 merged 2>/dev/null) > "$OUT/gpu-recovery.tar.gz"
ls -la "$OUT"
