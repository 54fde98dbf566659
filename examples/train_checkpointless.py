"""Checkpointless training with plain PyTorch + DDP: after a fault every rank resumes from memory.

    hyperpodrun --nproc-per-node 4 --inprocess-restart examples/train_checkpointless.py --steps 300
    hyperpodrun inject --rank 2 --kind kill --step 120      # in another shell: SIGKILL rank 2 at step 120

The surviving ranks restart in-process, the killed rank is respawned, and all of them continue from the
last committed step (from shared memory; a rank whose memory is gone gets the state from a DDP replica;
`--fallback-dir` adds a disk copy for the loss of every replica). The data is indexed by step, so the
resumed run sees exactly the batches a run without the fault would have seen; with deterministic ops it
ends with the same parameters bit for bit (CPU). Without hyperpodrun it runs once as a plain process.
"""
import argparse
import datetime
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import CheckpointManager, CudaHealthCheck, HPWrapper, wait_rank


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--fallback-dir", default=None, help="also keep a disk copy every --fallback-every steps")
    p.add_argument("--fallback-every", type=int, default=100)
    p.add_argument("--offload", action="store_true", help="copy snapshots off the training step")
    return p.parse_args()


args = parse()
cm = CheckpointManager(enable_checksum=True, enable_offload=args.offload, fallback_dir=args.fallback_dir,
                       fallback_every=args.fallback_every if args.fallback_dir else None)


def batch(step: int, rank: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `step` of this rank: a function of (step, rank), so a resumed run draws the same data."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(64, dim, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).to(device) * 0.01


@HPWrapper(checkpoint_manager=cm, health_check=CudaHealthCheck(timeout=30), abort_timeout=30.0)
def main(caller=None) -> None:
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60),
                            device_id=device if use_cuda else None)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim),
                          nn.GELU(), nn.Linear(args.dim, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)          # build DDP before restore()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    state = {"model": ddp, "opt": opt, "sched": sched}
    start = cm.restore(state) or 0                          # None on a fresh start
    if rank == 0 and start:
        print(f"generation {caller.iteration}: resumed at step {start}", flush=True)
    loss = None
    for step in range(start, args.steps):
        caller.progress(step)
        x, y = batch(step, rank, args.dim, device)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        cm.save(step + 1, state)                            # after optimizer and scheduler steps
        if rank == 0 and step % 50 == 0:
            print(f"generation {caller.iteration} step {step} loss {loss.item():.5f}", flush=True)
    cm.wait()
    # release DDP and the last tensors before the group: a gloo thread must not free a tensor while
    # Python exits (torch 2.13 can abort the process then)
    del state, ddp, opt, sched, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    wait_rank()
    main()
