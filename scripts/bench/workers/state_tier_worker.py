"""The training script of the state-tier benchmark (scripts/bench/state_tier.py): one script, written five ways
(--row), so that the only difference between the rows of its table is how the script is written.

  none     HPWrapper only. The model and optimizer are built once, outside the wrapped function; no
           CheckpointManager: after a restart the training goes on from the live objects (a survivor's own
           counter of completed steps; with several ranks the smallest one, all-reduced). A rank that was
           killed comes back with fresh objects at step 0, and so does the job.
  readme   CheckpointManager() with its default arguments; model and optimizer built outside the function;
           DDP wrapped inside the function, before restore(), and the DDP module passed as the state:
           state = {"model": ddp, "opt": opt} (the README's wrapping).
  inside   CheckpointManager() default; model and optimizer built inside the function on every entry (the
           product note's complete example): state = {"model": model, "opt": opt}; DDP made after restore().
  bare     CheckpointManager() default; model and optimizer built outside; restore() on the bare module
           (state = {"model": model, "opt": opt}), DDP made after it (how the project's own benchmarks
           write it).
  nvrx     NVIDIA Resiliency Extension's inprocess.Wrapper with last_call_wait=0.1 s (its fast
           configuration, as its optimal example: model, optimizer and the base TCPStore built once outside
           the function, a PrefixStore per iteration, no reload from disk), under torchrun.

Every row wraps the model in DDP whenever a process group is initialised (always under the launchers: gloo
on CPU, NCCL on GPU), even with one rank, so that no row saves DDP's cost. Rows readme/inside/bare call
cm.save(step + 1, state) after every optimizer step; every row reports caller.progress(step) (NVRx:
call_wrapper.ping()) at the top of each step.

Models (--model, --size): `mlp` a bf16 MLP of Linear(d, d) + GELU layers (1b: d 8192 x 16 layers = 1.07 B
parameters, batch 8192); `gpt` a GPT-style decoder (token and position embedding, pre-LayerNorm blocks with
causal scaled_dot_product_attention and a GELU MLP, a final LayerNorm, the head tied to the embedding,
cross-entropy; 1b: vocab 32768, d 2048, 20 layers, 16 heads, 8 x 1024 tokens = 1.08 B parameters). Fused
AdamW on the GPU (bf16 parameters and state). `tiny` is a few thousand parameters in fp32 on the CPU (gloo).
Parameters are initialised on their device (seed 0); each step's batch comes from a generator seeded with
(step, rank) on the device, so a step's data depends only on (step, rank).

Faults (--kind raise|kill|none, --faults K): generation g < K gets one fault, in rank g % world, after
backward and before optimizer.step(), once the generation has completed --fault-every + g % 3 steps (plus
--warmup in generation 0) and --fault-gap seconds have passed since its first completed step (the offset
g % 3 keeps the same step from failing in a row, which the launcher's --max-step-failures guard would end
the job for; the gap gives a replacement process's helpers - a standby - the time to be ready again).
With --gate (SIGKILL jobs under hyperpodrun) a due fault also waits, up to --arm-timeout seconds, until
OUT/gate.json (the driver writes it from the launcher's event log) says a killed rank would be served the
fast way. On the GPU the victim synchronises its stream first, so the fault time is when the device is idle.
Then it records the fault and raises a RuntimeError (raise) or SIGKILLs itself (kill). Generation K runs --tail
steps and returns; with --kind none generation 0 runs --warmup + --tail steps.

Records (one JSON line each, appended and flushed to OUT/rank<r>.jsonl; time.time() on this machine's clock):
  {"ev": "top"}      the script's first statement (before torch is imported), with the pid
  {"ev": "built"}    model and optimizer built outside the function (rows none, readme, bare, nvrx)
  {"ev": "enter"}    the wrapped function entered (generation `gen`)
  {"ev": "entry"}    state in place: `start` (the step the generation starts from), `restored_from` and
                     `restore_phases` (CheckpointManager rows), `params`
  {"ev": "step"}     a completed step: `step` = completed optimizer steps, after the compute stream was
                     synchronised (on the GPU: the optimizer step and whatever save() put on that stream are
                     done; a copy save() left on a side stream is not waited for)
  {"ev": "fault"}    right before the raise / SIGKILL: `step` = the step in progress (its work is lost)
  {"ev": "end"}      the last generation returned
"""
import logging
import os as _os
if _os.environ.get("BENCH_LOG_INFO"):       # diagnostics: the library's INFO lines (snapshots, restores) on stderr
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
import os
import time

T_TOP = time.time()
import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROWS = ("none", "readme", "inside", "bare", "nvrx")
RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))

