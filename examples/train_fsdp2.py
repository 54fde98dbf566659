"""Checkpointless training with FSDP2 (`fully_shard`): each rank snapshots its own shards in memory.

    hyperpodrun --nproc-per-node 4 --inprocess-restart examples/train_fsdp2.py --steps 200
    hyperpodrun inject --rank 1 --kind raise --step 80      # in another shell

FSDP2 shards parameters and optimizer state, so no other rank holds a rank's shard: every rank keeps a
double-buffered snapshot of its DTensor shards in host shared memory, which survives the death of the
process. `restore` gives each shard back its placement. With `--replicate 2` the mesh is 2-D (HSDP): the
shards are replicated across the first dimension, and a rank that lost its memory gets its shard from
the replica (the groups are given to CheckpointManager). Works on gloo (CPU) and NCCL (GPU).
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
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicas (divides the world size)")
    return p.parse_args()


args = parse()
WORLD = int(os.environ.get("WORLD_SIZE", 1))
SHARD = WORLD // args.replicate
# HSDP mesh (replicate, shard): rank = r * SHARD + s; ranks with the same s hold the same shard
cm = CheckpointManager(enable_checksum=True,
                       replica_groups=[[r * SHARD + s for r in range(args.replicate)] for s in range(SHARD)]
                       if args.replicate > 1 else None)


@HPWrapper(checkpoint_manager=cm, health_check=CudaHealthCheck(timeout=30), abort_timeout=30.0)
def main(caller=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60),
                            device_id=device if use_cuda else None)
    rank = dist.get_rank()
    if args.replicate > 1:
        mesh = init_device_mesh(device.type, (args.replicate, SHARD), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (WORLD,))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
              for _ in range(args.layers)]
    model = nn.Sequential(*blocks, nn.Linear(args.dim, 1)).to(device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "opt": opt}
    start = cm.restore(state) or 0
    if rank == 0 and start:
        print(f"generation {caller.iteration}: resumed at step {start}", flush=True)
    loss = None
    for step in range(start, args.steps):
        caller.progress(step)
        g = torch.Generator().manual_seed(100_003 * step + rank)   # every rank its own data
        x = torch.randn(32, args.dim, generator=g).to(device)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.01)
        opt.zero_grad()
        loss.backward()
        opt.step()
        cm.save(step + 1, state)
        if rank == 0 and step % 50 == 0:
            print(f"generation {caller.iteration} step {step} loss {loss.item():.5f}", flush=True)
    # release the model and the last tensors before the group: a gloo thread must not free a tensor while
    # Python exits (torch 2.13 can abort the process then)
    del state, model, opt, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    wait_rank()
    main()
