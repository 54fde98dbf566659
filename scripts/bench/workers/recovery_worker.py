"""The training job of the side-by-side recovery benchmark (scripts/bench/recovery.py), one script for every
system, so that the same model, optimizer, batch and steps run under each (SYSTEM):

  torchrun       a torch.save checkpoint every CKPT_EVERY steps, reloaded when torchrun starts it again
  hpr-process    the same, under hyperpodrun --max-restarts (process level)
  hpr-inprocess  HPWrapper + CheckpointManager (state in memory; OFFLOAD=1: the copy overlaps the next step;
                 with STAGED=1 too, through device buffers: stage_on_device=True),
                 under hyperpodrun --inprocess-restart; model and optimizer outside the wrapped function
  nvrx           NVIDIA Resiliency Extension's inprocess.Wrapper as its basic example starts it (a fresh
                 TCPStore per iteration, the model built in the wrapped function, a torch.save checkpoint every
                 CKPT_EVERY steps reloaded on every iteration), under torchrun

Faults (FAULT_KIND kill|raise|hang; FAULT_STEPS a comma-separated step per fault, fault k fires in the k-th
generation of the job - restarts + in-process iterations - on rank FAULT_RANKS[k]): the victim records
{"t", "step", "fault", "rank", "k"} in OUT_DIR/faults.jsonl right before it SIGKILLs itself, raises, or sleeps
forever (hang). Every completed step appends {"rank", "step", "gen", "t"} to OUT_DIR/steps.rank<r>.jsonl;
every (re)start of the training loop appends {"rank", "gen", "start", "t"} to OUT_DIR/entries.rank<r>.jsonl;
checkpoint saves append their duration to OUT_DIR/saves.rank<r>.jsonl.

Model: DIM x DIM MLP of LAYERS layers, Adam, DDP; DEVICE cpu (gloo) or cuda (NCCL, bf16 parameters).
Parameters and batches are made on DEVICE: the parameters are initialised there (seed 0; on cuda in fp32, then cast to
bf16) and each step's batch comes from a generator on DEVICE seeded with 1000 * step + RANK, so a step's data
depends only on (step, rank) - the same across restarts and across systems - and a GPU run spends neither CPU
init time nor a host-to-device copy per step on it.
"""
import datetime
import json
import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

SYSTEM = os.environ.get("SYSTEM", "torchrun")
OUT = os.environ["OUT_DIR"]
STEPS = int(os.environ.get("STEPS", "60"))
DIM = int(os.environ.get("DIM", "256"))
LAYERS = int(os.environ.get("LAYERS", "4"))
BATCH = int(os.environ.get("BATCH", "32"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "10"))
KIND = os.environ.get("FAULT_KIND", "")
FAULT_STEPS = [int(s) for s in os.environ.get("FAULT_STEPS", "").split(",") if s]
FAULT_RANKS = [int(s) for s in os.environ.get("FAULT_RANKS", "").split(",") if s]
DEVICE = os.environ.get("DEVICE", "cpu")
PG_TIMEOUT = float(os.environ.get("PG_TIMEOUT", "10"))
RANK = int(os.environ.get("RANK", "0"))
CKPT = os.path.join(os.environ.get("CKPT_DIR") or OUT, "ckpt.pt")


def note(kind: str, **fields) -> None:
    with open(os.path.join(OUT, f"{kind}.rank{RANK}.jsonl" if kind != "faults" else "faults.jsonl"), "a") as fh:
        fh.write(json.dumps({"rank": RANK, "t": time.time(), **fields}) + "\n")


def device() -> torch.device:
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda")
    return torch.device("cpu")


def build_model(dev: torch.device):
    torch.manual_seed(0)
    layers = []
    with dev:                  # parameters created and initialised on the device (no CPU init, no copy)
        for _ in range(LAYERS):
            layers += [nn.Linear(DIM, DIM), nn.GELU()]
    model = nn.Sequential(*layers)
    if DEVICE == "cuda":
        model = model.to(torch.bfloat16)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def build(dev: torch.device):
    model, opt = build_model(dev)
    return model, nn.parallel.DistributedDataParallel(model), opt


def maybe_fault(step: int, gen: int) -> None:
    if gen >= len(FAULT_STEPS) or step != FAULT_STEPS[gen] or RANK != FAULT_RANKS[gen % len(FAULT_RANKS)]:
        return
    note("faults", step=step, fault=KIND, k=gen)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "hang":
        while True:            # a hang in Python: no step, no collective (the peers wait in theirs)
            time.sleep(1)
    raise RuntimeError(f"injected fault {gen} at step {step}")


