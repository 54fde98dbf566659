"""Summarise the checkpointless GPU benchmark (scripts/bench/gpu.sh checkpointless) into ckpt-summary.json / .md."""
from __future__ import annotations

import glob
import json
import os
import sys


def _events(out: str, run: str) -> list[dict]:
    recs: list[dict] = []
    for f in glob.glob(os.path.join(out, "logs", run, "*.events.jsonl")):
        recs += [json.loads(line) for line in open(f) if line.strip()]
    return recs


def main(out: str) -> None:
    summary: dict = {}
    lines = ["| strategy | params | step, no snapshot | sync snapshot | offloaded snapshot | copy of one snapshot |"
             " peak GPU none / sync / offload | shm per rank |", "|---|---|---|---|---|---|---|---|"]
    for strategy in ("ddp", "fsdp2"):
        path = os.path.join(out, f"ckpt-{strategy}.json")
        if not os.path.exists(path):
            continue
        ranks = json.load(open(path))
        summary[strategy] = ranks
        r = ranks[0]
        med, ovh, pk = r["step_s_median"], r["overhead_pct"], r["peak_gpu_GiB"]
        lines.append(
            f"| {strategy} | {r['params'] / 1e9:.2f} B | {med['none'] * 1e3:.0f} ms | {med['sync'] * 1e3:.0f} ms "
            f"({ovh['sync']:+.1f} %) | {med['offload'] * 1e3:.0f} ms ({ovh['offload']:+.1f} %) | "
            f"{r['save_copy_s_median'] * 1e3:.0f} ms for {r['snapshot_bytes_per_rank'] / 2**30:.1f} GiB = "
            f"{r['copy_GiBps']:.1f} GiB/s | {pk['none']:.1f} / {pk['sync']:.1f} / {pk['offload']:.1f} GiB | "
            f"{r['shm_slots_GiB_per_rank']:.1f} GiB (2 slots) |")
    restore_path = os.path.join(out, "ckpt-restore.jsonl")
    if os.path.exists(restore_path):
        recs = [json.loads(line) for line in open(restore_path) if line.strip()]
        after = [r for r in recs if r["generation"] > 0]
        ev = _events(out, "ckpt-restore")
        fault = next((e for e in ev if e["event"] in ("fault", "fault_detected")), None)
        restored = next((e for e in ev if e["event"] == "state_restored"), None)
        summary["restore"] = {"workers": recs, "events": [e for e in ev if e["event"] in
                                                           ("fault", "fault_detected", "go", "state_restored")]}
        if after:
            lines.append("")
            lines.append("restore after SIGKILL of rank 1 (fsdp2): " + ", ".join(
                f"rank {r['rank']} restore() {r['restore_s']:.2f} s (step {r['restored_step']})" for r in after))
        if fault and restored:
            dt = restored["ts"] - fault["ts"] if "ts" in fault and "ts" in restored else None
            if dt is not None:
                lines.append(f"fault detected -> state restored (agent event log): {dt:.2f} s")
    json.dump(summary, open(os.path.join(out, "ckpt-summary.json"), "w"), indent=1)
    open(os.path.join(out, "ckpt-summary.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
