"""MMAP data cache benchmark (issue 5, "Measure"): time to the first batch after a restart, MMAP resume vs
rebuilding a multi-worker DataLoader, and the steady-state throughput cost of the cache.

The dataset is real work, made once at start in a temporary directory: --images compressed .npz files of
uint8 images (smooth patterns plus noise, so zlib has something to inflate). A sample is decoded from its
file (np.load: zlib inflate) and augmented with torch ops seeded by (index, epoch): a random resized crop
(bilinear interpolation to --crop), horizontal flip, brightness jitter, normalisation to float32 (or kept
uint8 with --uint8). Batches of --batch through a DataLoader with --workers worker processes over a
ResumableSampler. Both sides run in this one invocation, alternating, --runs times each; medians reported.

1. Restart, in the same process (an in-process restart): the stream is at step --restart-step when the
   fault hits; the previous DataLoader's workers are ended as HPWrapper's finalize does. Measured from
   "rebuild the data pipeline" to "first batch in hand and read" (its tensors summed):
   - baseline: a new Dataset + DataLoader(--workers) positioned at the step (ResumableSampler.resume_from),
     iter(), next();
   - MMAP: a new MMAPDataLoader over a new DataLoader, iter_from(step), next(): the batch is in the cache.
2. Restart in a new process (a respawned rank): the same, measured inside a fresh Python process after its
   imports; the MMAP side finds the files the previous process left.
3. Steady state: --steps batches after --warmup, the consumer sums every batch (so every page is read);
   batches per second of the bare DataLoader vs MMAPDataLoader over the same DataLoader (a cold cache each
   run). Overhead = 1 - MMAP / bare, median of the paired runs.

    .venv/bin/python scripts/bench/mmap_bench.py --json mmap.json --md mmap.md
"""
from __future__ import annotations

import argparse
import json
import warnings
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from hyperpodrun.data import CacheResumeMMAPConfig, MMAPDataLoader, ResumableSampler, storage
from hyperpodrun.data import loader as mmap_loader
from hyperpodrun.runtime.abort import CheckpointlessFinalizeCleanup


# ------------------------------------------------------------------------------------------ the dataset
def make_images(directory: str, count: int, side: int) -> None:
    os.makedirs(directory, exist_ok=True)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, side), torch.linspace(0, 1, side), indexing="ij")
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        freq = torch.rand(3, 2, generator=g) * 12
        base = torch.stack([torch.sin(xx * freq[c, 0] + yy * freq[c, 1] + c) for c in range(3)])
        img = ((base + 1) * 110 + torch.randint(0, 24, (3, side, side), generator=g)).clamp(0, 255).to(torch.uint8)
        np.savez_compressed(os.path.join(directory, f"img{i:05d}.npz"), img=img.numpy())


class NpzImages(Dataset):
    """Decode + augment, deterministic in (index, epoch)."""

    def __init__(self, directory: str, crop: int, uint8: bool) -> None:
        self.files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".npz"))
        self.crop, self.uint8, self.epoch = crop, uint8, 0
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        with np.load(self.files[i]) as npz:
            img = torch.from_numpy(npz["img"])
        g = torch.Generator().manual_seed(i * 7919 + self.epoch)
        side = img.shape[-1]
        size = int(side * (0.5 + 0.5 * float(torch.rand((), generator=g))))
        top, left = (int(v) for v in torch.randint(0, side - size + 1, (2,), generator=g))
        x = img[:, top:top + size, left:left + size].unsqueeze(0).float()
        x = F.interpolate(x, size=(self.crop, self.crop), mode="bilinear", align_corners=False)[0]
        if float(torch.rand((), generator=g)) < 0.5:
            x = x.flip(-1)
        x = x * (0.8 + 0.4 * float(torch.rand((), generator=g)))
        x = x.clamp(0, 255).to(torch.uint8) if self.uint8 else (x - self.mean) / self.std
        return {"image": x, "label": i % 100}


# ------------------------------------------------------------------------------------------ helpers
def pipeline(args: argparse.Namespace) -> DataLoader:
    ds = NpzImages(args.data, args.crop, args.uint8)
    return DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                      sampler=ResumableSampler(ds, seed=0), drop_last=True)


