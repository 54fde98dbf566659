#!/usr/bin/env bash
# The one entry for the GPU benchmarks: `bash scripts/bench/gpu.sh SEQUENCE [VAR=value ...]`.
#
# Each named sequence is what one GPU machine run measures (`gpu.sh list` names them with a line each); they
# share one machine set-up (scripts/bench/gpu_env.sh: this checkout as installed on PYTHONPATH, the wheels the
# machine lacks from ./.whl, a `hyperpodrun` command on PATH, NCCL_NVLS_ENABLE=0, the machine in
# $OUT/machine.txt), so that a sequence differs from another only in what it runs. Knobs are environment
# variables, given before the command or as VAR=value arguments after the sequence name; each sequence's
# knobs and defaults are listed in the comment above its function below and in scripts/bench/README.md.
#
#   OUT      where the results go; by default scripts/bench/results/<YYYY-MM-DD>-<short commit>-<sequence>/
#   DRY_RUN  1: print the commands the sequence would run (without their redirections) and run nothing - the
#            check of a sequence without a GPU
#
# The script changes to the repository root first: relative paths (OUT, BENCH_DIR) are taken from there.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
SELF=scripts/bench/gpu.sh

# name | purpose, in the order `list` prints them
SEQUENCES=(
  "smoke|checkpointless example on NCCL with the real NVML monitor: an exception, then a SIGKILL; both restored from memory"
  "recovery|one side-by-side recovery run (recovery.py --gpu, a 1.07B bf16 MLP); extra arguments go to recovery.py"
  "recovery-all|the whole recovery comparison in stages: hyperpodrun in-process, torchrun + hyperpodrun process-level, NVRx; merged"
  "recovery-fast|restart phases, then hyperpodrun in-process vs torchrun only (optional: snapshot overhead, standby memory, torch API)"
  "standby-warm|what the standby's kernel warm-up changes: cold/warm/eager standbys, then recovery with and without it"
  "state-tier|the state-tier rows (none, readme, inside, bare, nvrx): steady step, exception and SIGKILL recovery, MLP and GPT"
  "checkpointless|per-step snapshot overhead (none/sync/offload) of a >=1B model under DDP and FSDP2 on 2 GPUs, and restore after SIGKILL"
  "inprocess|the in-process restart benchmark on 2 GPUs (inprocess_bench.py, NCCL), once per sync mode"
  "health|the NVML health monitor on the real devices, its CPU cost, and injected XIDs in NCCL jobs (2 GPUs)"
  "frameworks|Lightning and the HF Trainer with our callbacks (module outside/inside) vs HPWrapper only vs torchrun: step and recovery"
  "lightning|Lightning + CheckpointlessCallback on 2 GPUs: recovery after a SIGKILL mid-epoch vs the fault-free run"
  "numa|--numa-binding's four modes under torchrun and hyperpodrun: the CPUs of every worker thread, first attempt and respawn"
  "restart-noise|what an in-process restart prints besides the job's lines, with the environment as is and with NOISE_ENV"
)

usage() {
  cat <<'EOF'
usage: bash scripts/bench/gpu.sh SEQUENCE [VAR=value ...] [recovery.py arguments, for `recovery` only]
       bash scripts/bench/gpu.sh list | --help

Runs one GPU benchmark sequence from the repository root, after the shared machine set-up
(scripts/bench/gpu_env.sh). Knobs are environment variables (before the command or as VAR=value
arguments); each sequence's knobs are in scripts/bench/README.md and above its function in this script.
  OUT=DIR    results (default scripts/bench/results/<YYYY-MM-DD>-<short commit>-<sequence>/)
  DRY_RUN=1  print the commands the sequence would run, run nothing (no GPU needed)

Sequences:
EOF
  list
}

list() {
  local entry
  for entry in "${SEQUENCES[@]}"; do printf '  %-15s %s\n' "${entry%%|*}" "${entry#*|}"; done
}