#: model shapes per (model, size)
SIZES: dict[tuple[str, str], dict[str, int]] = {
    ("mlp", "tiny"): {"dim": 32, "layers": 2, "batch": 16},
    ("mlp", "1b"): {"dim": 8192, "layers": 16, "batch": 8192},
    ("gpt", "tiny"): {"vocab": 64, "dim": 16, "layers": 2, "heads": 2, "seq": 8, "batch": 4},
    ("gpt", "1b"): {"vocab": 32768, "dim": 2048, "layers": 20, "heads": 16, "seq": 1024, "batch": 8},
}


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit 2 (the driver passes them; a person may too)."""

    def error(self, message: str) -> None:   # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def parse() -> argparse.Namespace:
    p = OneLineParser(prog="state_tier_worker.py")
    p.add_argument("--row", choices=ROWS, required=True)
    p.add_argument("--model", choices=("mlp", "gpt"), required=True)
    p.add_argument("--size", choices=("tiny", "1b"), required=True)
    p.add_argument("--kind", choices=("raise", "kill", "none"), required=True)
    p.add_argument("--faults", type=int, default=5)
    p.add_argument("--fault-every", type=int, default=12)
    p.add_argument("--fault-gap", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tail", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--gate", action="store_true", help="wait for OUT/gate.json to say a kill would be served fast")
    p.add_argument("--arm-timeout", type=float, default=30.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.kind == "none":
        a.faults = 0
    for name in ("faults", "fault_every", "warmup", "tail"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return a


_FH: Any = None


def note(ev: str, **fields: Any) -> None:
    """One record, written and flushed at once (it must survive the SIGKILL that may follow)."""
    global _FH
    if _FH is None:
        _FH = open(os.path.join(ARGS.out, f"rank{RANK}.jsonl"), "a", buffering=1)
    _FH.write(json.dumps({"ev": ev, "rank": RANK, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
    _FH.flush()


# ------------------------------------------------------------------------------------------ models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # scripts/bench: bench_models
from bench_models import GPT, mlp  # noqa: E402


def device() -> torch.device:
    if ARGS.size == "1b":
        torch.cuda.set_device(LOCAL_RANK)
        return torch.device("cuda", LOCAL_RANK)
    return torch.device("cpu")


def build(dev: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model and AdamW, initialised on `dev` (seed 0): fp32 init, then bf16 on the GPU (fused AdamW)."""
    torch.manual_seed(0)
    s = SIZES[(ARGS.model, ARGS.size)]
    with dev:
        if ARGS.model == "mlp":
            model: nn.Module = mlp(s["dim"], s["layers"])
        else:
            model = GPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
    cuda = dev.type == "cuda"
    if cuda:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
    return model, opt


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def loss_of(net: nn.Module, step: int, dev: torch.device) -> torch.Tensor:
    """Step `step`'s loss: its batch is drawn on the device from a generator seeded with (step, rank)."""
    s = SIZES[(ARGS.model, ARGS.size)]
    g = torch.Generator(device=dev).manual_seed(1000 * step + RANK)
    if ARGS.model == "mlp":
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        x = torch.randn(s["batch"], s["dim"], generator=g, device=dev, dtype=dtype)
        return net(x).float().pow(2).mean()
    tok = torch.randint(s["vocab"], (s["batch"], s["seq"] + 1), generator=g, device=dev)
    logits = net(tok[:, :-1])
    return F.cross_entropy(logits.reshape(-1, s["vocab"]).float(), tok[:, 1:].reshape(-1))


def armed() -> bool:
    """--gate (SIGKILL jobs under hyperpodrun): whether the driver says a killed rank would now be served the
    fast way (OUT/gate.json: the warm spawner ready, and every local rank's standby where there are any)."""
    if not ARGS.gate:
        return True
    try:
        with open(os.path.join(ARGS.out, "gate.json")) as fh:
            gate = json.load(fh)
    except (OSError, ValueError):
        return False
    return bool(gate.get("warm")) and gate.get("available", 0) >= gate.get("wanted", 0)


def sync(dev: torch.device) -> None:
    """Wait for the compute stream (not the whole device: a snapshot copy save() runs on a side stream must
    stay overlapped, as it is in a real job)."""
    if dev.type == "cuda":
        torch.cuda.current_stream().synchronize()


