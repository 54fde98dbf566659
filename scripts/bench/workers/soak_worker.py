"""Training worker of the chaos soak (scripts/bench/soak.py): a deterministic all-reduce loop under hyperpodrun
(HPWrapper + CheckpointManager with checksums: state in memory and on the other node) or under torchrun (a
`torch.save` checkpoint every CKPT_EVERY steps, reloaded after a restart), that trains until the harness says
at which step to stop and takes faults the harness hands it while it runs.

Why commands through files and not a schedule in the environment: the soak's faults come at wall-clock times
(a fault every ~30 s), on whatever step the job is at then, and some of them (a node lost, the coordinator
killed, a full log filesystem) are the harness's alone; a rank only does what cannot be done to it from
outside - raising an exception or a MemoryError.

Files in OUT_DIR (written by the worker unless said otherwise):
  cmd.rank<r>       (harness) `raise` or `oom`: taken (renamed away) at the top of the next step and done there
  stop              (harness) the step at which every rank ends training (the same number for every rank,
                    ahead of all of them)
  pid.rank<r>       this rank's pid in its node's pid namespace, its generation and its slot directory
  entries.rank<r>.jsonl  {"rank", "gen", "start", "t"} per (re)entry of the training function
  steps.rank<r>.jsonl    {"rank", "gen", "step", "t"} per completed step (t: wall clock after it)
  rank<r>.pt        at the end: parameters and optimizer state (tests/conftest.py assert_same_ckpt_state)
STEPS=N instead of `stop`: a fixed length (the fault-free replay). `gen` is caller.iteration under hyperpodrun
and TORCHELASTIC_RESTART_COUNT under torchrun.
"""
import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

OUT_DIR = os.environ["OUT_DIR"]
STEPS = int(os.environ["STEPS"]) if os.environ.get("STEPS") else None
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.1"))
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "10"))
DIM = int(os.environ.get("DIM", "64"))
HANG_S = float(os.environ.get("HANG_TIMEOUT", "30"))   # torchrun: the collectives' timeout finds a hung peer
UNDER = os.environ.get("UNDER", "hyperpodrun")


def _write(name: str, text: str) -> None:
    path = os.path.join(OUT_DIR, name)
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


def note(kind: str, rank: int, **fields) -> None:
    with open(os.path.join(OUT_DIR, f"{kind}.rank{rank}.jsonl"), "a") as fh:
        fh.write(json.dumps({"rank": rank, "t": time.time(), **fields}) + "\n")


def stop_at() -> int:
    if STEPS is not None:
        return STEPS
    try:
        with open(os.path.join(OUT_DIR, "stop")) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 1 << 60


def take_command(rank: int, step: int) -> None:
    """Do what the harness asked of this rank, once."""
    path = os.path.join(OUT_DIR, f"cmd.rank{rank}")
    taken = f"{path}.taken.{time.time_ns()}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return
    with open(taken) as fh:
        what = fh.read().strip()
    note("commands", rank, what=what, step=step)
    if what == "oom":
        bytearray(1 << 60)             # a real MemoryError: the allocation fails
    raise RuntimeError(f"injected exception at step {step}")


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model, opt, start: int, rank: int, world: int, gen: int, group, save) -> None:
    step = start
    while step < stop_at():
        take_command(rank, step)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, DIM, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)
        opt.step()
        step += 1
        save(step)
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        note("steps", rank, gen=gen, step=step)


def finish(model, opt, rank: int) -> None:
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ost = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
           for k, s in opt.state_dict()["state"].items()}
    torch.save({"model": full, "opt": ost}, os.path.join(OUT_DIR, f"rank{rank}.pt"))


def entered(rank: int, gen: int, start: int, slots: str = "") -> None:
    _write(f"pid.rank{rank}", f"{os.getpid()} {gen} {slots}\n")
    note("entries", rank, gen=gen, start=start)


def under_torchrun() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=datetime.timedelta(seconds=HANG_S))
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build()
    path = os.path.join(OUT_DIR, "ckpt", f"rank{rank}.pt")
    start = 0
    if os.path.exists(path):
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
    entered(rank, gen, start)

    def save(step: int) -> None:
        if step % CKPT_EVERY == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
    train(model, opt, start, rank, world, gen, group, save)
    finish(model, opt, rank)
    dist.destroy_process_group()


def under_hyperpodrun() -> None:
    from hyperpodrun import CheckpointManager, HPWrapper
    cm = CheckpointManager(enable_checksum=True)

    @HPWrapper(checkpoint_manager=cm, abort_timeout=30)
    def main(caller=None):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
        model, opt = build()
        state = {"model": model, "opt": opt}
        start = cm.restore(state) or 0
        entered(rank, caller.iteration, start, cm.slot_dir())

        def save(step: int) -> None:
            caller.progress(step)
            cm.save(step, state)
        train(model, opt, start, rank, world, caller.iteration, None, save)
        finish(model, opt, rank)
        model = opt = state = None     # the job's tensors go before the group
        gc.collect()
        dist.destroy_process_group()
    main()


if __name__ == "__main__":
    under_torchrun() if UNDER == "torchrun" else under_hyperpodrun()