def bare_stream(dl: DataLoader) -> Any:
    """The bare DataLoader over epochs, as a training loop iterates it (set_epoch, then a new iterator)."""
    epoch = 0
    while True:
        dl.sampler.set_epoch(epoch)
        dl.dataset.set_epoch(epoch)
        yield from dl
        epoch += 1


def touch(batch: dict) -> float:
    """Read every byte of the batch's images (what a copy to the GPU would do), whatever their dtype."""
    return float(batch["image"].max())


def config(args: argparse.Namespace, cache: str) -> CacheResumeMMAPConfig:
    return CacheResumeMMAPConfig(cache_dir=cache, prefetch_length=args.prefetch, lookback_length=2)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def warm_cache(args: argparse.Namespace, cache: str) -> None:
    """A stream that reached --restart-step with a full window, then the fault (the stream is abandoned)."""
    mm = MMAPDataLoader(pipeline(args), config(args, cache))
    for step, batch in mm.iter_from(0):
        touch(batch)
        if step == args.restart_step:
            last = os.path.join(mm.group_dir, f"b{step + args.prefetch - 1:012d}.batch")
            wait_for(lambda: os.path.exists(last), 120, "the window to fill")
            break


def baseline_first_batch(args: argparse.Namespace) -> tuple[float, float]:
    """(seconds until next() returned, until the batch was also read) for a rebuilt DataLoader."""
    t0 = time.perf_counter()
    dl = pipeline(args)
    per_epoch = len(dl)
    epoch, index = divmod(args.restart_step, per_epoch)
    dl.sampler.set_epoch(epoch)
    dl.dataset.set_epoch(epoch)
    dl.sampler.resume_from(epoch, index * args.batch)
    it = iter(dl)
    batch = next(it)
    t1 = time.perf_counter()
    touch(batch)
    t2 = time.perf_counter()
    del it
    return t1 - t0, t2 - t0


def mmap_first_batch(args: argparse.Namespace, cache: str) -> tuple[float, float]:
    """The same for a new MMAPDataLoader over a new DataLoader, resuming from the cache."""
    t0 = time.perf_counter()
    mm = MMAPDataLoader(pipeline(args), config(args, cache))
    step, batch = next(mm.iter_from(args.restart_step))
    t1 = time.perf_counter()
    touch(batch)
    t2 = time.perf_counter()
    assert step == args.restart_step and mm.stats["cached"] == 1, mm.stats
    mm.close()
    return t1 - t0, t2 - t0


def end_children() -> None:
    CheckpointlessFinalizeCleanup(timeout=5).end_children()


def child_env(run_id: str) -> dict[str, str]:
    return dict(os.environ, TORCHELASTIC_RUN_ID=run_id, HYPERPODRUN_AGENT_PID=str(os.getpid()), RANK="0")


# ------------------------------------------------------------------------------------------ scenarios
def restart_in_process(args: argparse.Namespace, root: str) -> dict[str, list]:
    out: dict[str, list] = {"baseline": [], "mmap": []}
    for run in range(args.runs):
        # baseline: the old pipeline ran to the step, the fault ends its workers, a new one is built
        dl = pipeline(args)
        it = iter(dl)
        for _ in range(3):
            touch(next(it))
        end_children()
        del it, dl
        out["baseline"].append(baseline_first_batch(args))
        cache = os.path.join(root, f"inproc{run}")
        warm_cache(args, cache)
        end_children()
        out["mmap"].append(mmap_first_batch(args, cache))
        mmap_loader.shutdown()
        end_children()
        shutil.rmtree(cache, ignore_errors=True)
        print(f"  restart in-process run {run}: baseline {out['baseline'][-1][0] * 1e3:.1f} ms "
              f"(read {out['baseline'][-1][1] * 1e3:.1f}), MMAP {out['mmap'][-1][0] * 1e3:.2f} ms "
              f"(read {out['mmap'][-1][1] * 1e3:.2f})", flush=True)
    return out


