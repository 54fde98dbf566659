"""Every generation forms a gloo group and all-reduces; rank 1 fails while the restart count < N.

Each worker leaves a grandchild (`sleep`, in its own process group of the worker's session) and records
its pid in OUT/gc_<g>_<rank>; OUT/ok_<g>_<rank> marks a correct all-reduce in generation g.
"""
import gc as pygc
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    out, fail_until = sys.argv[1], int(sys.argv[2])
    gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    gc = subprocess.Popen(["sleep", "600"], process_group=0)
    with open(os.path.join(out, f"gc_{gen}_{rank}"), "w") as fh:
        fh.write(str(gc.pid))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    world = dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if t.item() != world * (world + 1) / 2:
        sys.exit(3)
    open(os.path.join(out, f"ok_{gen}_{rank}"), "w").close()
    if gen < fail_until:
        if rank == 1:
            sys.exit(1)
        end = time.monotonic() + 60  # held until the agent restarts the job
        while time.monotonic() < end:
            time.sleep(0.02)
        sys.exit(99)
    dist.barrier()
    # the job's tensors go before the group: a gloo thread must not free one while Python exits
    t = None
    pygc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
