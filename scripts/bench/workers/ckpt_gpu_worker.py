"""Worker of the checkpointless GPU benchmark (run by `scripts/bench/gpu.sh checkpointless` under hyperpodrun).

--measure: steady-state step time of a >= 1B-parameter model with AdamW, DDP or FSDP2, in rounds of
  blocks without snapshots, with synchronous snapshots and with offloaded snapshots, all in one process
  (same GPUs, same clocks); also the time of one synchronous save (the copy), peak GPU memory and the
  shared memory the slots take. Rank 0 writes the figures as JSON to --out.
--fault-step N: train under --inprocess-restart and SIGKILL rank 1 at step N of the first generation;
  every rank reports how long restore() took (JSON lines in --out).
"""
import argparse
import datetime
import gc
import json
import os
import resource
import signal
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import CheckpointManager, HPWrapper

p = argparse.ArgumentParser()
p.add_argument("--strategy", choices=["ddp", "fsdp2"], required=True)
p.add_argument("--dim", type=int, default=8192)
p.add_argument("--layers", type=int, default=16)
p.add_argument("--tokens", type=int, default=16384, help="tokens (rows) per GPU per step")
p.add_argument("--block", type=int, default=6, help="steps per measured block")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--measure", action="store_true")
p.add_argument("--fault-step", type=int, default=-1)
p.add_argument("--steps", type=int, default=14)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.backends.cuda.matmul.allow_tf32 = True
cm = CheckpointManager()          # one set of slot files; the measurement toggles enable_offload per block


def build(device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)]).to(device)
    if args.strategy == "ddp":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        net = fully_shard(model)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-5, fused=True)


def step_fn(net, opt, x):
    loss = net(x).float().pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


@HPWrapper(checkpoint_manager=None if args.measure else cm, abort_timeout=60)
def main(caller=None):
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=device)
    rank = dist.get_rank()
    net, opt = build(device)
    nparams = sum(p.numel() for p in net.parameters())          # DTensor numel() is the global size
    state = {"model": net, "opt": opt}
    x = torch.randn(args.tokens, args.dim, device=device)
    if args.measure:
        measure(net, opt, x, state, rank, nparams)
    else:
        train(net, opt, x, state, rank, caller)
    # release the model and the last tensors before the group: a gloo thread must not free a tensor while Python
    # exits (torch 2.13 can abort the process then)
    del net, opt, state, x
    gc.collect()
    dist.destroy_process_group()


def timed_block(net, opt, x, state, mode, start):
    cm_ = None if mode == "none" else cm
    cm.enable_offload = mode == "offload"
    times = []
    stream = torch.cuda.current_stream()
    for i in range(args.block):
        stream.synchronize()          # the training stream only: an offloaded copy may still run
        t0 = time.perf_counter()
        step_fn(net, opt, x)
        if cm_ is not None:
            cm_.save(start + i + 1, state)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    if cm_ is not None:
        cm_.wait()
    return times


def measure(net, opt, x, state, rank, nparams):
    for _ in range(3):                                   # warm-up (also allocates the Adam state)
        step_fn(net, opt, x)
    for i in range(2):                                   # the first saves map and pin both slot files
        cm.save(i, state)
    cm.wait()
    torch.cuda.reset_peak_memory_stats()
    results = {"none": [], "sync": [], "offload": []}
    peak = {}
    step = 1
    for _ in range(args.rounds):
        for mode in ("none", "sync", "offload"):
            torch.cuda.reset_peak_memory_stats()
            results[mode] += timed_block(net, opt, x, state, mode, step)
            peak[mode] = torch.cuda.max_memory_allocated() / 2**30
            step += args.block
    copy_s = []
    cm.enable_offload = False
    for i in range(3):                                   # one synchronous save alone = the copy
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cm.save(step + i, state)
        copy_s.append(time.perf_counter() - t0)
    slot_bytes = sum(os.path.getsize(os.path.join(cm.slot_dir(), f)) for f in os.listdir(cm.slot_dir()))
    snap_bytes = slot_bytes / 2
    med = {k: statistics.median(v) for k, v in results.items()}
    out = {
        "rank": rank, "strategy": args.strategy, "params": nparams, "tokens_per_gpu": args.tokens,
        "step_s_median": med, "step_s_all": results,
        "overhead_pct": {k: 100 * (med[k] / med["none"] - 1) for k in ("sync", "offload")},
        "save_copy_s_median": statistics.median(copy_s), "snapshot_bytes_per_rank": snap_bytes,
        "copy_GiBps": snap_bytes / statistics.median(copy_s) / 2**30,
        "peak_gpu_GiB": peak, "host_maxrss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "shm_slots_GiB_per_rank": slot_bytes / 2**30,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(gathered, fh, indent=1)


def train(net, opt, x, state, rank, caller):
    t0 = time.perf_counter()
    start = cm.restore(state) or 0
    took = time.perf_counter() - t0
    with open(args.out, "a") as fh:
        fh.write(json.dumps({"rank": rank, "generation": caller.iteration, "pid": os.getpid(),
                             "restored_step": start, "restore_s": took, "t": time.time()}) + "\n")
    for s in range(start, args.steps):
        caller.progress(s)
        if caller.iteration == 0 and rank == 1 and s == args.fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
        step_fn(net, opt, x)
        cm.save(s + 1, state)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
