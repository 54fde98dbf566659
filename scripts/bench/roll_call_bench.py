"""What the roll call costs a rank per generation (hyperpodrun/runtime/roll_call.py).

    python scripts/bench/roll_call_bench.py                      # 2 ranks, gloo on CPU
    python scripts/bench/roll_call_bench.py --backend nccl --nproc 8

Starts --nproc processes as the agent's workers are (a workers' key, run id, generation, store in their
environment), forms one default group, then times `roll_call.call()` --repeat times after --warmup calls,
with a barrier before each, and for comparison an all-reduce of one element, the smallest collective a
training step makes. Reported: the first call (on NCCL it creates the communicator, which the job's first
collective would do anyway), and the median and 90th percentile over the repeats of the slowest rank's time.
Prints the command, the machine and the figures; --json writes them too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # hyperpodrun from this checkout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, args: argparse.Namespace, port: int, key: str, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID="bench", HYPERPODRUN_GENERATION="0",
                      HYPERPODRUN_JOB_KEY=key, HYPERPODRUN_ROLL_CALL="0")   # 0: init alone, timed here
    import torch
    import torch.distributed as dist
    from hyperpodrun.runtime import roll_call
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120),
                            device_id=device if args.backend == "nccl" else None)
    t0 = time.perf_counter()
    roll_call.call()
    first = time.perf_counter() - t0
    one = torch.ones(1, device=device)

    def timed(fn: object) -> list[float]:
        out = []
        for i in range(args.warmup + args.repeat):
            dist.barrier()
            t = time.perf_counter()
            fn()   # type: ignore[operator]
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                out.append(time.perf_counter() - t)
        return out
    calls = timed(roll_call.call)
    reduces = timed(lambda: dist.all_reduce(one))
    queue.put((rank, first, calls, reduces))   # type: ignore[attr-defined]
    dist.barrier()
    dist.destroy_process_group()


def _machine(backend: str) -> str:
    what = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    if backend == "nccl":
        import torch
        what += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, key = _free_port(), secrets.token_hex(32)
    procs = [ctx.Process(target=_worker, args=(r, args, port, key, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    slowest = [max(r[2][i] for r in results) for i in range(args.repeat)]
    reduce_slowest = [max(r[3][i] for r in results) for i in range(args.repeat)]
    q = statistics.quantiles(slowest, n=10)
    figures = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _machine(args.backend), "torch": torch.__version__, "backend": args.backend, "nproc": args.nproc,
        "first_call_ms": round(max(r[1] for r in results) * 1e3, 3),
        "median_ms": round(statistics.median(slowest) * 1e3, 4), "p90_ms": round(q[8] * 1e3, 4),
        "allreduce_1_median_ms": round(statistics.median(reduce_slowest) * 1e3, 4),
    }
    print(f"command: {figures['command']}")
    print(f"machine: {figures['machine']} (torch {figures['torch']})")
    print(f"roll call, {args.backend}, {args.nproc} ranks: median {figures['median_ms']} ms, p90 {figures['p90_ms']} "
          f"ms per generation (slowest rank, {args.repeat} calls); first call {figures['first_call_ms']} ms; "
          f"for scale, an all-reduce of one element: median {figures['allreduce_1_median_ms']} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
