"""What the mandatory snapshot checksum costs: CheckpointManager.save with and without it, one process.

    python scripts/bench/ckpt_checksum_bench.py --mib 1024 --rounds 9 [--device cuda] [--out result.json]

The state is a stack of Linear layers with Adam (parameters + 2 moments: the snapshot is about 3x the
parameters). Saves with the checksum (as shipped: summed by threads while the copy runs) and without it (the summing
replaced by nothing) alternate, so both see the same memory, caches and clocks; a save "without" writes
a slot that would never be restored and exists only here. "checksum_alone" sums a complete slot (what
verifying one at restore costs). Prints medians as JSON (and writes them to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from hyperpodrun import CheckpointManager
from hyperpodrun.state.slots import slot_checksum
from hyperpodrun.state.slots import snapshot_io


class NoSums:
    """Stands in for the checksum threads in the saves "without" (bench only)."""

    def __init__(self, *_a: object) -> None:
        pass

    def start(self) -> "NoSums":
        return self

    def advance(self, _end: int) -> None:
        pass

    def cancel(self) -> None:
        pass

    def result(self) -> list:
        return []


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="parameter MiB (the snapshot is about 3x)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dim = int((args.mib * 2 ** 20 / 4 / args.layers) ** 0.5)
    device = torch.device(args.device)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(args.layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, dim, device=device)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt}
    real, real_sums = snapshot_io.checksum, snapshot_io.ChunkSums
    times: dict[str, list[float]] = {"with": [], "without": [], "checksum_alone": []}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        os.environ.setdefault("RANK", "0")
        cm = CheckpointManager(shm_dir=shm)
        cm.save(1, state)                                  # maps and sizes both slots
        cm.save(2, state)
        step = 3
        for _ in range(args.rounds):
            for mode in ("with", "without"):
                snapshot_io.checksum = real if mode == "with" else (lambda *_a, **_k: 0)
                snapshot_io.ChunkSums = real_sums if mode == "with" else NoSums
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                cm.save(step, state)
                times[mode].append(time.perf_counter() - t0)
                step += 1
            snapshot_io.checksum, snapshot_io.ChunkSums = real, real_sums
            path = os.path.join(cm.slot_dir(), f"slot{(step - 1) % 2}")
            data = cm._map(path)
            view = memoryview(data)
            size = os.path.getsize(path)
            hdr = snapshot_io.HEADER.unpack(bytes(view[:snapshot_io.HEADER.size]))
            t0 = time.perf_counter()
            real(view, hdr[1], hdr[4], hdr[5], hdr[6])
            times["checksum_alone"].append(time.perf_counter() - t0)
            del view, data
        cm.close(success=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs visible, {slot_checksum.crc_threads()} checksum threads",
        "torch": torch.__version__, "device": str(device), "snapshot_bytes": size, "rounds": args.rounds,
        "save_with_checksum_ms": round(med["with"] * 1e3, 1), "save_without_checksum_ms": round(med["without"] * 1e3, 1),
        "overhead_pct": round((med["with"] / med["without"] - 1) * 100, 1),
        "checksum_alone_ms": round(med["checksum_alone"] * 1e3, 1),
        "checksum_gib_s": round(size / med["checksum_alone"] / 2 ** 30, 2),
        "all_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