# ------------------------------------------------------------------------------------------- helpers
DRY=0; [ "${DRY_RUN:-0}" = 0 ] || [ -z "${DRY_RUN:-}" ] || DRY=1
dry() { [ "$DRY" = 1 ]; }
exec 3>&1   # the dry run's printed commands go here, past any pipe or redirection of the command

quote() {   # the arguments as one shell line
  local a out=()
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  printf '%s' "${out[*]}"
}
x() {       # run a command, or print it in a dry run
  if dry; then printf '+ %s\n' "$(quote "$@")" >&3; else "$@"; fi
}
to() {      # a file to redirect into: the file, or /dev/null in a dry run (which creates nothing)
  if dry; then printf '/dev/null'; else printf '%s' "$1"; fi
}
keep() {    # tee into a file (cat in a dry run)
  if dry; then cat; else tee "$1"; fi
}
setup() {   # the shared machine set-up, into this shell
  if dry; then
    printf '+ source scripts/bench/gpu_env.sh   # OUT=%s\n' "$OUT" >&3
    export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  else
    # shellcheck source=scripts/bench/gpu_env.sh
    source scripts/bench/gpu_env.sh
  fi
}
stage() {   # stage NAME COMMAND...: a stage of a long sequence, timed in its log
  echo "== $1 $(date +%T)"; shift; x "$@"; echo "== rc=$? $(date +%T)"
}
calibration() {   # "step_s,save_s" of the calibration job of stage c1
  if dry; then echo "STEP_S,SAVE_S"; return 0; fi
  python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['meta']; print(f\"{m['step_s']},{m['save_s']}\")" \
    "$W/c1/recovery.json"
}
parts() {   # the stages among $@ that wrote a report, as W/c1,W/c2 (all of them in a dry run)
  local c p=""
  for c in "$@"; do if dry || [ -e "$W/$c/recovery.json" ]; then p+="$W/$c,"; fi; done
  printf '%s' "${p%,}"
}

# ------------------------------------------------------------------------------------------- sequences
# smoke (was gpu_smoke.sh). NPROC (default: the number of GPUs). About a minute; exits 0 only if the job
# finished 0 with its state restored from memory twice. Prints the agent's event log.
seq_smoke() {
  setup
  L="$OUT/logs"; RUN=gpu-smoke
  if dry; then NPROC="${NPROC:-<number of GPUs>}"; else NPROC="${NPROC:-$(nvidia-smi -L | wc -l)}"; fi
  launch() {
    x hyperpodrun --nproc-per-node "$NPROC" --inprocess-restart --health-check nvml --log-dir "$L" --rdzv-id "$RUN" \
      examples/train_checkpointless.py --steps 4000 --dim 1024
  }
  if dry; then launch; true & else launch > "$OUT/job.txt" 2>&1 & fi
  JOB=$!
  events() { dry || cat "$L/$RUN"/node0.events.jsonl 2>/dev/null; }
  wait_for() {   # an event in the log, while the job runs (60 s at most)
    dry && return 0
    for _ in $(seq 600); do events | grep -q "$1" && return 0; kill -0 "$JOB" 2>/dev/null || break; sleep 0.1; done
    echo "no $1" >&2; return 1; }
  inject() { for _ in $(seq 150); do x hyperpodrun inject "$L/$RUN" "$@" && return 0; kill -0 "$JOB" 2>/dev/null || break
                                    sleep 0.2; done; return 1; }
  wait_for '"event": "agent_start"' && for _ in $(seq 300); do dry || [ -f "$L/$RUN/node0.agent.json" ] && break; sleep 0.1; done
  inject --rank 0 --kind raise --step 1000     # retried until the rank has connected
  wait_for '"event": "go"'
  inject --rank 0 --kind kill --step 2500
  wait "$JOB"; rc=$?
  echo "== job exit $rc"
  dry || tail -5 "$OUT/job.txt"
  x hyperpodrun logs "$L/$RUN" --events | grep -E "fault|respawn|restored|go |job_|gpu_health|inprocess_timeout" | cut -c1-220
  dry && return 0
  n=$(events | grep -c '"event": "state_restored"')
  echo "== state restored $n time(s) (expected 2)"
  [ "$rc" = 0 ] && [ "$n" -ge 2 ]
}

# recovery (was gpu_recovery.sh): scripts/bench/recovery.py --gpu --out $OUT, with the extra arguments (e.g.
# --kinds kill,raise). For the NVRx rows, .whl holds nvidia-resiliency-ext (0.7.0, --no-deps) with httpx and
# defusedxml. Without matplotlib on the machine, draw the picture afterwards: recovery.py --redraw --out DIR.
seq_recovery() {
  set -e
  setup
  x python3 scripts/bench/recovery.py --gpu --out "$OUT" "$@"
}

# recovery-all, recovery-fast, standby-warm (were gpu_recovery_all.sh with SEQ= gpu_recovery_seq.sh,
# gpu_recovery_fast_seq.sh, gpu_standby_warm_seq.sh): a sequence of stages that may outlast one command's time
# limit. The first call starts it in its own session (work folder BENCH_DIR, default /tmp/hpr-gpu-bench); every
# call (the first too) waits up to WAIT_S seconds (540) for it to end, then packs what is done into
# $OUT/gpu-recovery.tar.gz. Call again while the machine is held until the log says "sequence done".
# FAULTS_HPR (5): faults per kind for hyperpodrun in-process; FAULTS (3): for the others.
detached() {
  local name=$1
  W="${BENCH_DIR:-/tmp/hpr-gpu-bench}"
  WAIT_S="${WAIT_S:-540}"
  [ -z "${SEQ:-}" ] || echo "SEQ is not read any more: the sequence name picks the stages (recovery-all, recovery-fast, standby-warm)" >&2
  x mkdir -p "$OUT"
  if dry; then
    printf '+ %s > %s 2>&1 < /dev/null &\n' "$(quote env FAULTS_HPR="${FAULTS_HPR:-5}" FAULTS="${FAULTS:-3}" W="$W" \
      setsid nohup bash "$SELF" --stages "$name")" "$W/log" >&3
    echo "# the stages, in their own session:"
    (FAULTS_HPR="${FAULTS_HPR:-5}" FAULTS="${FAULTS:-3}"; OUT="$W/env"; setup; "stages_${name//-/_}")
  elif [ ! -e "$W/started" ]; then
    mkdir -p "$W" && echo "$name" > "$W/started"
    FAULTS_HPR="${FAULTS_HPR:-5}" FAULTS="${FAULTS:-3}" W="$W" \
      setsid nohup bash "$SELF" --stages "$name" > "$W/log" 2>&1 < /dev/null &
  elif [ "$(cat "$W/started")" != "$name" ]; then
    echo "$W holds a sequence started as '$(cat "$W/started")': waiting for that one (another BENCH_DIR starts $name)" >&2
  fi
  if ! dry; then
    deadline=$((SECONDS + WAIT_S))
    while [ ! -e "$W/done" ] && [ $SECONDS -lt $deadline ]; do sleep 2; done
    cat "$W/log"
  fi
  (dry || cd "$W" && x tar czf - --exclude='*.pt' log env p o m t w c1 c1i c1n c1s c2 c3 merged 2>/dev/null) \
    > "$(to "$OUT/gpu-recovery.tar.gz")"
  x ls -la "$OUT"
}

# the stages of recovery-all (W: the work folder):
#   c1  hyperpodrun in-process (--standby-workers 1), FAULTS_HPR faults per kind, and the calibration job
#   c2  torchrun + torch.save checkpoints, hyperpodrun process-level: FAULTS per kind, c1's calibration
#   c3  NVIDIA Resiliency Extension's inprocess.Wrapper under torchrun: FAULTS per kind, c1's calibration
#   merged  one report of the three (recovery.json, recovery.md, recovery.png)
stages_recovery_all() {
  local common=(--gpu --interval 8 --warmup 10) cal
  stage c1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
  cal=$(calibration) || cal=""
  if [ -n "$cal" ]; then
    echo "calibrated: $cal"
    stage c2 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c2" --systems torchrun,hpr-process \
      --faults "$FAULTS" --calibrated "$cal"
    stage c3 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c3" --systems nvrx --faults "$FAULTS" \
      --calibrated "$cal"
    stage merged python3 scripts/bench/recovery.py --merge "$(parts c1 c2 c3)" --out "$W/merged"
  fi
  echo "sequence done $(date +%T)"
  x touch "$W/done"
}

# the stages of recovery-fast, each with the same script and schedule; KINDS (raise,kill):
#   p   scripts/bench/gpu/gpu_restart_phases.py: NCCL abort variants, restore copy paths, gc (PHASES=0 skips it;
#       PHASE_REPS 3, PHASES_S 240)
#   c1  hyperpodrun --inprocess-restart --standby-workers 1, and the calibration job
#   c1i (INLINE_FAULTS > 0) hyperpodrun in-process with HYPERPODRUN_NCCL_ABORT_BACKGROUND=0 (the NCCL abort in
#       the restarting thread: the fallback), exceptions only
#   c1s (STAGED_RUN=1) c1 again with CheckpointManager(stage_on_device=True), c1's calibration
#   c2  torchrun, c1's calibration
# Before them, where asked: OVERHEAD=1 the snapshot overhead (o, scripts/bench/gpu/gpu_snapshot_overhead.py,
# OVERHEAD_ARGS, OVERHEAD_S 300), STANDBY_MEM=1 a standby's memory (m, scripts/bench/gpu/gpu_standby_memory.py),
# TORCH_API=1 what this torch offers to shrink or revoke a group (t).
TORCH_API_PY="
import torch, torch.distributed as d, torch.distributed.distributed_c10d as c, torch._C._distributed_c10d as cc
print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())
print('shrink_group', hasattr(d, 'shrink_group'), [n for n in dir(c) if 'SHRINK' in n])
b = getattr(cc, 'ProcessGroupNCCL', None)
print('ProcessGroupNCCL', [n for n in dir(b) if any(k in n.lower() for k in ('shrink', 'abort', 'revoke', 'split', 'merge'))])
print('Backend', [n for n in dir(cc.Backend) if any(k in n.lower() for k in ('shrink', 'abort', 'revoke'))])
"
stages_recovery_fast() {
  local common=(--gpu --interval 8 --warmup 10 --kinds "${KINDS:-raise,kill}") cal
  x mkdir -p "$W/p" "$W/o" "$W/m" "$W/t"
  [ "${TORCH_API:-0}" = 1 ] && stage t python3 -c "$TORCH_API_PY" > "$(to "$W/t/torch-api.txt")" 2>&1
  [ "${OVERHEAD:-0}" = 1 ] && stage o timeout "${OVERHEAD_S:-300}" python3 scripts/bench/gpu/gpu_snapshot_overhead.py \
    --out "$W/o" ${OVERHEAD_ARGS:-}
  [ "${STANDBY_MEM:-0}" = 1 ] && stage m timeout 300 python3 scripts/bench/gpu/gpu_standby_memory.py --out "$W/m"
  [ "${PHASES:-1}" = 0 ] || stage p timeout "${PHASES_S:-240}" python3 scripts/bench/gpu/gpu_restart_phases.py \
    --reps "${PHASE_REPS:-3}" --out "$W/p/phases.json"
  stage c1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
  cal=$(calibration) || cal=""
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
    stage merged python3 scripts/bench/recovery.py --merge "$(parts c1 c2)" --out "$W/merged"
  fi
  echo "sequence done $(date +%T)"
  x touch "$W/done"
}

