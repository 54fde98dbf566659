"""The phases of an in-process restart on one GPU, each measured in isolation, so that the restart path is
chosen from measured numbers rather than guessed:

  A  tearing down an NCCL process group and making the next one (world size 1): torch's _abort_process_group,
     the backend's own abort(), destroy_process_group() alone, and the abort in a background thread while the
     next group is made; with the default environment and with TORCH_NCCL_ENABLE_MONITORING=0
  B  copying a --gb GB state (default 6.4) from a /dev/shm file to the GPU: a private mapping (today's path),
     a MAP_POPULATE shared mapping, that mapping registered with CUDA (cudaHostRegister, flags 0 and ReadOnly),
     a pipelined read through two pinned staging buffers (1/4/8 reader threads); zlib.crc32 on 16 threads
  C  gc.collect() in a process holding a 1.07B-parameter bf16 model with fused AdamW, with and without
     gc.freeze() first

Each section runs in a child process of its own (a failing or hanging one loses no other; A's environment
must be set before the first process group), each measurement --reps times (median, min-max); what fails is
recorded with its error. GB are 1e9 bytes. Without a GPU: one line, exit code 2.

    NCCL_NVLS_ENABLE=0 python3 scripts/bench/gpu/gpu_restart_phases.py --out bench-out/phases.json
"""
import argparse
import ctypes
import functools
import gc
import itertools
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

with warnings.catch_warnings():          # an installed pynvml package warns at import
    warnings.simplefilter("ignore", FutureWarning)
    import torch

MiB = 1 << 20
PIECE = 128 * MiB          # the restore's copy unit
STAGE = 256 * MiB          # the pinned staging buffers (B4), the write chunk of B's file
READ_ONLY = 8              # cudaHostRegisterReadOnly
#: (section, label, extra environment, soft budget s (repetitions stop once spent), hard limit s (child killed))
RUNS = [("A", "A.default", {}, 35.0, 55.0),
        ("A", "A.monitoring_off", {"TORCH_NCCL_ENABLE_MONITORING": "0"}, 35.0, 55.0),
        ("B", "B", {}, 85.0, 115.0),
        ("C", "C", {}, 20.0, 45.0)]
now = time.perf_counter


def nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


class Part:
    """One child's results, rewritten to `path` after every measurement (a killed child keeps what it had)."""

    def __init__(self, path: str) -> None:
        self.path, self.meta, self.errors = path, dict[str, Any](), dict[str, str]()
        self.values: dict[str, tuple[str, list[float]]] = {}

    def add(self, name: str, value: float, unit: str = "s") -> None:
        self.values.setdefault(name, (unit, []))[1].append(value)
        self.flush()

    def error(self, name: str, exc: BaseException) -> None:
        self.errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
        self.flush()

    def flush(self) -> None:
        stats = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v), "unit": u,
                     "values": v} for k, (u, v) in self.values.items()}
        with open(self.path + ".tmp", "w") as fh:
            json.dump({"meta": self.meta, "errors": self.errors, "stats": stats}, fh, indent=1)
        os.replace(self.path + ".tmp", self.path)


def reps_until(n: int, until: float) -> Iterator[int]:
    """n repetitions, fewer once `until` (time.monotonic) has passed; at least one."""
    return (i for i in range(n) if not i or time.monotonic() <= until)


