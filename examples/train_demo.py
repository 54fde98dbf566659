"""A small, real DDP training job: an MLP learns a fixed "teacher" function from synthetic data.

Plain PyTorch + DistributedDataParallel on gloo (CPU); runs unchanged under hyperpodrun and torchrun:

    hyperpodrun --nproc-per-node 4 examples/train_demo.py
    torchrun    --nproc-per-node 4 examples/train_demo.py

Everything is deterministic: the model starts from a fixed seed and the batch of step s is generated from
(seed, s), so a job that resumes at step s from its checkpoint sees exactly the batches it would have seen.

Fault injection for demos (scripts/demo.sh uses it): `--fail-rank R --fail-at-step S` makes rank R exit
with code 3 when it reaches step S, but only in the first generation (TORCHELASTIC_RESTART_COUNT=0), so the
restarted job runs to the end. With `--checkpoint-dir` rank 0 saves a checkpoint every `--save-every` steps
and every rank resumes from it after a restart.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

IN_DIM, HIDDEN, OUT_DIM = 16, 64, 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size (split over the ranks)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="rank 0 prints the loss every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="save/resume a checkpoint here (rank 0 writes)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step (to make a demo watchable; 0 = as fast as possible)")
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits with code 3 ...")
    p.add_argument("--fail-at-step", type=int, default=None, help="... when it reaches this step, in generation 0")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    return p.parse_args()


def teacher() -> nn.Module:
    """The fixed function the student learns (same on every rank: fixed seed, never trained)."""
    g = torch.Generator().manual_seed(1234)
    net = nn.Sequential(nn.Linear(IN_DIM, 32), nn.Tanh(), nn.Linear(32, OUT_DIM))
    with torch.no_grad():
        for p in net.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return net.requires_grad_(False)


def batch(step: int, seed: int, global_batch: int, rank: int, world: int, target: nn.Module):
    """This rank's slice of the global batch of `step` - a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(global_batch, IN_DIM, generator=g)
    y = target(x) + 0.01 * torch.randn(global_batch, OUT_DIM, generator=g)
    per = global_batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def save_checkpoint(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = path + ".tmp"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save never leaves a torn checkpoint


def main() -> int:
    args = parse_args()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, OUT_DIM))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = 0
    ckpt = None
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        ckpt = os.path.join(args.checkpoint_dir, "checkpoint.pt")
        if os.path.exists(ckpt):
            state = torch.load(ckpt, map_location="cpu")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"])
    ddp = DDP(model)
    target = teacher()
    loss_fn = nn.MSELoss()
    print(f"rank {rank}/{world}: generation {generation}, starting at step {start} of {args.steps}", flush=True)

    t0 = time.monotonic()
    loss = avg = None
    for step in range(start, args.steps):
        if generation == 0 and rank == args.fail_rank and step == args.fail_at_step:
            print(f"rank {rank}: injected fault at step {step} (generation {generation}): exiting with code 3",
                  file=sys.stderr, flush=True)
            sys.exit(3)
        x, y = batch(step, args.seed, args.batch_size, rank, world, target)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                rate = (done - start) / max(time.monotonic() - t0, 1e-9)
                print(f"step {done:4d}/{args.steps}  loss {avg.item() / world:.5f}  ({rate:.0f} steps/s)", flush=True)
        if ckpt and rank == 0 and (done % args.save_every == 0 or done == args.steps):
            save_checkpoint(ckpt, done, model, opt)

    dist.barrier()
    if rank == 0:
        print(f"done: {args.steps} steps, generation {generation}", flush=True)
    # release DDP and the last collectives' tensors before the group: a gloo thread must not free a tensor while
    # Python exits (torch 2.13 can abort the process then)
    del ddp, loss, avg
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