def train(ddp, opt, start: int, gen: int, dev: torch.device, save, progress=lambda step: None) -> None:
    for step in range(start, STEPS):
        progress(step)
        maybe_fault(step, gen)
        g = torch.Generator(device=dev).manual_seed(1000 * step + RANK)
        x = torch.randn(BATCH, DIM, generator=g, device=dev, dtype=next(ddp.parameters()).dtype)
        loss = ddp(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        save(step + 1)
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        note("steps", step=step + 1, gen=gen)


def disk_save(model, opt, step: int) -> None:
    """The disk checkpoint of the process-level systems: rank 0 writes it (DDP: every rank holds the same)."""
    if step % CKPT_EVERY or step == STEPS:
        return
    t0 = time.time()
    dist.barrier()
    if RANK == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)
    dist.barrier()
    note("saves", s=time.time() - t0, step=step)


def disk_load(model, opt) -> int:
    if not os.path.exists(CKPT):
        return 0
    ck = torch.load(CKPT, map_location="cpu")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    return int(ck["step"])


def process_level() -> None:
    dev = device()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, ddp, opt = build(dev)
    start = disk_load(model, opt)
    note("entries", gen=gen, start=start)
    train(ddp, opt, start, gen, dev, lambda step: disk_save(model, opt, step))
    dist.destroy_process_group()


def hyperpodrun_inprocess() -> None:
    """The model and optimizer are built once per process, outside the re-executed function: a surviving rank
    keeps them (on the GPU), and restore() leaves them as they are when they are still at the restored step
    (CheckpointManager's reuse_live). Only DDP, which holds the process group, is made again per generation."""
    note("tops", phase="top")           # where the script's own top spends a replacement's time to READY
    from hyperpodrun import CheckpointManager, HPWrapper
    offload = os.environ.get("OFFLOAD") == "1"
    cm = CheckpointManager(enable_offload=offload, stage_on_device=offload and os.environ.get("STAGED") == "1")
    dev = device()
    model, opt = build_model(dev)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    note("tops", phase="built")

    @HPWrapper(checkpoint_manager=cm, abort_timeout=30)
    def main(caller=None):
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT))
        state = {"model": model, "opt": opt}
        note("tops", phase="entered", gen=caller.iteration)
        start = cm.restore(state) or 0
        note("entries", gen=caller.iteration, start=start, restored_from=cm.restored_from,
             restore_phases=cm.restore_phases)
        ddp = nn.parallel.DistributedDataParallel(model)   # after the restore: its broadcast changes nothing

        def save(step: int) -> None:
            cm.save(step, state)
        train(ddp, opt, start, caller.iteration, dev, save, caller.progress)
        ddp = state = None
        dist.destroy_process_group()
    main()


def nvrx() -> None:
    import nvidia_resiliency_ext.inprocess as inprocess
    port = int(os.environ["MASTER_PORT"])
    soft = float(os.environ.get("NVRX_SOFT_TIMEOUT", "3"))
    first_iteration: dict = {}

    @inprocess.Wrapper(store_kwargs={"port": port + 1}, soft_timeout=datetime.timedelta(seconds=soft),
                       hard_timeout=datetime.timedelta(seconds=soft + 2),
                       last_call_wait=datetime.timedelta(seconds=float(os.environ.get("NVRX_LAST_CALL", "1"))))
    def main(call_wrapper: Optional[inprocess.CallWrapper] = None):   # NVRx injects it by this annotation
        assert call_wrapper is not None
        dev = device()
        world = int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=port + 2 + call_wrapper.iteration,
                              world_size=world, is_master=RANK == 0, multi_tenant=True, wait_for_workers=True,
                              use_libuv=True)
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=store, rank=RANK, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT))
        model, ddp, opt = build(dev)
        start = disk_load(model, opt)
        # NVRx numbers its iterations from 0 (0.4) or 1 (0.7): count from the first one this process saw
        first_iteration.setdefault("it", call_wrapper.iteration)
        gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + call_wrapper.iteration - first_iteration["it"]
        note("entries", gen=gen, start=start)

        def save(step: int) -> None:
            if step % CKPT_EVERY or step == STEPS:
                return
            with call_wrapper.atomic():
                disk_save(model, opt, step)
        train(ddp, opt, start, gen, dev, save, lambda step: call_wrapper.ping())
        dist.destroy_process_group()
    main()


if __name__ == "__main__":
    {"torchrun": process_level, "hpr-process": process_level, "hpr-inprocess": hyperpodrun_inprocess,
     "nvrx": nvrx}[SYSTEM]()
