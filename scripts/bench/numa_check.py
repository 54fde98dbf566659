"""--numa-binding, side by side: for each of torchrun's four modes, the same worker (workers/numa_worker.py)
is launched by torchrun and by hyperpodrun on this machine's GPUs, with one restart, and the CPUs each worker
thread may run on are read back from /proc. The two launchers must agree, for the first attempt and the
respawn, on every thread. Not a timing: a check that the binding means to us what it means to torchrun, on a
machine that has GPUs and NUMA nodes (without a GPU both launchers refuse the flag).

    python3 scripts/bench/numa_check.py --out DIR [--work DIR] [--nproc N] [--modes node,socket,exclusive,core-complex]

Writes DIR/numa.md (the table) and DIR/numa.json (the jobs' logs and the workers' records stay in --work);
exits 0 only when every mode agrees."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import tempfile
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "numa_worker.py")
MODES = ("node", "socket", "exclusive", "core-complex")


def launch(launcher: str, mode: str, nproc: int, out: str, log_dir: str) -> dict[str, Any]:
    """One job: `launcher` with --numa-binding `mode`, one restart; its exit code and its last line."""
    tag = f"{launcher}-{mode}"
    cmd = [launcher, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", "--numa-binding", mode,
           "--log-dir", os.path.join(log_dir, tag), WORKER, out, tag]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return {"cmd": " ".join(cmd[:-3] + ["numa_worker.py"]), "rc": done.returncode, "last": lines[-1][:200] if lines else ""}


def records(out: str, tag: str) -> dict[tuple[int, int], dict[str, Any]]:
    found = {}
    for path in glob.glob(os.path.join(out, f"{tag}_r*_a*.json")):
        with open(path) as fh:
            rec = json.load(fh)
        found[(rec["rank"], rec["attempt"])] = rec
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: the number of GPUs)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "hpr-numa"),
                    help="the jobs' logs and the workers' records (emptied first)")
    args = ap.parse_args()
    nproc = args.nproc
    if nproc <= 0:
        import torch
        nproc = max(torch.cuda.device_count(), 1)
    shutil.rmtree(args.work, ignore_errors=True)
    rec_dir = os.path.join(args.work, "records")
    os.makedirs(rec_dir)
    os.makedirs(args.out, exist_ok=True)
    rows, ok = [], True
    for mode in args.modes.split(","):
        jobs = {ln: launch(ln, mode, nproc, rec_dir, os.path.join(args.work, "logs")) for ln in ("torchrun", "hyperpodrun")}
        got = {ln: records(rec_dir, f"{ln}-{mode}") for ln in jobs}
        keys = sorted(set(got["torchrun"]) | set(got["hyperpodrun"]))
        for key in keys or [(-1, -1)]:
            t, h = got["torchrun"].get(key), got["hyperpodrun"].get(key)
            same = t is not None and h is not None and t["threads"] == h["threads"]
            bound = h is not None and len(h["threads"]) == 1   # every thread on the same CPU list
            ok &= same and bound
            rows.append({"mode": mode, "rank": key[0], "attempt": key[1],
                         "torchrun": t["threads"] if t else None, "hyperpodrun": h["threads"] if h else None,
                         "hyperpodrun_threads": h["n_threads"] if h else 0, "agree": same,
                         "rc": {ln: j["rc"] for ln, j in jobs.items()},
                         "last": {ln: j["last"] for ln, j in jobs.items() if not got[ln]}})
        ok &= all(len(got[ln]) == 2 * nproc for ln in jobs)
    with open(os.path.join(args.out, "numa.json"), "w") as fh:
        json.dump({"nproc": nproc, "rows": rows, "ok": ok}, fh, indent=1)
    table = ["| mode | rank | attempt | torchrun: CPUs of every thread | hyperpodrun: CPUs of every thread (threads) | agree |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['mode']} | {r['rank']} | {r['attempt']} | {r['torchrun']} | {r['hyperpodrun']} "
                     f"({r['hyperpodrun_threads']}) | {'yes' if r['agree'] else 'NO ' + json.dumps(r['last'])} |")
    with open(os.path.join(args.out, "numa.md"), "w") as fh:
        fh.write("\n".join(table) + "\n")
    print("\n".join(table))
    print("numa check:", "all modes agree" if ok else "DIFFERENCES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