# ---------------------------------------------------------------------------------------------------- A
def section_a(p: Part, reps: int, budget: float) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    start, dev, count = time.monotonic(), torch.device("cuda", 0), itertools.count()
    torch.cuda.set_device(dev)
    p.meta.update(nccl=nccl_version(), gpu=torch.cuda.get_device_name(0),
                  env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))})
    x = torch.ones(16 * MiB, device=dev)       # 64 MiB of fp32
    base = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))

    def create(name: str) -> None:
        """The next group (a new store prefix, eager NCCL init through device_id) and its first all_reduce."""
        t0 = now()
        dist.init_process_group("nccl", store=dist.PrefixStore(f"g{next(count)}/", base), rank=0, world_size=1,
                                device_id=dev, timeout=timedelta(seconds=60))
        t1 = now()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        p.add(f"{name}/init_s", t1 - t0)
        p.add(f"{name}/first_allreduce_s", now() - t1)
        p.add(f"{name}/init_and_allreduce_s", now() - t0)

    def detach() -> None:
        """Empty torch's registry of groups, aborting and destructing nothing (the registry part of
        _abort_process_group): init_process_group works again."""
        w = c10d._world
        c10d._update_default_pg(None)
        for d in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag, w.tags_to_pg,
                  w.pg_coalesce_state):
            d.clear()
        getattr(c10d, "_unregister_all_process_groups", lambda: None)()
        w.group_count = 0

    def a1() -> None:
        c10d._abort_process_group()       # empties the registry too: destroy then has nothing left
        p.meta["a1_initialized_after_abort"] = dist.is_initialized()
        if dist.is_initialized():
            dist.destroy_process_group()

    def a2() -> None:
        backend = getattr(dist.group.WORLD, "_get_backend")(torch.device("cuda"))
        if not hasattr(backend, "abort"):
            raise RuntimeError(f"{type(backend).__name__} has no abort()")
        backend.abort()
        del backend
        dist.destroy_process_group()

    def a4(name: str) -> None:
        """The old group's ProcessGroup.abort() (what _abort_process_group runs per group) and destruction in a
        thread while this one makes the next group; times from the start of the abort."""
        holder: list[Any] = [dist.group.WORLD]
        marks: dict[str, float] = {}
        t0 = now()
        detach()

        def background() -> None:
            pg = holder.pop()
            pg.abort()
            marks["abort_done_s"] = now() - t0
            del pg                         # the last reference: the group's destructor runs here
            marks["released_s"] = now() - t0
        th = threading.Thread(target=background, daemon=True)
        th.start()
        create(name + "/next")
        p.add(f"{name}/next_group_ready_s", now() - t0)
        th.join(60)
        if th.is_alive():
            raise RuntimeError("background abort still running after 60 s")
        for k, v in marks.items():
            p.add(f"{name}/background_{k}", v)

    create("cold")
    plan: list[tuple[str, Optional[Callable[[], None]]]] = [
        ("a1_abort_process_group", a1), ("a3_destroy_only", dist.destroy_process_group),
        ("a4_abort_in_thread", None), ("a2_backend_abort", a2)]     # the least known last
    for i, (name, fn) in enumerate(plan):
        try:
            for _ in reps_until(reps, start + budget * (i + 1) / len(plan)):
                if fn is None:
                    a4(name)
                    continue
                t0 = now()
                fn()
                p.add(f"{name}/teardown_s", now() - t0)
                create(name + "/next")
        except Exception as exc:
            p.error(name, exc)
            try:
                if dist.is_initialized():
                    detach()
                create("after_error")
            except Exception as exc2:
                p.error(name + "/after_error", exc2)
                return
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- B
def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor (numpy not needed); `t` must outlive it."""
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr()))


def mapped(path: str, writable: bool, populate: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        if not populate:
            return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                         prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)


def to_gpu(p: Part, name: str, host: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy `host` to new GPU tensors in PIECE views (as a restore does): copy_s and copy_GBps."""
    t0 = now()
    outs = [host[o:o + PIECE].to("cuda", non_blocking=non_blocking) for o in range(0, host.numel(), PIECE)]
    torch.cuda.synchronize()
    dt = now() - t0
    del outs
    p.add(f"{name}/copy_s", dt)
    p.add(f"{name}/copy_GBps", host.numel() / 1e9 / dt, "GB/s")


def b12_mapped(p: Part, name: str, path: str, size: int, reps: int, until: float, populate: bool) -> None:
    """B1 (populate False): today's ACCESS_COPY mapping, faulted in by the copy. B2: MAP_SHARED|MAP_POPULATE."""
    for _ in reps_until(reps, until):
        t0 = now()
        m = mapped(path, False, populate)
        p.add(f"{name}/map_s", now() - t0)
        host = torch.frombuffer(m, dtype=torch.uint8)
        to_gpu(p, name, host)
        p.add(f"{name}/total_GBps", size / 1e9 / (now() - t0), "GB/s")
        del host
        m.close()


def b3_registered(p: Part, name: str, path: str, size: int, reps: int, until: float) -> None:
    """The pointer is torch.frombuffer(mapping).data_ptr(), which works for a PROT_READ mapping too (ctypes'
    from_buffer needs a writable one)."""
    rt: Any = torch.cuda.cudart()

    def check(call: str, err: Any) -> None:
        if int(err) != 0:
            raise RuntimeError(f"{call}: error {int(err)} {rt.cudaGetErrorString(err)}")
    combos = [(False, READ_ONLY), (False, 0), (True, 0), (True, READ_ONLY)]
    t_start = time.monotonic()
    for i, (writable, flags) in enumerate(combos):
        sub, m, registered = f"{name}/{'rw' if writable else 'ro'}_map_flags{flags}", None, 0
        try:
            m = mapped(path, writable, True)
            host: Optional[torch.Tensor] = torch.frombuffer(m, dtype=torch.uint8)
            assert host is not None
            for _ in reps_until(reps, t_start + (until - t_start) * (i + 1) / len(combos)):
                t0 = now()
                check("cudaHostRegister", rt.cudaHostRegister(host.data_ptr(), size, flags))
                registered = host.data_ptr()
                p.add(f"{sub}/register_s", now() - t0)
                p.meta[f"{sub}/is_pinned"] = bool(host.is_pinned())
                to_gpu(p, sub, host, non_blocking=True)
                t0, registered = now(), 0
                check("cudaHostUnregister", rt.cudaHostUnregister(host.data_ptr()))
                p.add(f"{sub}/unregister_s", now() - t0)
        except Exception as exc:
            p.error(sub, exc)
            try:      # a failed runtime call stays CUDA's last error, which torch's next launch check reports
                torch.zeros(1, device="cuda").add_(1)
            except RuntimeError:
                pass
        finally:
            host = None
            if registered:
                rt.cudaHostUnregister(registered)
            if m is not None:
                try:
                    m.close()
                except BufferError:     # a view still held (by a traceback): unmapped when that goes
                    pass


