"""The worker of scripts/bench/numa_check.py: records the CPUs each of its threads may run on (read back from
/proc/self/task/<tid>/status), after torch and CUDA have started their own threads, then fails its first
attempt so that the launcher starts it again and the respawn is recorded too. Usage: numa_worker.py OUT TAG."""
from __future__ import annotations

import json
import os
import sys
import threading

import torch


def allowed(path: str) -> str:
    with open(path) as fh:
        return next(line.split()[1] for line in fh if line.startswith("Cpus_allowed_list:"))


def main() -> int:
    out, tag = sys.argv[1], sys.argv[2]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.ones(1, device="cuda").sum().item()   # the CUDA runtime's threads exist from here
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait, daemon=True)   # a thread the script starts itself
    extra.start()
    threads = {tid: allowed(f"/proc/self/task/{tid}/status") for tid in os.listdir("/proc/self/task")}
    stop.set()
    record = {"tag": tag, "rank": rank, "attempt": attempt, "process": allowed("/proc/self/status"),
              "threads": sorted(set(threads.values())), "n_threads": len(threads)}
    with open(os.path.join(out, f"{tag}_r{rank}_a{attempt}.json"), "w") as fh:
        json.dump(record, fh)
    return 1 if attempt == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
