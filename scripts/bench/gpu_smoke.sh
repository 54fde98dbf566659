#!/usr/bin/env bash
# GPU smoke check on a machine with one or more GPUs (run from the repository root; wheels the machine lacks in
# ./.whl): examples/train_checkpointless.py on NCCL under --inprocess-restart with the real NVML monitor, an
# injected exception and then a SIGKILL of rank 0; the job must finish 0 with its state restored from memory
# both times. Prints the agent's event log. About a minute.
set -uo pipefail
source scripts/bench/gpu_env.sh
L="$OUT/logs"; RUN=gpu-smoke
NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"
hyperpodrun --nproc-per-node "$NPROC" --inprocess-restart --health-check nvml --log-dir "$L" --rdzv-id "$RUN" \
  examples/train_checkpointless.py --steps 4000 --dim 1024 > "$OUT/job.txt" 2>&1 &
JOB=$!
events() { cat "$L/$RUN"/node0.events.jsonl 2>/dev/null; }
wait_for() {   # an event in the log, while the job runs (60 s at most)
  for _ in $(seq 600); do events | grep -q "$1" && return 0; kill -0 "$JOB" 2>/dev/null || break; sleep 0.1; done
  echo "no $1" >&2; return 1; }
wait_for '"event": "agent_start"' && for _ in $(seq 300); do [ -f "$L/$RUN/node0.agent.json" ] && break; sleep 0.1; done
inject() { for _ in $(seq 150); do hyperpodrun inject "$L/$RUN" "$@" && return 0; kill -0 "$JOB" 2>/dev/null || break
                                  sleep 0.2; done; return 1; }
inject --rank 0 --kind raise --step 1000     # retried until the rank has connected
wait_for '"event": "go"'
inject --rank 0 --kind kill --step 2500
wait "$JOB"; rc=$?
echo "== job exit $rc"
tail -5 "$OUT/job.txt"
hyperpodrun logs "$L/$RUN" --events | grep -E "fault|respawn|restored|go |job_|gpu_health|inprocess_timeout" | cut -c1-220
n=$(events | grep -c '"event": "state_restored"')
echo "== state restored $n time(s) (expected 2)"
[ "$rc" = 0 ] && [ "$n" -ge 2 ]
