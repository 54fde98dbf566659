"""A worker that iterates a DataLoader with worker processes forever (until it is killed).

Writes OUT/ready_<rank>.json once its DataLoader workers are running: its pid and session id, the
DataLoader workers' pids, and a grandchild (`sleep`) that moved to its own process group, so only a
session-wide kill ends it.
"""
import json
import os
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])


class Slow(Dataset):
    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor([i])


def main():
    loader_pids = []

    def init(worker_id):
        with open(os.path.join(OUT, f"dlworker_{RANK}_{worker_id}"), "w") as fh:
            fh.write(str(os.getpid()))

    loader = DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=init, persistent_workers=True)
    gc = subprocess.Popen(["sleep", "600"], process_group=0)
    it = iter(loader)
    next(it)
    next(it)
    for w in range(2):
        with open(os.path.join(OUT, f"dlworker_{RANK}_{w}")) as fh:
            loader_pids.append(int(fh.read()))
    tmp = os.path.join(OUT, f".ready_{RANK}.tmp")
    with open(tmp, "w") as fh:
        json.dump({"rank": RANK, "pid": os.getpid(), "sid": os.getsid(0), "loader_pids": loader_pids,
                   "grandchild": gc.pid}, fh)
    os.replace(tmp, os.path.join(OUT, f"ready_{RANK}.json"))
    end = time.monotonic() + 120
    while time.monotonic() < end:
        next(it)
    sys.exit(99)


if __name__ == "__main__":
    main()