# the stages of standby-warm (agent/workers/kernel_warm.py), side by side; KINDS (kill), INTERVAL (8: steps
# between faults):
#   w    scripts/bench/gpu/gpu_standby_warm.py: cold / warm / eager standby processes, the script's top and first
#        steps (WARM_ROUNDS 3, 0 skips it; WARM_VARIANTS cold,warm,eager; WARM_S 400)
#   c1   hyperpodrun --inprocess-restart --standby-workers 1 (kernel warm-up on: the default), and the calibration
#   c1n  the same with HYPERPODRUN_STANDBY_KERNEL_WARM=0, c1's calibration (C1N=0 skips it)
#   c2   torchrun + torch.save checkpoints, c1's calibration (C2=0 skips it)
stages_standby_warm() {
  local common=(--gpu --interval "${INTERVAL:-8}" --warmup 10 --kinds "${KINDS:-kill}") cal
  x mkdir -p "$W/w"
  [ "${WARM_ROUNDS:-3}" -gt 0 ] && stage w timeout "${WARM_S:-400}" python3 scripts/bench/gpu/gpu_standby_warm.py \
    --out "$W/w" --rounds "${WARM_ROUNDS:-3}" --variants "${WARM_VARIANTS:-cold,warm,eager}"
  stage c1 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c1" --systems hpr-inprocess --faults "$FAULTS_HPR"
  cal=$(calibration) || cal=""
  if [ -n "$cal" ]; then
    echo "calibrated: $cal"
    [ "${C1N:-1}" = 1 ] && stage c1n env HYPERPODRUN_STANDBY_KERNEL_WARM=0 python3 scripts/bench/recovery.py \
      "${common[@]}" --out "$W/c1n" --systems hpr-inprocess --faults "$FAULTS_HPR" --calibrated "$cal"
    [ "${C2:-1}" = 1 ] && stage c2 python3 scripts/bench/recovery.py "${common[@]}" --out "$W/c2" --systems torchrun \
      --faults "$FAULTS" --calibrated "$cal"
    stage merged python3 scripts/bench/recovery.py --merge "$(parts c1 c2)" --out "$W/merged"
  fi
  echo "sequence done $(date +%T)"
  x touch "$W/done"
}

