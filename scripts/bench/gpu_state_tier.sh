#!/usr/bin/env bash
# The state-tier benchmark (scripts/bench/state_tier.py, issue 25) on the one-GPU machine, the whole sequence in
# one go, about 7-9 minutes on one H200: the 1.07 B bf16 MLP, then the 1.08 B GPT-style decoder, one
# invocation each, so that every row of a model's table comes from the same invocation:
#   --kind none   rows none, readme, inside, bare: the steady step (save() after every step vs no CheckpointManager)
#   --kind raise  rows none, readme, inside, bare, nvrx: FAULTS exceptions each
#   --kind kill   rows none, readme, inside: FAULTS SIGKILLs each, hyperpodrun --inprocess-restart's default flags
# Run from the repository root, with the wheels the machine lacks in ./.whl (gpu_env.sh installs them):
# ../shared/tools/gpu-wheels.sh httpx httpcore h11 anyio sniffio idna certifi defusedxml (pyzmq, pydantic and
# those), plus nvidia-resiliency-ext==0.7.0 downloaded with --no-deps (without it the nvrx rows say "skipped").
# Each model has a budget (MLP_BUDGET, GPT_BUDGET seconds; JOB_TIMEOUT per job): a job that would start after
# it is listed as not run, and `timeout` stops the driver 70 s after it (the driver then ends its job in
# flight and writes what is done). What comes back ($OUT, at most 8 files): machine.txt, state_tier_<model>.md
# (the table) and .json (every job and fault), state_tier.log (the console), state_tier_raw.tar.gz (every
# job's worker records, launcher console and hyperpodrun event log).
#   OUT=bench-out bash scripts/bench/gpu_state_tier.sh
#   MODELS=gpt FAULTS=3 OUT=bench-out bash scripts/bench/gpu_state_tier.sh      # a part of it
#   KINDS=kill OUT=bench-out bash scripts/bench/gpu_state_tier.sh               # only the SIGKILL rows
set -uo pipefail
OUT="${OUT:-bench-out}"
source scripts/bench/gpu_env.sh
W="${BENCH_DIR:-/tmp/hpr-state-tier}"
rm -rf "$W" && mkdir -p "$W"
common=(--size 1b --nproc "${NPROC:-1}" --kinds "${KINDS:-none,raise,kill}" --only none=none,readme,inside,bare
        --only kill=none,readme,inside --faults "${FAULTS:-5}" --fault-every "${FAULT_EVERY:-4}" --warmup 4
        --tail 3 --steady-steps "${STEADY_STEPS:-20}" --job-timeout "${JOB_TIMEOUT:-75}" --arm-timeout 10)
{
  python3 -c "import importlib.metadata as m, nvidia_resiliency_ext.inprocess; print('nvidia-resiliency-ext', m.version('nvidia-resiliency-ext'))" 2>&1 | tail -1
  for model in ${MODELS:-mlp gpt}; do
    case "$model" in mlp) budget="${MLP_BUDGET:-225}" ;; gpt) budget="${GPT_BUDGET:-205}" ;; *) budget=300 ;; esac
    echo "== $model $(date +%T), budget ${budget}s"
    timeout -s TERM -k 25 $((budget + 70)) python3 scripts/bench/state_tier.py --model "$model" "${common[@]}" \
      --budget "$budget" --out "$W/$model"
    echo "== $model rc=$? $(date +%T)"
    cp "$W/$model/table.md" "$OUT/state_tier_$model.md" 2>/dev/null
    cp "$W/$model/summary.json" "$OUT/state_tier_$model.json" 2>/dev/null
  done
  echo "sequence done $(date +%T)"
} 2>&1 | tee "$OUT/state_tier.log"
tar czf "$OUT/state_tier_raw.tar.gz" -C "$W" . 2>/dev/null
ls -la "$OUT"
