"""A script that creates its process group at import time, before HPWrapper (as a Hugging Face
`TrainingArguments` built at module level does), then trains in an HPWrapper function with that group.

Each step appends {"ev": "step", "pid", "it", "step"} to OUT/rank<r>.jsonl once per 10 steps; generation 0 trains until
--cap seconds have passed (a test injects a fault meanwhile), a later generation --steps steps.
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from hyperpodrun import HPWrapper, wait_rank

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--cap", type=float, default=60.0)
ARGS = p.parse_args()
RANK = int(os.environ["RANK"])

wait_rank()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))   # the mistake under test


def record(**fields) -> None:
    with open(os.path.join(ARGS.out, f"rank{RANK}.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


@HPWrapper()
def train(caller=None) -> None:
    t = torch.ones(4)
    end = time.monotonic() + ARGS.cap
    step = 0
    while (caller.iteration == 0 and time.monotonic() < end) or step < ARGS.steps:
        caller.progress(step)
        dist.all_reduce(t)
        t.fill_(1.0)
        time.sleep(0.01)
        step += 1
        if step % 10 == 0:
            record(ev="step", it=caller.iteration, step=step)


if __name__ == "__main__":
    train()
    os._exit(0)