# state-tier (was gpu_state_tier.sh): scripts/bench/state_tier.py on one GPU, about 7-9 minutes on one H200: the
# 1.07 B bf16 MLP, then the 1.08 B GPT-style decoder, one invocation each, so that every row of a model's table
# comes from the same invocation:
#   --kind none   rows none, readme, inside, bare: the steady step (save() after every step vs no CheckpointManager)
#   --kind raise  rows none, readme, inside, bare, nvrx: FAULTS exceptions each
#   --kind kill   rows none, readme, inside: FAULTS SIGKILLs each, hyperpodrun --inprocess-restart's default flags
# Knobs: MODELS (mlp gpt), KINDS (none,raise,kill), FAULTS (5), FAULT_EVERY (4), NPROC (1), STEADY_STEPS (20),
# JOB_TIMEOUT (75 s a job), MLP_BUDGET (225 s), GPT_BUDGET (205 s), BENCH_DIR (/tmp/hpr-state-tier). A job that
# would start after its model's budget is listed as not run, and `timeout` stops the driver 70 s after it (the
# driver then ends its job in flight and writes what is done). Without nvidia-resiliency-ext in .whl the nvrx
# rows say "skipped". What comes back ($OUT, at most 8 files): machine.txt, state_tier_<model>.md (the table)
# and .json (every job and fault), state_tier.log (the console), state_tier_raw.tar.gz (every job's worker
# records, launcher console and hyperpodrun event log).
seq_state_tier() {
  setup
  local W="${BENCH_DIR:-/tmp/hpr-state-tier}" common model budget
  x rm -rf "$W" && x mkdir -p "$W"
  common=(--size 1b --nproc "${NPROC:-1}" --kinds "${KINDS:-none,raise,kill}" --only none=none,readme,inside,bare
          --only kill=none,readme,inside --faults "${FAULTS:-5}" --fault-every "${FAULT_EVERY:-4}" --warmup 4
          --tail 3 --steady-steps "${STEADY_STEPS:-20}" --job-timeout "${JOB_TIMEOUT:-75}" --arm-timeout 10)
  {
    x python3 -c "import importlib.metadata as m, nvidia_resiliency_ext.inprocess; print('nvidia-resiliency-ext', m.version('nvidia-resiliency-ext'))" 2>&1 | tail -1
    for model in ${MODELS:-mlp gpt}; do
      case "$model" in mlp) budget="${MLP_BUDGET:-225}" ;; gpt) budget="${GPT_BUDGET:-205}" ;; *) budget=300 ;; esac
      echo "== $model $(date +%T), budget ${budget}s"
      x timeout -s TERM -k 25 $((budget + 70)) python3 scripts/bench/state_tier.py --model "$model" "${common[@]}" \
        --budget "$budget" --out "$W/$model"
      echo "== $model rc=$? $(date +%T)"
      x cp "$W/$model/table.md" "$OUT/state_tier_$model.md" 2>/dev/null
      x cp "$W/$model/summary.json" "$OUT/state_tier_$model.json" 2>/dev/null
    done
    echo "sequence done $(date +%T)"
  } 2>&1 | keep "$OUT/state_tier.log"
  x tar czf "$OUT/state_tier_raw.tar.gz" -C "$W" . 2>/dev/null
  x ls -la "$OUT"
}

