"""What a snapshot's device->host copy does to the training step running beside it, on one GPU.

    python3 scripts/bench/gpu/gpu_copy_engine.py --out DIR [--mb 6400] [--rounds 5]

The question: a step that follows a snapshot is ~25 ms slower than the others, although its own kernels do
not wait for the snapshot. The suspect is the copy engine: the step ends with `loss.item()`, a small
device->host copy, and if it queues behind gigabytes of snapshot copies already given to the engine it
waits for all of them. Each case times one "step" (matmuls of about the recovery benchmark's step, then
`.item()`) while the snapshot's copies run, and how long the copies take in all:

- `alone`: the step, no copy running;
- `queued`: every copy launched at once on a side stream (what `CheckpointManager` did), one per tensor;
- `queued-sync`: the same, but the step ends with a compute-stream sync instead of `.item()`;
- `queued-pinned`: the same, the step's scalar copied into pinned memory (`non_blocking`) and waited for;
- `paced-<depth>x<MB>`: the copies cut into pieces of <MB> and launched by a thread, at most <depth> in
  flight (each launch waits for the piece <depth> back);
- `launch-*`: host time to launch the 96 staging copies one by one (with the per-tensor stream waits,
  stream contexts, record_stream and events) against one `torch._foreach_copy_`.

Writes DIR/copy-engine.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch


_PINNED: list[torch.Tensor] = []


def step(ws: list[torch.Tensor], x: torch.Tensor, sync: str) -> float:
    t0 = time.perf_counter()
    y = x
    for w in ws:
        y = torch.nn.functional.gelu(y @ w)
    if sync == "item":
        y.float().pow(2).mean().item()
    elif sync == "pinned":
        if not _PINNED:
            _PINNED.append(torch.empty((), pin_memory=True))
        _PINNED[0].copy_(y.float().pow(2).mean(), non_blocking=True)
        torch.cuda.current_stream().synchronize()
    else:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def pieces(srcs: list[torch.Tensor], dsts: list[torch.Tensor], mb: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = mb << 20
    out = []
    for s, d in zip(srcs, dsts):
        fs, fd = s.view(-1).view(torch.uint8), d.view(-1).view(torch.uint8)
        for o in range(0, fs.numel(), n):
            out.append((fs[o:o + n], fd[o:o + n]))
    return out


def launch_queued(side: torch.cuda.Stream, srcs: list, dsts: list) -> torch.cuda.Event:
    with torch.cuda.stream(side):
        for s, d in zip(srcs, dsts):
            d.copy_(s, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(side)
    return ev


def launch_paced(side: torch.cuda.Stream, work: list, depth: int) -> threading.Thread:
    def run() -> None:
        inflight: list[torch.cuda.Event] = []
        with torch.cuda.stream(side):
            for s, d in work:
                if len(inflight) >= depth:
                    inflight.pop(0).synchronize()
                d.copy_(s, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
                inflight.append(ev)
        for ev in inflight:
            ev.synchronize()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb", type=int, default=6400, help="snapshot size in MB (tensors of 128 MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=10, help="matmuls per step (10 x 8192^2 at batch 8192 ~ 90 ms)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    n = max(1, args.mb // 128)
    srcs = [torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    dsts = [torch.empty(8192, 8192, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
    ws = [torch.randn(args.dim, args.dim, device=dev, dtype=torch.bfloat16) / args.dim ** 0.5
          for _ in range(args.layers)]
    x = torch.randn(8192, args.dim, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for _ in range(3):
        step(ws, x, "item")
    launch_queued(side, srcs, dsts).synchronize()
    total = sum(s.numel() * s.element_size() for s in srcs)

    cases = ["alone", "queued", "queued-sync", "queued-pinned", "paced-1x64", "paced-1x128", "paced-1x16",
             "paced-2x64", "paced-4x64", "paced-2x16"]
    res: dict[str, dict[str, list[float]]] = {c: {"step_s": [], "copy_s": []} for c in cases}
    for _r in range(args.rounds):
        for c in cases:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if c == "alone":
                res[c]["step_s"].append(step(ws, x, "item"))
                continue
            if c.startswith("queued"):
                ev = launch_queued(side, srcs, dsts)
                st = step(ws, x, {"queued": "item", "queued-sync": "sync", "queued-pinned": "pinned"}[c])
                ev.synchronize()
            else:
                depth, mb = (int(v) for v in c.split("-")[1].split("x"))
                th = launch_paced(side, pieces(srcs, dsts, mb), depth)
                st = step(ws, x, "item")
                th.join()
            res[c]["copy_s"].append(time.perf_counter() - t0)
            res[c]["step_s"].append(st)

    # host time to launch the staging copies of the recovery benchmark's state: 96 tensors (48 weights, 48 biases)
    bufs = [torch.empty_like(s) for s in srcs[:48]]
    bias = [torch.randn(8192, device=dev, dtype=torch.bfloat16) for _ in range(48)]
    bbufs = [torch.empty_like(b) for b in bias]
    all_src, all_buf = srcs[:48] + bias, bufs + bbufs
    launch: dict[str, list[float]] = {"launch-per-tensor": [], "launch-foreach": []}
    for _r in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream()
        for s, b in zip(all_src, all_buf):
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                b.copy_(s, non_blocking=True)
                s.record_stream(side)
            ev = torch.cuda.Event()
            ev.record(side)
        launch["launch-per-tensor"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            torch._foreach_copy_(all_buf, all_src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
        launch["launch-foreach"].append(time.perf_counter() - t0)
    torch.cuda.synchronize()

    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes": total,
           "rounds": args.rounds, "cases": res, "launch": launch}
    with open(os.path.join(args.out, "copy-engine.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {total / 1e9:.2f} GB device->pinned host "
             f"beside one step; medians of {args.rounds}", "",
             "| case | step (s) | copy done after (s) | copy GB/s |", "|---|---|---|---|"]
    for c in cases:
        s = statistics.median(res[c]["step_s"])
        if res[c]["copy_s"]:
            cp = statistics.median(res[c]["copy_s"])
            lines.append(f"| {c} | {s:.4f} | {cp:.4f} | {total / cp / 1e9:.1f} |")
        else:
            lines.append(f"| {c} | {s:.4f} | - | - |")
    lines += ["", "| launch of 96 staging copies | host time (ms) |", "|---|---|"]
    for k, v in launch.items():
        lines.append(f"| {k} | {1000 * statistics.median(v):.2f} |")
    with open(os.path.join(args.out, "copy-engine.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
