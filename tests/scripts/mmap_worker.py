"""Worker of the MMAP cache job tests: a small gloo training loop whose data comes through MMAPDataLoader.

Deterministic data: sample i is built from a generator seeded with i (a uint8 "image", float features, a
label, a string); two data shards (shard = (rank // 2) % 2, as with tensor-parallel pairs), a
ResumableSampler per shard, 8 batches per epoch, so STEPS = 24 crosses two epoch boundaries. State (a linear model) is
saved with CheckpointManager after every step and restored on re-entry; the stream resumes at the
restored step.

Every consumed batch is recorded as one JSON line in OUT_DIR/rank<r>.jsonl:
  {"ev": "batch", "pid", "it", "step", "h": sha256 of the batch's bytes, "src": "cached" | "direct"}
and at the end {"ev": "done", "pid", "it", "stats", "seeks", "max_files", "max_bytes", "groups", "owner"}.
A process that re-entered or started for a later generation also records {"ev": "enter", "start", ...}.

Environment: OUT_DIR, CACHE_DIR, STEPS (24), FAULTS (';'-separated kind:rank:step[:gen], kind raise|kill,
fired after batch `step` was consumed, before the step is saved), SHARE=1 (share_key per data shard),
MAX_BYTES, PREFETCH (4), LOOKBACK (2), WORKERS (DataLoader workers, 0), STEP_SLEEP (seconds after each step, 0).
"""
import datetime
import gc
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from hyperpodrun import CacheResumeMMAPConfig, CheckpointManager, HPWrapper, MMAPDataLoader, ResumableSampler

OUT = os.environ.get("OUT_DIR", "")
STEPS = int(os.environ.get("STEPS", "24"))
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(";") if f]
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
RANK = int(os.environ.get("RANK", "0"))
cm = CheckpointManager()
loader = None   # built in __main__ (the tests import this module for Samples, sampler and digest)


class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"img": torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8),
                "feat": torch.randn(16, generator=g),
                "label": i % 10, "name": f"sample-{i}"}


def digest(obj, h):
    if isinstance(obj, torch.Tensor):
        h.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(obj.contiguous().view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj):
            h.update(str(k).encode())
            digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            digest(v, h)
    else:
        h.update(repr(obj).encode())
    return h


def record(ev, **fields):
    line = json.dumps({"ev": ev, "pid": os.getpid(), "t": round(time.time(), 3), **fields}) + "\n"
    with open(os.path.join(OUT, f"rank{RANK}.jsonl"), "a") as fh:
        fh.write(line)


def maybe_fault(step, generation):
    for kind, frank, fstep, *gen in FAULTS:
        if int(frank) == RANK and int(fstep) == step and int(gen[0] if gen else 0) == generation:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault at step {step}")


def data_loader(rank, workers=0):
    """The bare DataLoader of `rank`: 2 shards whatever the world size (shard = (rank // 2) % 2)."""
    ds = Samples()
    return DataLoader(ds, batch_size=4, sampler=ResumableSampler(ds, seed=7, num_replicas=2, rank=(rank // 2) % 2),
                      num_workers=workers)


def build_loader():
    config = CacheResumeMMAPConfig(
        cache_dir=os.environ["CACHE_DIR"], prefetch_length=int(os.environ.get("PREFETCH", "4")),
        lookback_length=int(os.environ.get("LOOKBACK", "2")),
        share_key=f"dp{RANK // 2}" if os.environ.get("SHARE") == "1" else None,
        max_bytes=int(os.environ["MAX_BYTES"]) if os.environ.get("MAX_BYTES") else None, wait_timeout=60)
    return MMAPDataLoader(data_loader(RANK, int(os.environ.get("WORKERS", "0"))), config)


@HPWrapper(checkpoint_manager=cm, abort_timeout=30)
def main(caller=None):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "opt": opt}
    start = cm.restore(state) or 0
    record("enter", it=caller.iteration, start=start)
    max_files = max_bytes = groups = 0
    cached = loader.stats["cached"]
    for step, batch in loader.iter_from(start, stop=STEPS):
        caller.progress(step)
        src = "cached" if loader.stats["cached"] > cached else "direct"
        cached = loader.stats["cached"]
        record("batch", it=caller.iteration, step=step, h=digest(batch, hashlib.sha256()).hexdigest(), src=src)
        if loader.group_dir and os.path.isdir(loader.group_dir):
            sizes = []
            for entry in os.scandir(loader.group_dir):
                if entry.name.endswith(".batch"):
                    try:
                        sizes.append(entry.stat().st_size)
                    except FileNotFoundError:   # the producer deleted it meanwhile
                        pass
            max_files, max_bytes = max(max_files, len(sizes)), max(max_bytes, sum(sizes))
            run_dir = os.path.dirname(loader.group_dir)
            groups = max(groups, len([d for d in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, d))]))
        maybe_fault(step, caller.iteration)
        loss = model(batch["feat"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        cm.save(step + 1, state)
        if STEP_SLEEP:   # a slower job, so that a test can act while it trains
            time.sleep(STEP_SLEEP)
    producer = loader.producer
    record("done", it=caller.iteration, stats=loader.stats, seeks=producer.seeks if producer else None,
           owner=producer is not None, max_files=max_files, max_bytes=max_bytes, groups=groups)
    # the job's tensors go before the group: a gloo thread must not free one while Python exits
    model = opt = state = loss = batch = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    loader = build_loader()
    main()