# checkpointless (was gpu_checkpointless.sh): 2 GPUs, step-time overhead of per-step snapshots (none / sync /
# offload) for a >= 1B-parameter model with AdamW under DDP and FSDP2, the snapshot copy time, peak memory, and
# the time to restore after a SIGKILL; summarised by scripts/bench/ckpt_summary.py into $OUT/ckpt-summary.*.
# Knobs: STRATEGIES (ddp fsdp2), MEASURE_TIMEOUT (240 s), RESTORE_TIMEOUT (240 s), EXTRA (worker arguments).
seq_checkpointless() {
  setup
  local worker=scripts/bench/workers/ckpt_gpu_worker.py shm s
  shm=/dev/shm/hyperpodrun-$(id -u)
  for s in ${STRATEGIES:-ddp fsdp2}; do
    x rm -rf "$shm"
    # shellcheck disable=SC2086
    x timeout "${MEASURE_TIMEOUT:-240}" hyperpodrun --nproc-per-node 2 --log-dir "$OUT/logs" --rdzv-id "ckpt-$s" \
      $worker --strategy "$s" --measure --out "$OUT/ckpt-$s.json" ${EXTRA:-} 2>&1 | tail -5
    echo "== $s exit ${PIPESTATUS[0]}"
  done
  x rm -rf "$shm"
  # shellcheck disable=SC2086
  x timeout "${RESTORE_TIMEOUT:-240}" hyperpodrun --nproc-per-node 2 --inprocess-restart --log-dir "$OUT/logs" \
    --rdzv-id ckpt-restore $worker --strategy fsdp2 --fault-step 6 --out "$OUT/ckpt-restore.jsonl" ${EXTRA:-} 2>&1 | tail -12
  echo "== restore exit ${PIPESTATUS[0]}"
  x rm -rf "$shm"
  x python3 scripts/bench/ckpt_summary.py "$OUT"
}

