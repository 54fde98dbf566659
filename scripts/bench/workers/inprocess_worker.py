"""The worker of scripts/bench/inprocess_bench.py: DDP + Adam on an MLP, with faults planned per generation.

Runs unchanged under `hyperpodrun --inprocess-restart` (HPWrapper re-enters `train` with caller.iteration =
the restart generation), under `hyperpodrun` without it and under `torchrun` (the script starts from the
top after each restart; HPWrapper then calls `train` once with caller.iteration = TORCHELASTIC_RESTART_COUNT).

Plan: generation g < --faults = k * len(kinds) + j gets one fault of kind kinds[j] at step --fault-step + g % 3,
in rank victims[(k + j * len(victims) // len(kinds)) % len(victims)] (with 4 ranks: SIGKILL 1, exception 3,
SIGKILL 2, exception 0, ...). At that step every rank first enters an all-reduce of
--fault-buf-mb MB; the victim waits --fault-delay s (its peers are then inside the collective), then
  kill:  issues its part of the all-reduce asynchronously, records the time, SIGKILLs itself;
  raise: records the time and raises (its peers stay blocked in the all-reduce).
Generation >= --faults runs --final-steps steps and returns. No state is restored on a restart (timing only:
survivors keep their model and Adam state in memory, a new process builds fresh ones; DDP's construction
broadcasts rank 0's parameters).

--workaround adds two user-level workarounds for a deadlock found while writing this benchmark (BENCHMARKS.md,
"In-process restart (issue 3)"): dropping the last reference to a gloo group (a DDP's Reducer holds it) in the
main thread shortly after a collective can deadlock, because ~ProcessGroupGloo joins a gloo thread that waits
for the GIL the freeing thread holds; under --inprocess-restart that happens when the wrapped function
returns or fails. B keeps each generation's DDP (so its group) alive until the next generation has its new
group; as the runtime's abort then no longer frees the group, which is what closes its sockets and releases
the peers blocked in a collective with this rank, A makes the abort shut down (SHUT_RDWR) the TCP connections
this generation opened first (gloo only; never its listening socket: gloo's accept() then fails and gloo
terminates the process).

Records, one line per event, in $BENCH_OUT/r<rank>_p<pid>.txt (time.time(); written and flushed, so the
lines survive a SIGKILL):
  top <t>                          first statement, before torch is imported
  init <gen> <t>                   init_process_group() returned
  ddp <gen> <t>                    DDP constructed (parameters broadcast)
  step <gen> <step> <t>            a training step completed (optimizer step done; on GPU synchronised)
  fault <gen> <step> <kind> <t>    right before the SIGKILL / raise
"""
import os
import time

T_TOP = time.time()
import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from hyperpodrun import HPWrapper, wait_rank  # noqa: E402
from hyperpodrun.runtime.abort import CheckpointlessAbortManager, ComposeAbort  # noqa: E402

_FH = None


def record(*fields) -> None:
    global _FH
    if _FH is None:
        path = os.path.join(os.environ["BENCH_OUT"], f"r{os.environ.get('RANK', '0')}_p{os.getpid()}.txt")
        _FH = open(path, "a")
    _FH.write(" ".join(f"{f:.6f}" if isinstance(f, float) else str(f) for f in fields) + "\n")
    _FH.flush()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--faults", type=int, default=4, help="generations 0..faults-1 each get one fault")
    p.add_argument("--kinds", default="kill,raise")
    p.add_argument("--victims", default="", help="ranks to hit in turn (default: every rank, 1 first)")
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--fault-delay", type=float, default=0.1)
    p.add_argument("--fault-buf-mb", type=float, default=4.0)
    p.add_argument("--final-steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workaround", action="store_true", help="workarounds A and B (see the module docstring)")
    p.add_argument("--sync", choices=("item", "poll"), default="item",
                   help="GPU: how the host waits for a step: loss.item() (a C call), or polling a CUDA event "
                        "from Python (a RESTART interrupt can land while waiting)")
    return p.parse_args()


_STATE: dict = {}   # per process: kept across in-process re-entries