def restart_new_process(args: argparse.Namespace, root: str) -> dict[str, list]:
    out: dict[str, list] = {"baseline": [], "mmap": []}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in (("data", args.data), ("crop", args.crop),
                   ("batch", args.batch), ("workers", args.workers), ("prefetch", args.prefetch),
                   ("restart_step", args.restart_step))] + (["--uint8"] if args.uint8 else [])
    for run in range(args.runs):
        run_id = f"bench{run}"
        os.environ.update(TORCHELASTIC_RUN_ID=run_id, HYPERPODRUN_AGENT_PID=str(os.getpid()), RANK="0")
        cache = os.path.join(root, f"newproc{run}")
        warm_cache(args, cache)
        end_children()
        mmap_loader.shutdown()       # the process that held the stream is gone: its producer lock is free
        for side in ("baseline", "mmap"):
            res = subprocess.run([sys.executable, __file__, "--child", side, f"--cache={cache}", *passthrough],
                                 env=child_env(run_id), capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise SystemExit(f"child {side} failed:\n{res.stderr[-3000:]}")
            out[side].append(tuple(json.loads(res.stdout.strip().splitlines()[-1])["seconds"]))
        shutil.rmtree(cache, ignore_errors=True)
        print(f"  restart new process run {run}: baseline {out['baseline'][-1][0] * 1e3:.1f} ms "
              f"(read {out['baseline'][-1][1] * 1e3:.1f}), MMAP {out['mmap'][-1][0] * 1e3:.2f} ms "
              f"(read {out['mmap'][-1][1] * 1e3:.2f})", flush=True)
    for key in ("TORCHELASTIC_RUN_ID", "HYPERPODRUN_AGENT_PID", "RANK"):
        os.environ.pop(key, None)
    return out


def write_cost(args: argparse.Namespace, root: str) -> float:
    """Median seconds the producer spends on one batch of this shape (reserve + write + rename, tmpfs)."""
    batch = next(iter(pipeline(args)))
    end_children()
    took = []
    for i in range(15):
        tmp, final = os.path.join(root, f".w{i}.tmp"), os.path.join(root, f"w{i}.batch")
        t0 = time.perf_counter()
        storage.write_batch(tmp, batch, {"step": i})
        storage.commit(tmp, final)
        took.append(time.perf_counter() - t0)
        os.unlink(final)
    return statistics.median(took)


def steady_state(args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"baseline": [], "mmap": []}

    def measure(batches: Any) -> float:
        for _ in range(args.warmup):
            touch(next(batches))
        t0 = time.perf_counter()
        for _ in range(args.steps):
            touch(next(batches))
        return args.steps / (time.perf_counter() - t0)

    for run in range(args.runs):
        order = ("baseline", "mmap") if run % 2 == 0 else ("mmap", "baseline")
        for side in order:
            if side == "baseline":
                out[side].append(measure(bare_stream(pipeline(args))))
            else:
                cache = os.path.join(root, f"steady{run}")
                mm = MMAPDataLoader(pipeline(args), config(args, cache))
                out[side].append(measure(b for _, b in mm.iter_from(0)))
                mmap_loader.shutdown()
                shutil.rmtree(cache, ignore_errors=True)
            end_children()
        print(f"  steady state run {run}: bare {out['baseline'][-1]:.2f} batches/s, MMAP {out['mmap'][-1]:.2f} "
              "batches/s", flush=True)
    return out


# ------------------------------------------------------------------------------------------ main
def child(args: argparse.Namespace) -> None:
    """A new process (a respawned rank): time its first batch after its imports."""
    took = baseline_first_batch(args) if args.child == "baseline" else mmap_first_batch(args, args.cache)
    print(json.dumps({"seconds": took}))
    mmap_loader.shutdown()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--side", type=int, default=256, help="stored image side (pixels)")
    p.add_argument("--crop", type=int, default=224, help="augmented image side (pixels)")
    p.add_argument("--uint8", action="store_true", help="keep augmented images uint8 (no float normalisation)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=10)
    p.add_argument("--restart-step", type=int, default=5)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="timed batches per steady-state run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--scenarios", default="restart,steady", help="restart, steady or both (comma-separated)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("baseline", "mmap"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def summary(name: str, values: dict[str, list[float]], unit: str, scale: float) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in values.items()}
    return {"scenario": name, "unit": unit, "baseline_median": med["baseline"] * scale,
            "mmap_median": med["mmap"] * scale, "baseline_runs": [v * scale for v in values["baseline"]],
            "mmap_runs": [v * scale for v in values["mmap"]]}


def main() -> None:
    args = parse()
    warnings.filterwarnings("ignore", message="This DataLoader will create")   # 4 workers on a 2-core machine
    torch.set_num_threads(1)
    if args.child:
        child(args)
        return
    root = tempfile.mkdtemp(prefix="mmap-bench-")
    cache_root = tempfile.mkdtemp(prefix="mmap-bench-cache-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        args.data = os.path.join(root, "images")
        t0 = time.perf_counter()
        make_images(args.data, args.images, args.side)
        sample_ms = statistics.median(_time_sample(args) for _ in range(20)) * 1e3
        print(f"dataset: {args.images} .npz images of 3x{args.side}x{args.side} made in {time.perf_counter() - t0:.1f}s; "
              f"one sample decodes + augments in {sample_ms:.2f} ms", flush=True)
        load0 = os.getloadavg()
        results = []
        if "restart" in args.scenarios:
            for name, runs in (("restart, same process", restart_in_process(args, cache_root)),
                               ("restart, new process", restart_new_process(args, cache_root))):
                for i, what in enumerate(("first batch returned", "first batch returned and read")):
                    results.append(summary(f"{name}: {what}", {k: [v[i] for v in vs] for k, vs in runs.items()},
                                           "ms", 1e3))
        paired: list[float] = []
        write_s = write_cost(args, cache_root)
        if "steady" in args.scenarios:
            steady = steady_state(args, cache_root)
            results.append(summary("steady state", steady, "batches/s", 1.0))
            paired = [1 - m / b for b, m in zip(steady["baseline"], steady["mmap"])]
        load1 = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cache_root, ignore_errors=True)
    report = {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1},
        "settings": {k: v for k, v in vars(args).items() if k not in ("data", "child", "cache", "json", "md")},
        "sample_ms": sample_ms, "results": results, "producer_write_ms_per_batch": write_s * 1e3,
        "restart_speedups": {r["scenario"]: r["baseline_median"] / r["mmap_median"] for r in results
                             if r["unit"] == "ms"},
        "steady_overhead_paired_median": statistics.median(paired) if paired else None,
        "steady_overhead_of_medians": (1 - results[-1]["mmap_median"] / results[-1]["baseline_median"])
        if paired else None,
    }
    md = render(report)
    print(md)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)