def read_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at {offset + done}")
        done += n


def b4_pipeline(p: Part, name: str, path: str, size: int, reps: int, until: float) -> None:
    """Reader threads preadv the next 256 MiB of the file into one pinned buffer while the other one's DMA to
    the GPU runs on a side stream."""
    stage = [torch.empty(STAGE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    views, dst = [byte_view(t) for t in stage], torch.empty(size, dtype=torch.uint8, device="cuda")
    side, events = torch.cuda.Stream(), [torch.cuda.Event(), torch.cuda.Event()]
    fd, t_start = os.open(path, os.O_RDONLY), time.monotonic()
    try:
        for i, threads in enumerate((1, 4, 8)):
            with ThreadPoolExecutor(threads) as pool:
                for _ in reps_until(reps, t_start + (until - t_start) * (i + 1) / 3):
                    torch.cuda.synchronize()
                    t0 = now()
                    for j, off in enumerate(range(0, size, STAGE)):
                        k, n = j % 2, min(STAGE, size - off)
                        if j >= 2:
                            events[k].synchronize()      # this buffer's previous DMA is done
                        step, view = max(4096, ((n + threads - 1) // threads + 4095) & ~4095), views[k]
                        list(pool.map(lambda a: read_full(fd, view[a:min(a + step, n)], off + a),
                                      range(0, n, step)))
                        with torch.cuda.stream(side):
                            dst[off:off + n].copy_(stage[k][:n], non_blocking=True)
                            events[k].record(side)
                    side.synchronize()
                    p.add(f"{name}/{threads}_readers_GBps", size / 1e9 / (now() - t0), "GB/s")
        for o in range(0, size, max(MiB, size // 16)):       # what arrived is the file: 1 MiB samples
            got = dst[o:o + MiB].cpu()
            if bytes(byte_view(got)) != os.pread(fd, got.numel(), o):
                raise RuntimeError(f"the pipelined copy differs from the file at byte {o}")
        p.meta[f"{name}/samples_verified"] = True
    finally:
        os.close(fd)


def b5_crc32(p: Part, name: str, path: str, size: int, reps: int, until: float) -> None:
    m, chunk = mapped(path, False, True), 16 * MiB
    try:
        with memoryview(m) as mv, ThreadPoolExecutor(16) as pool:
            for _ in reps_until(reps, until):
                t0 = now()
                list(pool.map(lambda o: zlib.crc32(mv[o:o + chunk]), range(0, size, chunk)))
                p.add(f"{name}/GBps", size / 1e9 / (now() - t0), "GB/s")
    finally:
        m.close()


def state_file(directory: str, parent_pid: int) -> str:
    """Section B's file, named after the parent process, which removes it if the child was killed."""
    return os.path.join(directory, f"restart_phases_{parent_pid}.bin")


def section_b(p: Part, reps: int, budget: float, gb: float, directory: str) -> None:
    start, size, st = time.monotonic(), int(gb * 1e9), os.statvfs(directory)
    p.meta.update(bytes=size, gpu=torch.cuda.get_device_name(0), dir=directory)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    if st.f_bavail * st.f_frsize < size + STAGE:
        raise RuntimeError(f"{directory}: {st.f_bavail * st.f_frsize / 1e9:.1f} GB free, {size / 1e9:.1f} GB "
                           "needed (--dir, --gb)")
    path = state_file(directory, os.getppid())
    try:
        t0, data = now(), torch.randint(0, 256, (STAGE,), dtype=torch.uint8)
        chunk = byte_view(data)          # data must outlive it (the view is a bare pointer)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, size)
        with open(fd, "wb") as fh:
            for off in range(0, size, STAGE):
                fh.write(chunk[:min(STAGE, size - off)])
        p.add("write_file_s", now() - t0)
        torch.ones(1, device="cuda")
        steps: list[tuple[str, float, Callable[..., None]]]
        share, steps = 0.0, [("b1_private_map", 0.15, functools.partial(b12_mapped, populate=False)),
                             ("b2_populate_map", 0.15, functools.partial(b12_mapped, populate=True)),
                             ("b3_host_register", 0.35, b3_registered), ("b4_pinned_pipeline", 0.25, b4_pipeline),
                             ("b5_crc32_16_threads", 0.10, b5_crc32)]
        for name, frac, fn in steps:
            share += frac
            try:
                fn(p, name, path, size, reps, start + budget * share)
            except Exception as exc:
                p.error(name, exc)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------------------------------------------- C
def section_c(p: Part, reps: int, budget: float) -> None:
    import torch._dynamo  # noqa: F401  (its modules are among what gc walks in a real job)
    import torch.nn as nn
    t0 = now()
    with torch.device("cuda"):
        model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False, dtype=torch.bfloat16) for _ in range(16)])
    torch.cuda.synchronize()
    p.add("build_model_on_gpu_s", now() - t0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model(torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    torch.cuda.synchronize()
    p.meta.update(params=sum(t.numel() for t in model.parameters()), gc_objects=len(gc.get_objects()),
                  gpu=torch.cuda.get_device_name(0))
    for name, until in (("gc/collect_s", time.monotonic() + budget / 2),
                        ("gc/collect_after_freeze_s", time.monotonic() + budget)):
        if "freeze" in name:
            t0 = now()
            gc.freeze()
            p.add("gc/freeze_s", now() - t0)
            p.meta["gc_frozen"] = gc.get_freeze_count()
        for _ in reps_until(reps, until):
            t0 = now()
            gc.collect()
            p.add(name, now() - t0)           # the first of gc/collect_s also collects what the setup left
    gc.unfreeze()


# ---------------------------------------------------------------------------------------------------- main
def run_child(a: argparse.Namespace, section: str, env: dict[str, str], soft: float, hard: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "part.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", section, "--part", part, "--reps",
               str(a.reps), "--gb", str(a.gb), "--dir", a.dir, "--budget", str(soft)]
        t0 = now()
        try:
            r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=hard)
            rc, tail = r.returncode, (r.stdout + r.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            rc, tail = -9, f"killed after {hard:.0f} s: {err[-2000:]}"
        if os.path.exists(state_file(a.dir, os.getpid())):
            os.unlink(state_file(a.dir, os.getpid()))
        try:
            with open(part) as fh:
                res: dict[str, Any] = json.load(fh)
        except (OSError, ValueError) as exc:
            res = {"meta": {}, "stats": {}, "errors": {"part": f"{type(exc).__name__}: {exc}"}}
    res.update(rc=rc, wall_s=now() - t0, env=env)
    if rc != 0:
        res["errors"]["child"] = f"exit code {rc}: {tail}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", help="where the JSON results go (required)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gb", type=float, default=6.4, help="section B's state size (GB, 1e9 bytes)")
    ap.add_argument("--dir", default="/dev/shm", help="where section B's file is made")
    ap.add_argument("--only", choices=["A", "B", "C"])
    ap.add_argument("--child", choices=["A", "B", "C"], help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:                      # one section, in the child process run_child started
        p = Part(a.part)
        p.flush()
        try:
            {"A": lambda: section_a(p, a.reps, a.budget), "B": lambda: section_b(p, a.reps, a.budget, a.gb, a.dir),
             "C": lambda: section_c(p, a.reps, a.budget)}[a.child]()
        except Exception as exc:
            p.error("section", exc)
        return
    if not a.out:
        ap.error("--out is required")
    if not torch.cuda.is_available():
        print(f"gpu_restart_phases: no CUDA GPU visible (torch {torch.__version__}); nothing measured")
        sys.exit(2)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "nccl": nccl_version(), "reps": a.reps, "cpus": os.cpu_count()}
    print(f"torch {meta['torch']}  CUDA {meta['cuda']}  NCCL {meta['nccl']}  Python {meta['python']}")
    results: dict[str, Any] = {"meta": meta}
    for section, label, env, soft, hard in RUNS:
        if a.only in (None, section):
            print(f"running {label} ...", flush=True)
            results[label] = run_child(a, section, env, soft, hard)
    print(f"\n{'measurement':<64} {'median':>10} {'min - max':>21} {'unit':>5} {'n':>2}")
    for label, res in results.items():
        for name, s in (res.get("stats", {}) if label != "meta" else {}).items():
            span = f"{s['min']:.4g} - {s['max']:.4g}"
            print(f"{label + '/' + name:<64} {s['median']:>10.4g} {span:>21} {s['unit']:>5} {s['n']:>2}")
        for name, err in (res.get("errors", {}) if label != "meta" else {}).items():
            print(f"{label + '/' + name:<64} ERROR {(err.splitlines() or [''])[0][:300]}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
