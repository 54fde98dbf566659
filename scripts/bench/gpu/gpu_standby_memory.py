"""What a standby worker costs while it waits: GPU memory, host memory, per process, measured on a live job.

    python3 scripts/bench/gpu/gpu_standby_memory.py --out DIR [--dim 8192 --layers 16 --batch 8192]

Runs the recovery benchmark's job (scripts/bench/workers/recovery_worker.py, SYSTEM=hpr-inprocess, one rank,
snapshots after every step) under `hyperpodrun --inprocess-restart --standby-workers 1`, waits until the
standby is ready and the rank has saved snapshots for a while (so the standby has mapped and registered
the slot files), then samples, for the rank, the standby and the zygote: the GPU memory NVML charges to the
process, and the host memory from /proc/<pid>/smaps_rollup (Rss; Pss, which splits shared pages among the
processes mapping them; Private, the pages the process alone holds). Then stops the job with SIGTERM.

Writes DIR/standby-memory.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent


def smaps(pid: int) -> dict[str, int]:
    """kB fields of /proc/<pid>/smaps_rollup."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def gpu_memory() -> dict[int, int]:
    """pid -> bytes of GPU memory NVML charges to it, on every GPU ({} without NVML: the CPU smoke test)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        used: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        return used
    finally:
        pynvml.nvmlShutdown()


def events(log_dir: Path) -> list[dict]:
    out = []
    for f in sorted(log_dir.glob("**/*.events.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_for(what: str, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", default="8192")
    ap.add_argument("--layers", default="16")
    ap.add_argument("--batch", default="8192")
    ap.add_argument("--saved-steps", type=int, default=12, help="steps saved before sampling")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="hpr-standby-mem-"))
    logs = tmp / "logs"
    env = {**os.environ, "SYSTEM": "hpr-inprocess", "DEVICE": args.device, "DIM": args.dim, "LAYERS": args.layers,
           "BATCH": args.batch, "STEPS": "100000", "STEP_SLEEP": "0", "OFFLOAD": "1", "OUT_DIR": str(tmp)}
    cmd = ["hyperpodrun", "--nproc-per-node", "1", "--log-dir", str(logs), "--rdzv-id", "job",
           "--inprocess-restart", "--standby-workers", "1", str(HERE.parent / "workers" / "recovery_worker.py")]
    job = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        ready = wait_for("the standby to be ready", lambda: next(
            (e for e in events(logs) if e.get("event") == "standby_ready"), None), 180)
        steps = tmp / "steps.rank0.jsonl"
        wait_for(f"{args.saved_steps} saved steps", lambda: steps.exists() and
                 len(steps.read_text().splitlines()) >= args.saved_steps, 300)
        time.sleep(1.5)          # the standby re-checks its slots every 0.5 s: let it map and pin both
        standby = int(ready["pid"])
        gpu = gpu_memory()
        rank = int(next(e for e in events(logs) if e.get("event") == "worker_start")["pid"])
        zygote = psutil.Process(standby).ppid()
        procs = {"rank": rank, "standby": standby, "zygote": zygote}
        sample = {}
        for name, pid in procs.items():
            m = smaps(pid)
            sample[name] = {"pid": pid, "gpu_bytes": gpu.get(pid, 0), "rss_kB": m.get("Rss", 0),
                            "pss_kB": m.get("Pss", 0),
                            "private_kB": m.get("Private_Clean", 0) + m.get("Private_Dirty", 0),
                            "locked_kB": m.get("Locked", 0)}
        sample["standby_ready_s"] = ready.get("ready_s")
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    doc = {"command": cmd, "dim": args.dim, "layers": args.layers, "batch": args.batch, "sample": sample}
    (out / "standby-memory.json").write_text(json.dumps(doc, indent=1))
    lines = ["| process | GPU memory (NVML) | host Rss | host Pss | host private | locked |", "|---|---|---|---|---|---|"]
    for name in ("rank", "standby", "zygote"):
        s = sample[name]
        lines.append(f"| {name} | {s['gpu_bytes'] / 2**30:.2f} GiB | {s['rss_kB'] / 2**20:.2f} GiB | "
                     f"{s['pss_kB'] / 2**20:.2f} GiB | {s['private_kB'] / 2**20:.2f} GiB | {s['locked_kB'] / 2**20:.2f} GiB |")
    (out / "standby-memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
