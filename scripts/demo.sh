#!/usr/bin/env bash
# The demo: a small DDP training job (examples/train_demo.py, 4 CPU workers on gloo) under hyperpodrun with one
# real fault - rank 1 exits with code 3 at step 120 of the first generation - so you can watch the agent stop
# the other workers, restart the job once (--max-restarts 1) and finish it from the last checkpoint. Then it
# prints the agent's event log of the run. Same bootstrap as scripts/test.sh (scripts/_venv.sh).
# Logs stay under hyperpodrun_logs/ (ignored by git). Extra arguments go to hyperpodrun, before the script.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"

LOG_DIR=hyperpodrun_logs
RUN_ID="demo-$(date +%Y%m%d-%H%M%S)-$$"
RUN_DIR="$LOG_DIR/$RUN_ID"

echo "== hyperpodrun --nproc-per-node 4 --max-restarts 1 examples/train_demo.py  (run $RUN_ID)"
echo "== rank 1 will exit with code 3 at step 120 of generation 0; its peers' collectives then fail too"
echo
status=0
hyperpodrun --nproc-per-node 4 --max-restarts 1 --log-dir "$LOG_DIR" --rdzv-id "$RUN_ID" "$@" \
  examples/train_demo.py --steps 300 --log-every 25 --step-time 0.01 \
  --fail-rank 1 --fail-at-step 120 --checkpoint-dir "$RUN_DIR/checkpoint" || status=$?

echo
echo "== hyperpodrun exited with code $status. What the agent did: hyperpodrun logs $RUN_DIR --events"
hyperpodrun logs "$RUN_DIR" --events
# The demo checks itself: the restart must be blamed on rank 1's exit code 3, not on a peer that died of the
# broken collective it caused.
if ! python - "$RUN_DIR" <<'PY'
import glob, json, sys
faults = [r for p in glob.glob(sys.argv[1] + "/*.events.jsonl") for r in map(json.loads, open(p)) if r.get("event") == "fault"]
ok = bool(faults) and faults[0].get("rank") == 1 and faults[0].get("exit_code") == 3
print("== cause named:", faults[0].get("msg") if faults else "no fault recorded", "(expected rank 1, exit code 3)" if not ok else "")
sys.exit(0 if ok else 1)
PY
then
  echo "== FAILED: the event log does not name rank 1 (exit code 3) as the cause" >&2
  status=1
fi
echo
echo "== per-rank logs: $RUN_DIR/attempt_<generation>/rank_<rank>/{stdout.log,stderr.log}"
echo "   e.g. hyperpodrun logs $RUN_DIR --rank 1"
exit "$status"