# inprocess (was gpu_inprocess.sh): the GPU part of the in-process restart benchmark (2 GPUs, NCCL), results
# $OUT/gpu-<sync>.{json,md}. Knobs: SYNC_MODES (item poll), FAULTS (10), BASELINE_FAULTS (5), MODE_TIMEOUT
# (280 s a mode), EXTRA (more inprocess_bench.py arguments, e.g. "--asis-faults 4 --modes inprocess-asis").
seq_inprocess() {
  setup
  local sync
  for sync in ${SYNC_MODES:-item poll}; do
    # shellcheck disable=SC2086
    x timeout "${MODE_TIMEOUT:-280}" python3 scripts/bench/inprocess_bench.py --backend nccl --nproc-per-node 2 \
      --dim 4096 --layers 6 --batch 1024 --fault-buf-mb 256 --sync "$sync" \
      --faults "${FAULTS:-10}" --baseline-faults "${BASELINE_FAULTS:-5}" ${EXTRA:-} \
      --out "$OUT/gpu-$sync.json" --md "$OUT/gpu-$sync.md" 2>&1 | tail -60
    echo "== sync=$sync exit ${PIPESTATUS[0]}"
  done
}

# health (was gpu_health.sh): scripts/bench/gpu/gpu_health.py on 2 GPUs where nvidia-ml-py is installed; results
# $OUT/gpu_health.{json,md}; about 2-3 minutes.
seq_health() {
  setup
  x timeout 230 python3 scripts/bench/gpu/gpu_health.py "$OUT"
  echo "== gpu_health exit $?"
}

