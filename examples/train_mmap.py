"""MMAP data cache example: after any restart the data stream resumes at the restored step at once.

    hyperpodrun --nproc-per-node 4 --inprocess-restart examples/train_mmap.py --steps 300
    hyperpodrun inject --rank 2 --kind kill --step 120     # in another shell: a fault at step 120

The training data goes through a regular DataLoader (worker processes, decoding and augmentation) wrapped
in MMAPDataLoader: a producer thread runs it ahead into /dev/shm and the loop maps batch `step` for step
`step`. On re-entry after a fault, CheckpointManager restores the model at the last completed step and
`loader.iter_from(start)` serves that step's batch from the cache, while the producer restarts the
DataLoader behind the cached batches (ResumableSampler positions it there; nothing is read twice).
Without hyperpodrun (`python examples/train_mmap.py`) it runs once as a single process.
"""
import argparse
import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from hyperpodrun import (CacheResumeMMAPConfig, CheckpointManager, CudaHealthCheck, HPWrapper, MMAPDataLoader,
                         ResumableSampler, wait_rank)


class SyntheticImages(Dataset):
    """Image-like samples that cost some CPU to make: a deterministic function of (index, epoch).

    Random augmentation draws from a generator seeded by the sample's index and the epoch, not from the
    global RNG: so the batch of a step is the same however the stream was resumed.
    """

    def __init__(self, size: int = 4096, side: int = 32) -> None:
        self.size, self.side, self.epoch = size, side, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        img = torch.randint(0, 256, (3, self.side + 8, self.side + 8), generator=g, dtype=torch.uint8)
        aug = torch.Generator().manual_seed(i * 1000 + self.epoch)
        top, left = (int(v) for v in torch.randint(0, 9, (2,), generator=aug))
        img = img[:, top:top + self.side, left:left + self.side]
        if torch.rand((), generator=aug) < 0.5:
            img = img.flip(-1)
        return {"image": img, "label": i % 10}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--cache-dir", default=None, help="default: /dev/shm/pdl_cache-<uid>")
    p.add_argument("--prefetch", type=int, default=10)
    return p.parse_args()


ARGS = parse()
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
data = SyntheticImages()
# built once per process: the wrapped function may run several times in it (in-process restarts)
loader = MMAPDataLoader(
    DataLoader(data, batch_size=ARGS.batch_size, num_workers=ARGS.workers,
               sampler=ResumableSampler(data, seed=0, num_replicas=WORLD, rank=RANK)),
    CacheResumeMMAPConfig(**({"cache_dir": ARGS.cache_dir} if ARGS.cache_dir else {}), prefetch_length=ARGS.prefetch,
                          lookback_length=2))
cm = CheckpointManager(enable_checksum=True)


@HPWrapper(checkpoint_manager=cm, health_check=CudaHealthCheck(timeout=30), abort_timeout=30.0)
def main(caller=None) -> None:
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=60),
                            device_id=device if use_cuda else None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(256, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = {"model": model, "opt": opt}
    start = cm.restore(state) or 0                 # None on a fresh start
    if RANK == 0:
        print(f"generation {caller.iteration}: training from step {start}", flush=True)
    loss = None
    for step, batch in loader.iter_from(start, stop=ARGS.steps):
        caller.progress(step)
        images = batch["image"].to(device, non_blocking=True).float().div_(255)
        loss = nn.functional.cross_entropy(ddp(images), batch["label"].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        cm.save(step + 1, state)                   # after the optimizer step: step + 1 steps are complete
        if RANK == 0 and step % 50 == 0:
            print(f"generation {caller.iteration} step {step} loss {loss.item():.4f} "
                  f"(batches from the cache {loader.stats['cached']}, direct {loader.stats['direct']})", flush=True)
    # release DDP and the last tensors before the group: a gloo thread must not free a tensor while
    # Python exits (torch 2.13 can abort the process then)
    del state, ddp, opt, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    wait_rank()
    main()