def ddp(model: nn.Module, dev: torch.device) -> nn.Module:
    if not (dist.is_available() and dist.is_initialized()):
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def init_group(dev: torch.device) -> None:
    """The generation's process group (env://, as a plain script does under a launcher)."""
    if dev.type == "cuda":
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=dev)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def agree(done: int, dev: torch.device) -> int:
    """Rows without a state tier: every rank starts from the smallest count of completed steps (a rank that
    was killed comes back at 0, its survivors cannot rewind)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return done
    t = torch.tensor([done], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ------------------------------------------------------------------------------------------ the loop
def train(net: nn.Module, opt: torch.optim.Optimizer, start: int, gen: int, dev: torch.device,
          save: Callable[[int], None], progress: Callable[[int], None], counter: dict) -> None:
    """Steps from `start` until this generation's fault (generation < --faults) or its --tail steps."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    faulting = gen < ARGS.faults
    first = ARGS.warmup if gen == 0 else 0
    fault_at = first + ARGS.fault_every + gen % 3
    victim = faulting and RANK == gen % world
    n, step, t_first, t_due = 0, start, None, None
    while faulting or n < first + ARGS.tail:
        progress(step)
        loss = loss_of(net, step, dev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if victim and n >= fault_at and t_first is not None and time.time() - t_first >= ARGS.fault_gap:
            t_due = t_due or time.time()
            ready = armed()
        if t_due is not None and (ready or time.time() - t_due >= ARGS.arm_timeout):
            sync(dev)
            note("fault", gen=gen, step=step, kind=ARGS.kind, armed=ready, armed_wait_s=round(time.time() - t_due, 3))
            if ARGS.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            raise RuntimeError(f"state_tier: injected fault in generation {gen} at step {step}")
        opt.step()
        save(step + 1)
        sync(dev)
        step += 1
        counter["done"] = step
        note("step", gen=gen, step=step)
        n += 1
        if t_first is None:
            t_first = time.time()
        if ARGS.step_sleep:
            time.sleep(ARGS.step_sleep)
    note("end", gen=gen, step=step)


def release(dev: torch.device) -> None:
    """Drop DDP and the last tensors before the group goes (a gloo thread must not free a tensor while
    Python exits), then destroy the group."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ rows
def hyperpodrun_rows() -> None:
    """Rows none, readme, inside, bare: HPWrapper under `hyperpodrun --inprocess-restart`."""
    from hyperpodrun import CheckpointManager, HPWrapper, wait_rank
    wait_rank()
    dev = device()
    row = ARGS.row
    cm: Any = CheckpointManager() if row != "none" else None
    kept: dict[str, Any] = {}
    if row in ("none", "readme", "bare"):
        kept["model"], kept["opt"] = build(dev)
        sync(dev)
        note("built", params=params(kept["model"]))
    counter = {"done": 0}

    @HPWrapper(checkpoint_manager=cm)
    def main(caller: Any = None) -> None:
        gen = caller.iteration
        note("enter", gen=gen)
        init_group(dev)
        state: Optional[dict] = None
        if row == "none":
            model, opt = kept["model"], kept["opt"]
            start = agree(counter["done"], dev)
            net = ddp(model, dev)
        elif row == "readme":
            model, opt = kept["model"], kept["opt"]
            net = ddp(model, dev)                               # wrapped before restore(), passed as the state
            state = {"model": net, "opt": opt}
            start = cm.restore(state) or 0
        elif row == "inside":
            model, opt = build(dev)                             # new objects on every entry
            state = {"model": model, "opt": opt}
            start = cm.restore(state) or 0
            net = ddp(model, dev)
        else:   # bare
            model, opt = kept["model"], kept["opt"]
            state = {"model": model, "opt": opt}
            start = cm.restore(state) or 0
            net = ddp(model, dev)                               # after restore(): the bare module was the state
        sync(dev)
        note("entry", gen=gen, start=start, params=params(model),
             restored_from=cm.restored_from if cm is not None else None,
             restore_phases=dict(cm.restore_phases) if cm is not None else None)
        counter["done"] = start

        def save(step: int) -> None:
            if cm is not None:
                cm.save(step, state)
        train(net, opt, start, gen, dev, save, caller.progress, counter)
        del net, model, opt, state
        release(dev)

    main()


def nvrx_row() -> None:
    """NVRx's inprocess.Wrapper as its optimal example starts it, with last_call_wait=0.1 s: model, optimizer
    and the base TCPStore built once outside the function; a PrefixStore per iteration; no checkpoint reload
    (the training goes on from the live objects, like the `none` row)."""
    import nvidia_resiliency_ext.inprocess as inprocess
    dev = device()
    model, opt = build(dev)
    sync(dev)
    note("built", params=params(model))
    world = int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=port + 1, world_size=world,
                               is_master=RANK == 0, multi_tenant=True, wait_for_workers=True, use_libuv=True)
    counter = {"done": 0}
    first_iteration: dict = {}
    health = inprocess.health_check.CudaHealthCheck() if dev.type == "cuda" else None

    @inprocess.Wrapper(store_kwargs={"port": port + 2}, health_check=health,
                       last_call_wait=datetime.timedelta(seconds=0.1))
    def main(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:   # NVRx injects it by annotation
        assert call_wrapper is not None
        first_iteration.setdefault("it", call_wrapper.iteration)   # 0.7 counts from 1, older from 0
        gen = call_wrapper.iteration - first_iteration["it"]
        note("enter", gen=gen)
        store = dist.PrefixStore(str(call_wrapper.iteration), base_store)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=RANK, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        start = agree(counter["done"], dev)
        net = ddp(model, dev)
        sync(dev)
        note("entry", gen=gen, start=start, params=params(model), restored_from=None, restore_phases=None)
        counter["done"] = start
        train(net, opt, start, gen, dev, lambda step: None, lambda step: call_wrapper.ping(), counter)
        del net
        release(dev)

    main()


ARGS = parse()

if __name__ == "__main__":
    os.makedirs(ARGS.out, exist_ok=True)
    note("top", t_top=T_TOP)
    if ARGS.row == "nvrx":
        nvrx_row()
    else:
        hyperpodrun_rows()
