"""Training worker of the node-loss benchmark (scripts/bench/node_loss.py): the same all-reduce loop under
hyperpodrun (HPWrapper + CheckpointManager: state in memory and on the other node) and under torchrun (a
`torch.save` checkpoint every CKPT_EVERY steps, reloaded after a restart).

Every completed step appends {"rank", "gen", "step", "t"} to OUT_DIR/steps.rank<r>.jsonl (t: wall clock after
the step); DDP=1 wraps the model in DDP (the elastic scenarios: state restored at another world size); every (re)start of the training function appends {"rank", "gen", "start", "t"} to
OUT_DIR/entries.rank<r>.jsonl. `gen` is caller.iteration under hyperpodrun and TORCHELASTIC_RESTART_COUNT
under torchrun.
"""
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

OUT_DIR = os.environ["OUT_DIR"]
STEPS = int(os.environ.get("STEPS", "80"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "10"))
DIM = int(os.environ.get("DIM", "64"))
UNDER = os.environ.get("UNDER", "hyperpodrun")
DDP = os.environ.get("DDP") == "1"       # DDP instead of the hand-written all-reduce (elastic scenarios)


def note(kind: str, rank: int, **fields) -> None:
    with open(os.path.join(OUT_DIR, f"{kind}.rank{rank}.jsonl"), "a") as fh:
        fh.write(json.dumps({"rank": rank, "t": time.time(), **fields}) + "\n")


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))
    if DDP:
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_steps(model, opt, start: int, rank: int, world: int, gen: int, save) -> None:
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, DIM, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters() if not DDP else ():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
        save(step + 1)
        time.sleep(STEP_SLEEP)
        note("steps", rank, gen=gen, step=step + 1)


def under_torchrun() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt = build()
    path = os.path.join(OUT_DIR, "ckpt", f"rank{rank}.pt")
    start = 0
    if os.path.exists(path):
        ck = torch.load(path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
    note("entries", rank, gen=gen, start=start)

    def save(step: int) -> None:
        if step % CKPT_EVERY == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
    train_steps(model, opt, start, rank, world, gen, save)
    dist.destroy_process_group()


def under_hyperpodrun() -> None:
    from hyperpodrun import CheckpointManager, HPWrapper
    cm = CheckpointManager()

    @HPWrapper(checkpoint_manager=cm, abort_timeout=30)
    def main(caller=None):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
        model, opt = build()
        state = {"model": model, "opt": opt}
        start = cm.restore(state) or 0
        note("entries", rank, gen=caller.iteration, start=start)

        def save(step: int) -> None:
            caller.progress(step)
            cm.save(step, state)
        train_steps(model, opt, start, rank, world, caller.iteration, save)
        model = opt = state = None
        dist.destroy_process_group()
    main()


if __name__ == "__main__":
    under_torchrun() if UNDER == "torchrun" else under_hyperpodrun()
