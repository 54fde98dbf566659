"""In-process restart example: DDP on gloo (CPU) or NCCL (GPU) under `hyperpodrun --inprocess-restart`.

    hyperpodrun --nproc-per-node 4 --inprocess-restart examples/train_inprocess.py --steps 200
    hyperpodrun inject --rank 2 --kind raise --step 50     # in another shell: a fault at step 50

Without hyperpodrun (`python examples/train_inprocess.py`) it runs once as a single process.
"""
import argparse
import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import CudaHealthCheck, HPWrapper, wait_rank


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=256)
    return p.parse_args()


@HPWrapper(health_check=CudaHealthCheck(timeout=30), abort_timeout=30.0)
def main(args: argparse.Namespace, caller=None) -> None:
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60),
                            device_id=device if use_cuda else None)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU(), nn.Linear(args.dim, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1234 + rank)
    loss = None
    for step in range(args.steps):
        caller.progress(step)
        x = torch.randn(32, args.dim, generator=gen).to(device)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 50 == 0:
            print(f"generation {caller.iteration} step {step} loss {loss.item():.4f}", flush=True)
    # release DDP and the last tensors before the group: a gloo thread must not free a tensor while
    # Python exits (torch 2.13 can abort the process then)
    del ddp, opt, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    wait_rank()
    main(parse())