# lightning (was gpu_lightning.sh): scripts/bench/lightning_recovery.py on 2 GPUs (DDP over NCCL) where lightning
# is installed; RUNS (3); results $OUT/lightning-gpu.json; about 3 minutes.
seq_lightning() {
  setup
  x timeout 400 python3 scripts/bench/lightning_recovery.py --accel gpu --nproc 2 --steps 40 --kill-step 21 \
    --width 4096 --depth 4 --runs "${RUNS:-3}" --out "$OUT/lightning-gpu.json"
  echo "== lightning exit $?"
}

# frameworks: scripts/bench/frameworks.py on one GPU, a 0.66 B Llama (bf16-mixed, fused AdamW, 2 DataLoader workers)
# under Lightning and the Hugging Face Trainer, rows none/outside/inside/torchrun, an exception and a SIGKILL
# between backward and the optimizer step. FRAMEWORKS (lightning hf), KINDS (raise,kill), ROWS
# (none,outside,inside,torchrun), FAULTS (3), BUILD (cpu: the module made on the host; device: on the GPU), NO_STANDBY
# (outside: those rows' kill jobs also without standbys; set but empty: none), PRERUN (auto: every other kill job's
# standby runs the script ahead to the wrapped function, --standby-prerun auto; off: it waits before it), BUDGET (420 s
# per framework), JOB_TIMEOUT (150 s), BENCH_DIR (/tmp/hpr-frameworks). What comes back: machine.txt,
# frameworks_<fw>.md and .json, frameworks.log, frameworks_raw.tar.gz.
seq_frameworks() {
  setup
  local W="${BENCH_DIR:-/tmp/hpr-frameworks}" fw
  x rm -rf "$W" && x mkdir -p "$W"
  {
    for fw in ${FRAMEWORKS:-lightning hf}; do
      echo "== $fw $(date +%T)"
      x timeout -s TERM -k 25 $((${BUDGET:-420} + 200)) python3 scripts/bench/frameworks.py --size 0.6b \
        --frameworks "$fw" --kinds "${KINDS:-raise,kill}" --rows "${ROWS:-none,outside,inside,torchrun}" \
        --faults "${FAULTS:-3}" --build "${BUILD:-cpu}" --no-standby "${NO_STANDBY-outside}" --standby-prerun "${PRERUN:-auto}" --job-timeout "${JOB_TIMEOUT:-150}" \
        --budget "${BUDGET:-420}" --arm-timeout 10 --out "$W/$fw"
      echo "== $fw rc=$? $(date +%T)"
      x cp "$W/$fw/table.md" "$OUT/frameworks_$fw.md" 2>/dev/null
      x cp "$W/$fw/summary.json" "$OUT/frameworks_$fw.json" 2>/dev/null
    done
    echo "sequence done $(date +%T)"
  } 2>&1 | keep "$OUT/frameworks.log"
  x tar -czf "$(to "$OUT/frameworks_raw.tar.gz")" -C "$W" --exclude='*.ckpt' --exclude='checkpoint-*' .
}