def _time_sample(args: argparse.Namespace) -> float:
    ds = NpzImages(args.data, args.crop, args.uint8)
    t0 = time.perf_counter()
    ds[int(time.perf_counter_ns() % len(ds))]
    return time.perf_counter() - t0


def render(r: dict) -> str:
    lines = ["| scenario | bare DataLoader (median) | MMAP cache (median) | ratio |", "|---|---|---|---|"]
    for res in (x for x in r["results"] if x["unit"] == "ms"):
        lines.append(f"| {res['scenario']} | {res['baseline_median']:.1f} ms | {res['mmap_median']:.2f} ms | "
                     f"{res['baseline_median'] / res['mmap_median']:.0f}x faster |")
    steady = [x for x in r["results"] if x["unit"] != "ms"]
    st = steady[0] if steady else None
    if st is not None:
        lines.append(f"| steady state | {st['baseline_median']:.2f} batches/s | {st['mmap_median']:.2f} batches/s | "
                     f"overhead {100 * r['steady_overhead_paired_median']:.1f} % (paired median; "
                     f"{100 * r['steady_overhead_of_medians']:.1f} % of the medians) |")
    lines.append(f"\nThe producer spends {r['producer_write_ms_per_batch']:.1f} ms of CPU per batch (reserve, write, "
                 f"rename: median of 15, measured alone); one sample takes {r['sample_ms']:.1f} ms to decode and augment.")
    runs = "; ".join(f"{res['scenario']}: bare {[round(v, 2) for v in res['baseline_runs']]}, "
                     f"MMAP {[round(v, 2) for v in res['mmap_runs']]}" for res in r["results"])
    return "\n".join(lines) + f"\n\nPer run: {runs}\n"


if __name__ == "__main__":
    main()
