"""An HPWrapper job (gloo, CPU) that fails again and again, for the resource-hygiene tests.

Every generation below --restarts fails at step --fail-step + iteration (a different step each time, so the
step guard never stops the job): the failing rank is 1 + iteration % (world - 1) (rank 0 always survives in
its process), and it either raises (--kinds r) or leaves with os._exit (x), taking the kinds in turn. The
other ranks are then blocked in DDP's gradient all_reduce with it, so their groups have a collective in flight
when the restart comes. After the first all_reduce of each generation (and once the earlier generations'
groups are released), every rank appends
{"it", "pid", "threads", "fds", "rss_kb", "names"} to OUT/res<rank>.jsonl (what /proc/self says), and at the
end the generation that reaches --restarts returns normally.

--done-then-abort: after the job's last generation returned (the rank reported completion), rank 1 ends its
process with os.abort() (like gloo's teardown race in interpreter exit).
"""
import argparse
import collections
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import HPWrapper, wait_rank
from hyperpodrun.runtime.abort import join_releaser


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--restarts", type=int, default=20)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps of the last generation")
    p.add_argument("--kinds", default="r", help="fault kinds in turn: r = raise, x = os._exit(3)")
    p.add_argument("--done-then-abort", action="store_true")
    return p.parse_args()


ARGS = parse()
RANK = int(os.environ.get("RANK", "0"))


def resources() -> dict:
    tasks = os.listdir("/proc/self/task")
    names = collections.Counter()
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as fh:
                names[fh.read().strip()] += 1
        except OSError:
            pass
    rss = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"threads": len(tasks), "fds": len(os.listdir("/proc/self/fd")), "rss_kb": rss, "names": dict(names)}


def record(name: str, **fields) -> None:
    line = json.dumps({"pid": os.getpid(), **fields}) + "\n"
    fd = os.open(os.path.join(ARGS.out, f"{name}{RANK}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@HPWrapper()
def train(caller=None) -> None:
    it = caller.iteration
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    world = dist.get_world_size()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    t = torch.ones(8)
    dist.all_reduce(t)
    join_releaser(10)   # the earlier generations' groups are destructed in the background: measure after
    record("res", it=it, **resources())
    last = it >= ARGS.restarts
    steps = ARGS.steps if last else ARGS.fail_step + it + 1
    culprit = 1 + it % (world - 1)
    kind = ARGS.kinds[it % len(ARGS.kinds)]
    for step in range(steps):
        caller.progress(step)
        if not last and RANK == culprit and step == ARGS.fail_step + it:
            if kind == "x":
                sys.stdout.flush()
                os._exit(3)
            raise RuntimeError(f"injected failure in generation {it} at step {step}")
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()        # the others wait here for the failed rank's gradients
        opt.step()
    dist.barrier()
    del ddp, opt, loss, t      # nothing of the job's tensors may be left to gloo's threads at exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    wait_rank()
    train()
    record("end", t=time.time())
    sys.stdout.flush()
    if ARGS.done_then_abort and RANK == 1:
        os.abort()
