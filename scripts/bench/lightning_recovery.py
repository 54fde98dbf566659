"""Recovery of a Lightning job with CheckpointlessCallback under `hyperpodrun --inprocess-restart`.

Runs tests/scripts/lightning_worker.py once without a fault and --runs times with a SIGKILL of one rank
mid-epoch, and reports per faulty run: the agent's downtime (fault -> GO), the time from the fault until the
state was restored inside the new Trainer.fit (training resumes right after), the restored step, the steps
lost, and how far the final parameters are from the fault-free run (0 on CPU: bitwise; on GPU NCCL may differ
in the last bits). Prints a JSON summary and writes it to --out.
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


def run(tmp: str, name: str, args: argparse.Namespace, faults: str = "") -> dict:
    out = os.path.join(tmp, name)
    os.makedirs(out)
    env = dict(os.environ, OUT_DIR=out, CACHE_DIR=os.path.join(tmp, "cache"), ACCEL=args.accel,
               STEPS=str(args.steps), WIDTH=str(args.width), DEPTH=str(args.depth), FAULTS=faults,
               HYPERPODRUN_SHM_DIR=os.path.join(tmp, "shm"))
    logs = os.path.join(tmp, f"logs-{name}")
    cmd = ["hyperpodrun", "--nproc-per-node", str(args.nproc), "--inprocess-restart", "--log-dir", logs,
           "--rdzv-id", name, WORKER]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"{name}: hyperpodrun exited {res.returncode}")
    evs = []
    for root, _, files in os.walk(logs):
        for f in files:
            if f.endswith(".events.jsonl"):
                with open(os.path.join(root, f)) as fh:
                    evs += [json.loads(line) for line in fh if line.strip()]
    evs.sort(key=lambda e: e["ts"])
    return {"out": out, "events": evs, "wall_s": wall}


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
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="hpr-lightning-")
    ref = run(tmp, "ref", args)
    rows = []
    for i in range(args.runs):
        got = run(tmp, f"fault{i}", args, f"kill:{args.kill_rank}:{args.kill_step}:top")
        ev = {e["event"]: e for e in reversed(got["events"])}   # first occurrence of each
        fault, go, restored = ev["fault"], ev["go"], ev["state_restored"]
        rows.append({"downtime_s": go["downtime_s"], "fault_to_restored_s": restored["ts"] - fault["ts"],
                     "restored_step": restored["step"], "lost_steps": restored["lost_steps"],
                     "source": restored["source"], "max_abs_param_diff": max_diff(ref["out"], got["out"], args.nproc),
                     "wall_s": got["wall_s"]})
    summary = {"accel": args.accel, "nproc": args.nproc, "steps": args.steps, "kill": [args.kill_rank, args.kill_step],
               "width": args.width, "depth": args.depth, "ref_wall_s": ref["wall_s"], "runs": rows,
               "median_downtime_s": statistics.median(r["downtime_s"] for r in rows),
               "median_fault_to_restored_s": statistics.median(r["fault_to_restored_s"] for r in rows)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
