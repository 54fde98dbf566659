"""The worker of scripts/bench/gpu/gpu_health.py: an NCCL all-reduce loop under HPWrapper that records which GPU it is on.

Generation 0 trains until a fault moves the job on (a cap of --cap seconds ends it with exit 97); every later
generation trains --steps steps and returns. One JSON line per record in OUT/rank<r>.jsonl:
  {"ev": "start", "pid", "gen0", "cvd", "uuid", "pci"}   the process started; its CUDA device (torch's view)
  {"ev": "step", "pid", "it", "step"}                     every 10th step of generation 0
  {"ev": "done", "pid", "it", "step"}                     the function returned
The host waits for each step by polling a CUDA event from Python, so a RESTART interrupt can land while a
collective whose peer died is still pending (the runtime aborts the communicators too).
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
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))


def record(ev: str, **fields) -> None:
    with open(os.path.join(ARGS.out, f"rank{RANK}.jsonl"), "a") as fh:
        fh.write(json.dumps({"ev": ev, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


def wait_gpu() -> None:
    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        time.sleep(0.0005)


@HPWrapper()
def train(caller=None) -> None:
    dist.init_process_group("nccl", device_id=torch.device("cuda", LOCAL_RANK),
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1 << 20, device="cuda")
    steps = ARGS.steps if caller.iteration > 0 else None
    end = time.monotonic() + ARGS.cap
    step = 0
    while steps is None or step < steps:
        if steps is None and time.monotonic() > end:
            record("cap", it=caller.iteration, step=step)
            os._exit(97)
        caller.progress(step)
        dist.all_reduce(x)
        wait_gpu()
        x.fill_(1.0)
        time.sleep(0.02)
        step += 1
        if steps is None and step % 10 == 0:
            record("step", it=caller.iteration, step=step)
    dist.destroy_process_group()
    record("done", it=caller.iteration, step=step)


if __name__ == "__main__":
    torch.cuda.set_device(LOCAL_RANK)
    props = torch.cuda.get_device_properties(LOCAL_RANK)
    uuid = str(props.uuid)
    try:
        pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:   # older torch
        pci = None
    record("start", gen0=int(os.environ.get("HYPERPODRUN_GENERATION", "0")),
           cvd=os.environ.get("CUDA_VISIBLE_DEVICES"), uuid=uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
           pci=pci)
    wait_rank()
    train()
    os._exit(0)   # skip the interpreter's teardown of torch
