"""Recovery of a Lightning job with CheckpointlessCallback: in-process restart against a process restart.

Runs tests/scripts/lightning_worker.py (DDP, MMAPDataModule, CheckpointManager) once without a fault and then,
alternating, --runs times in each mode with a fault of one rank mid-epoch (--kind: SIGKILL, or an exception in
training_step):
- inprocess, `hyperpodrun --inprocess-restart`: the surviving ranks stay, the killed one is respawned;
- process, `hyperpodrun --max-restarts 1`: what torchrun does - every worker is stopped and started again
  (imports, new Trainer, new process group). The state comes back from the same shared-memory snapshots
  (they outlive the processes), so only the restart differs.
Reported per run: seconds from the fault until every rank trains again (its first batch after the restart),
and how far the final parameters are from the fault-free run (0 on CPU: bitwise; on GPU NCCL may differ in
the last bits). Prints a JSON summary (medians, ratio) and writes it to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "scripts", "lightning_worker.py")


def command(launcher: str, nproc: int, name: str, logs: str) -> list[str]:
    mode = ["--inprocess-restart"] if launcher == "inprocess" else ["--max-restarts", "1"]
    return ["hyperpodrun", "--nproc-per-node", str(nproc), *mode, "--log-dir", logs, "--rdzv-id", name, WORKER]


def run(tmp: str, name: str, launcher: str, args: argparse.Namespace, faults: str = "") -> dict:
    out = os.path.join(tmp, name)
    os.makedirs(out)
    env = dict(os.environ, OUT_DIR=out, CACHE_DIR=os.path.join(tmp, "cache"), ACCEL=args.accel,
               STEPS=str(args.steps), WIDTH=str(args.width), DEPTH=str(args.depth), FAULTS=faults,
               HYPERPODRUN_SHM_DIR=os.path.join(tmp, "shm"))
    t0 = time.monotonic()
    res = subprocess.run(command(launcher, args.nproc, name, os.path.join(tmp, f"logs-{name}")), env=env,
                         capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"{name} ({launcher}): exited {res.returncode}")
    row: dict = {"launcher": launcher, "wall_s": round(wall, 3)}
    if faults:
        with open(os.path.join(out, "faults.txt")) as f:
            t_fault = min(float(line.split()[3]) for line in f)
        back = []
        for r in range(args.nproc):
            with open(os.path.join(out, f"batches{r}.txt")) as f:
                after = [float(t) for _, _, t, gen in (line.split() for line in f) if int(gen) >= 1]
            back.append(min(after))
        row["fault_to_training_s"] = round(max(back) - t_fault, 3)
        logs = os.path.join(tmp, f"logs-{name}")
        for root, _, files in os.walk(logs):
            for f in files:
                if f.endswith(".events.jsonl"):
                    with open(os.path.join(root, f)) as fh:
                        for line in fh:
                            ev = json.loads(line)
                            if ev["event"] == "respawn":
                                row["respawn_warm"] = ev.get("warm")
    row["out"] = out
    return row


def max_diff(a: str, b: str, nproc: int) -> float:
    worst = 0.0
    for r in range(nproc):
        x = torch.load(os.path.join(a, f"rank{r}.pt"), map_location="cpu")
        y = torch.load(os.path.join(b, f"rank{r}.pt"), map_location="cpu")
        for k, v in x["params"].items():
            worst = max(worst, (v.double() - y["params"][k].double()).abs().max().item())
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accel", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=21)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kind", default="kill", choices=["kill", "raise"],
                   help="the fault: SIGKILL of the rank, or an exception in its training_step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--runs", type=int, default=3, help="faulty runs per launcher")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="hpr-lightning-")
    ref = run(tmp, "ref", "inprocess", args)
    rows = []
    for i in range(args.runs):
        for launcher in ("inprocess", "process"):
            row = run(tmp, f"{launcher}{i}", launcher, args, f"{args.kind}:{args.kill_rank}:{args.kill_step}:top")
            row["max_abs_param_diff"] = max_diff(ref["out"], row.pop("out"), args.nproc)
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = {name: statistics.median(r["fault_to_training_s"] for r in rows if r["launcher"] == name)
           for name in ("inprocess", "process")}
    summary = {"accel": args.accel, "nproc": args.nproc, "steps": args.steps, "fault": [args.kind, args.kill_rank, args.kill_step],
               "width": args.width, "depth": args.depth, "ref_wall_s": ref["wall_s"], "runs": rows,
               "median_fault_to_training_s": med, "ratio_process_over_inprocess": round(med["process"] / med["inprocess"], 3)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