def model_and_optimizer(args: argparse.Namespace, device: torch.device):
    if "model" not in _STATE:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.dim, args.dim), nn.ReLU()]
        layers.append(nn.Linear(args.dim, args.dim))
        model = nn.Sequential(*layers).to(device)
        _STATE["model"] = model
        _STATE["opt"] = torch.optim.Adam(model.parameters(), lr=1e-4)
    return _STATE["model"], _STATE["opt"]


def plan_for(args: argparse.Namespace, gen: int, world: int):
    if gen >= args.faults:
        return None
    kinds = args.kinds.split(",")
    victims = [int(v) for v in args.victims.split(",")] if args.victims else \
        [r % world for r in range(1, world + 1)]
    # kind j of round k hits victims[k + j * n // len(kinds)]: each kind rotates through every rank, and an
    # exception does not hit the process that was just respawned for the SIGKILL before it
    k, j = divmod(gen, len(kinds))
    victim = victims[(k + j * len(victims) // len(kinds)) % len(victims)]
    return kinds[j], victim, args.fault_step + gen % 3


def wait_done(t: torch.Tensor, args: argparse.Namespace, device: torch.device) -> None:
    if device.type != "cuda":
        return
    if args.sync == "item":
        t.item()
        return
    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        time.sleep(0.0002)


def _tcp_sockets() -> dict[int, str]:
    """fd -> socket inode of this process's connected TCP sockets (not listeners)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as s:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                    s.getpeername()   # OSError (ENOTCONN) for a listener
                    out[int(name)] = link
        except (OSError, ValueError):
            continue
    return out


class ShutdownGroupSockets:
    """Workaround A: shut down the TCP connections opened since mark() (the generation's gloo group and its
    store client), so the peers blocked in a collective with this rank fail at once."""

    def __init__(self) -> None:
        self.before: set[str] = set()
        self.enabled = False

    def mark(self) -> None:
        self.before = set(_tcp_sockets().values())

    def __call__(self) -> None:
        if not self.enabled:
            return
        for fd, inode in _tcp_sockets().items():
            if inode in self.before:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


SOCKETS = ShutdownGroupSockets()


@HPWrapper(abort=ComposeAbort(SOCKETS, CheckpointlessAbortManager.get_default_checkpointless_abort()),
           abort_timeout=30.0)
def train(args: argparse.Namespace, caller=None) -> None:
    gen = caller.iteration
    SOCKETS.enabled = args.workaround and args.backend == "gloo"   # NCCL: the abort is ncclCommAbort
    if SOCKETS.enabled:
        SOCKETS.mark()
    use_cuda = args.backend == "nccl"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=30), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    record("init", gen, time.time())
    _STATE.pop("grave", None)   # workaround B: the previous generation's DDP goes now, long after its last collective
    model, opt = model_and_optimizer(args, device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    if args.workaround:
        _STATE["grave"] = ddp
    record("ddp", gen, time.time())
    plan = plan_for(args, gen, world)
    n_steps = args.final_steps if plan is None else plan[2] + 1
    gen_data = torch.Generator().manual_seed(1000 * gen + rank)
    buf = torch.ones(max(1, int(args.fault_buf_mb * 2 ** 20 / 4)), device=device)
    for step in range(n_steps):
        caller.progress(step)
        if plan is not None and step == plan[2]:
            kind, victim, _ = plan
            if rank != victim:
                dist.all_reduce(buf)   # blocked here (CPU) / enqueued behind the victim (GPU) when it fails
            else:
                time.sleep(args.fault_delay)
                if kind == "kill":
                    dist.all_reduce(buf, async_op=True)
                    record("fault", gen, step, kind, time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)
                record("fault", gen, step, kind, time.time())
                raise RuntimeError(f"bench: injected {kind} fault in generation {gen} at step {step}")
        x = torch.randn(args.batch, args.dim, generator=gen_data).to(device)
        y = torch.randn(args.batch, args.dim, generator=gen_data).to(device)
        loss = (ddp(x) - y).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        wait_done(loss, args, device)
        record("step", gen, step, time.time())
    # release DDP and the last tensors before the group: a gloo thread must not free a tensor while Python
    # exits (torch 2.13 can abort the process then)
    _STATE.pop("grave", None)
    del ddp, model, opt, buf
    loss = x = y = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    record("top", T_TOP)
    wait_rank()
    train(parse())
