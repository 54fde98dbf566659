"""The smallest HPWrapper job on gloo: init, one all_reduce, a barrier, a clean teardown. Each rank writes the
time its training function returned to OUT/returned<rank> (it returns under --inprocess-restart only once the
agent has released it). --terminate-rank R: that rank then ends in std::terminate, as torch's gloo teardown
race does ("terminate called without an active exception", SIGABRT)."""
import argparse
import ctypes
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist

from hyperpodrun import HPWrapper, wait_rank


@HPWrapper()
def main(caller=None) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    del t
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--terminate-rank", type=int, default=None)
    args = ap.parse_args()
    wait_rank()
    main()
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, f"returned{rank}"), "w") as fh:
        fh.write(repr(time.time()))
    if rank == args.terminate_rank:
        ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev()
