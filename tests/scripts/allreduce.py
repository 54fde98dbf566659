"""Form a gloo group from the launcher's environment, all-reduce, and leave OUT/result_<rank>.json."""
import gc
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    result = {"rank": rank, "world": world, "sum": t.item(), "env": {k: os.environ.get(k) for k in names}}
    dist.barrier()
    # the job's tensors go before the group: a gloo thread must not free one while Python exits
    t = None
    gc.collect()
    dist.destroy_process_group()
    tmp = os.path.join(out, f".result_{rank}.tmp")
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, os.path.join(out, f"result_{rank}.json"))


if __name__ == "__main__":
    main()