# numa: scripts/bench/numa_check.py - each --numa-binding mode launched by torchrun and by hyperpodrun (one restart),
# every worker thread's allowed CPUs read back from /proc and compared. NPROC (default: the number of GPUs), MODES
# (node,socket,exclusive,core-complex). What comes back: machine.txt, numa_topology.txt, numa.md, numa.json.
seq_numa() {
  setup
  { lscpu | grep -i numa; nvidia-smi topo -m; } > "$(to "$OUT/numa_topology.txt")" 2>&1
  x python3 scripts/bench/numa_check.py --out "$OUT" ${NPROC:+--nproc "$NPROC"} --modes "${MODES:-node,socket,exclusive,core-complex}"
}

# restart-noise (was gpu_restart_noise.sh): the same small job (one rank, NCCL, 3 exceptions) run twice under
# hyperpodrun --inprocess-restart, with the environment as it is and with the extra variables in NOISE_ENV
# (e.g. "TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_ENABLE_MONITORING=0"); the console of each goes to
# $OUT/noise-<default|with-env>.log and the count of each known noise pattern is printed.
seq_restart_noise() {
  setup
  local patterns=("recvValue failed" "should dump" "c10::Error" "Exception raised from" "Traceback" "NCCL WARN")
  noise_run() {   # noise_run NAME [VAR=VALUE ...]
    local name=$1; shift
    local out p rc
    if dry; then out="<tmpdir>"; else out=$(mktemp -d); fi
    x env "$@" SYSTEM=hpr-inprocess DEVICE=cuda DIM=2048 LAYERS=4 BATCH=1024 STEPS=24 STEP_SLEEP=0 CKPT_EVERY=1000 \
      FAULT_KIND=raise FAULT_STEPS=4,9,14 FAULT_RANKS=0 OUT_DIR="$out" \
      timeout 240 hyperpodrun --nproc-per-node 1 --inprocess-restart --standby-workers 1 \
        --log-dir "$out/logs" scripts/bench/workers/recovery_worker.py > "$(to "$OUT/noise-$name.log")" 2>&1
    rc=$?
    dry && return 0
    echo "== $name (rc=$rc): $(wc -l < "$OUT/noise-$name.log") console lines, $(cat "$out"/steps.rank0.jsonl 2>/dev/null | wc -l) steps"
    for p in "${patterns[@]}"; do printf '  %-24s %s\n' "$p" "$(grep -c -- "$p" "$OUT/noise-$name.log")"; done
    rm -rf "$out"
  }
  noise_run default
  # shellcheck disable=SC2086
  noise_run with-env ${NOISE_ENV:-}
}

# ------------------------------------------------------------------------------------------- main
case "${1:-}" in
  ""|-h|--help|help) usage; exit 0 ;;
  list) list; exit 0 ;;
  --stages)   # internal: the stages of a long sequence, in their own session (see detached); W is the work folder
    name=${2:?}; OUT="$W/env"; setup; "stages_${name//-/_}"; exit $? ;;
esac
SEQUENCE=$1; shift
known=0
for entry in "${SEQUENCES[@]}"; do [ "${entry%%|*}" = "$SEQUENCE" ] && known=1; done
if [ "$known" = 0 ]; then
  echo "gpu.sh: no sequence '$SEQUENCE'; the sequences:" >&2; list >&2; exit 2
fi
while [ $# -gt 0 ] && [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do export "${1?}"; shift; done
if [ $# -gt 0 ] && [ "$SEQUENCE" != recovery ]; then
  echo "gpu.sh: $SEQUENCE takes VAR=value arguments only, not: $*" >&2; exit 2
fi
DRY=0; [ "${DRY_RUN:-0}" = 0 ] || [ -z "${DRY_RUN:-}" ] || DRY=1   # again: DRY_RUN may be one of the arguments
if [ -z "${OUT:-}" ]; then
  OUT="scripts/bench/results/$(date +%F)-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)-$SEQUENCE"
fi
export OUT
echo "== gpu.sh $SEQUENCE: results in $OUT$(dry && echo ' (dry run: nothing is run)')"
case "$SEQUENCE" in
  recovery-all|recovery-fast|standby-warm) detached "$SEQUENCE" ;;
  *) "seq_${SEQUENCE//-/_}" "$@" ;;
esac
