"""Training worker for the checkpointless exactness tests: a hand-written all-reduce loop, DDP, FSDP2, DDP with
ZeRO-1 (zero), or DDP with the Adam state sharded within each of INSTANCES optimizer instances (instances: the
CheckpointManager's num_distributed_optimizer_instances replica map), or 2 pipeline stages x 2 data-parallel
ranks (pipeline; PP: the pipeline size the CheckpointManager is given, default 2).

Deterministic (data indexed by step and rank, fixed seeds); saves state after every optimizer step with
CheckpointManager and restores it on re-entry. Faults come from FAULTS, a ';'-separated list of
`kind:rank:step:where` fired once in generation `gen` (kind kill|raise|park|rot-kill - rot-kill: flip a byte of
the rank's newest sealed slot, then SIGKILL; park: write OUT_DIR/park.<rank>
with the pid and sleep until killed, so that a test can end the process its own way; where: top|allreduce|prestep|poststep, poststep: after the optimizer step, before the
save). OUT_DIR/restores.rank<r> says per generation how the rank got its state (CheckpointManager.restored_from),
OUT_DIR/via.rank<r> how a replica peer sent it (restored_via: live, slot or None). REUSE_LIVE=0: reuse_live=False.
FORGE_INVENTORY=rank:generation: that rank's restore inventory in that generation is an outsider's (see
_forge_inventory).
At the end each rank writes its parameters and optimizer state to OUT_DIR/rank<r>.pt; DUMP_PARAMS=1: rank 0 also
writes its model after every step to OUT_DIR/params.step<s>.pt. FALLBACK_DIR / FALLBACK_EVERY: the durable tier.
RANK_ORDER: CheckpointManager(rank_order=...) (the layout every snapshot's fingerprint names).
LOG_INFO=1: the runtime logs at INFO into the rank's log (how each restore was planned and served).
PROCESS_LOG=path: the script's top appends `import <pid>` there (and prints `imported in <pid>`), a SIGKILL fault
`kill <pid>` just before it - the order of a standby's run ahead (--standby-prerun) and the fault; IMPORT_CHILD=1:
the top also starts a child process (`child <pid> <parent>`) that must not outlive the job; READ_RANK_AT_IMPORT=1:
the top reads RANK (a script a standby cannot run ahead).
"""
import datetime
import gc
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import CheckpointlessFinalizeCleanup, CheckpointManager, HPWrapper

PROCESS_LOG = os.environ.get("PROCESS_LOG")


def _process_log(line: str) -> None:
    if PROCESS_LOG:
        with open(PROCESS_LOG, "a") as fh:
            fh.write(line + "\n")


_process_log(f"import {os.getpid()}")
if PROCESS_LOG:
    print(f"imported in {os.getpid()}", flush=True)
if os.environ.get("IMPORT_CHILD") == "1":
    import subprocess
    _child = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
    _process_log(f"child {_child.pid} {os.getpid()}")
if os.environ.get("READ_RANK_AT_IMPORT") == "1":
    IMPORT_RANK = os.environ.get("RANK")
if os.environ.get("LOG_INFO") == "1":   # the runtime's restore lines (plan, transfers, sources) in the rank's log
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hyperpodrun").setLevel(logging.INFO)
MODE = os.environ.get("MODE", "allreduce")
STEPS = int(os.environ.get("STEPS", "12"))
OUT_DIR = os.environ["OUT_DIR"]
DIM = int(os.environ.get("DIM", "256"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(";") if f]
DUMP_PARAMS = os.environ.get("DUMP_PARAMS") == "1"
REPLICAS = os.environ.get("REPLICAS")   # e.g. "0,2/1,3": explicit replica groups
cm = CheckpointManager(enable_checksum=os.environ.get("CHECKSUM") == "1",
                       enable_offload=os.environ.get("OFFLOAD") == "1",
                       fallback_dir=os.environ.get("FALLBACK_DIR") or None,
                       fallback_every=int(os.environ["FALLBACK_EVERY"]) if os.environ.get("FALLBACK_EVERY") else None,
                       shm_dir=os.environ.get("CKPT_SHM_DIR") or None,   # a place the agent does not know
                       replica_groups=[[int(r) for r in g.split(",")] for g in REPLICAS.split("/")]
                       if REPLICAS else None,
                       reuse_live=os.environ.get("REUSE_LIVE", "1") != "0",
                       num_distributed_optimizer_instances=int(os.environ.get("INSTANCES", "2"))
                       if MODE in ("instances", "pipeline") else None,
                       pipeline_model_parallel_size=int(os.environ.get("PP", "2" if MODE == "pipeline" else "1")),
                       rank_order=os.environ.get("RANK_ORDER", "tp-cp-ep-dp-pp"))


def maybe_pause(step, rank, generation):
    """PAUSE_AT=step: in generation 0 every rank without a fault there waits at the top of that step (in
    Python, not in a collective) until OUT_DIR/unpause exists or a restart interrupts it."""
    if os.environ.get("PAUSE_AT") != str(step) or generation != 0:
        return
    if any(int(r) == rank and int(s) == step for _, r, s, *_ in FAULTS):
        return
    end = time.monotonic() + 120
    while not os.path.exists(os.path.join(OUT_DIR, "unpause")) and time.monotonic() < end:
        time.sleep(0.01)


def maybe_fault(where, step, rank, generation):
    if where == "top":
        maybe_pause(step, rank, generation)
    for i, (kind, frank, fstep, fwhere, *gen) in enumerate(FAULTS):
        fgen = int(gen[0]) if gen else 0
        if fwhere == where and int(frank) == rank and int(fstep) == step and fgen == generation:
            gate = os.environ.get("FAULT_GATE")   # a file the test creates when the fault may fire
            end = time.monotonic() + 120
            while gate and not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.02)
            if os.environ.get("FAULT_AFTER_PEERS_SAVED") == "1":   # every other rank has saved `step` (STEP_SLEEP)
                world = int(os.environ["WORLD_SIZE"])
                while time.monotonic() < end and not all(_progress(r) >= step for r in range(world) if r != rank):
                    time.sleep(0.002)
            if kind == "wipe-kill":   # the rank's snapshots are lost with it (as when its node is lost)
                # every rank with a wipe-kill at this step and place goes at the same moment (a node lost whole):
                # each wipes its snapshots first, then says so and waits until all of them have, so that no
                # rank dies - and no restart interrupts a slower one - before every one's snapshots are gone
                import shutil
                shutil.rmtree(cm.slot_dir(), ignore_errors=True)
                open(os.path.join(OUT_DIR, f"wipe.{rank}.{step}.{where}"), "w").close()
                peers = [int(r) for k, r, s, w, *_ in FAULTS if k == "wipe-kill" and int(s) == step and w == where]
                end = time.monotonic() + 60
                while time.monotonic() < end and not all(
                        os.path.exists(os.path.join(OUT_DIR, f"wipe.{r}.{step}.{where}")) for r in peers):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "kill":
                _process_log(f"kill {os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "rot-kill":   # a byte of the rank's newest sealed slot goes bad, then the rank dies
                _rot_newest_slot()
                os.kill(os.getpid(), signal.SIGKILL)
            if kind in ("poke", "inplace"):   # the state changes between its save and the restore, then a raise
                first = next(iter(current["params"]))
                if kind == "poke":
                    first.data[0].add_(0.5)                   # through .data: no version count sees it
                else:
                    with torch.no_grad():
                        first.mul_(1.5)
            if kind == "park":
                with open(os.path.join(OUT_DIR, f"park.{rank}.tmp"), "w") as fh:
                    fh.write(str(os.getpid()))
                os.replace(os.path.join(OUT_DIR, f"park.{rank}.tmp"), os.path.join(OUT_DIR, f"park.{rank}"))
                while True:
                    time.sleep(1)
            raise RuntimeError(f"injected {kind} at step {step} ({where})")


def _rot_newest_slot() -> None:
    """Flip one byte of the tensor data in this rank's newest sealed slot (its checksum no longer matches)."""
    from hyperpodrun.state.slots import snapshot_io
    cm.wait()
    newest = None
    for name in os.listdir(cm.slot_dir()):
        path = os.path.join(cm.slot_dir(), name)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            step, end = snapshot_io.header(data, path)[0], snapshot_io.data_end(data, path)
        except Exception:
            continue
        if newest is None or step > newest[0]:
            newest = (step, path, end)
    with open(newest[1], "r+b") as fh:
        fh.seek(newest[2] - 10)
        byte = fh.read(1)
        fh.seek(newest[2] - 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(os.path.join(OUT_DIR, f"rotted.rank{os.environ['RANK']}"), "w") as fh:
        fh.write(str(newest[0]))


def _forge_inventory() -> None:
    """FORGE_INVENTORY=rank:generation: in that generation this rank's restore inventory is replaced by what an
    outsider without the workers' key sends in its seat: step 1000000 everywhere, tagged under another key."""
    from hyperpodrun.state.restore import restore_inventory
    from hyperpodrun.state.restore import wire_auth
    real = restore_inventory.encode

    def forged(mine, channel, rank):
        restore_inventory.encode = real
        fake = {"shm": [1_000_000], "disk": [], "latest": 1_000_000, "copies": {}, "never_committed": False,
                "live": 1_000_000, "at": 1_000_000}
        outsider = wire_auth.channel(channel.generation, channel.world, channel.run_id, key=os.urandom(32))
        return real(fake, outsider, rank)
    restore_inventory.encode = forged


def _progress(rank: int) -> int:
    """The last step rank `rank` saved, as its progress file says (written with STEP_SLEEP), or -1."""
    try:
        with open(os.path.join(OUT_DIR, f"progress.rank{rank}")) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def bare_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 4 * DIM), nn.GELU(),
                         nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))


DP_OUTER = os.environ.get("RANK_ORDER") == "tp-cp-pp-ep-dp"   # data parallel the slowest dimension


def stage_and_dp(rank):
    """MODE=pipeline's (pipeline stage, data-parallel rank) of `rank` in Megatron's order: rank = dp + 2 * stage
    by default, rank = stage + 2 * dp with RANK_ORDER=tp-cp-pp-ep-dp."""
    return (rank % 2, rank // 2) if DP_OUTER else (rank // 2, rank % 2)


def rank_of(stage, dp):
    return stage + 2 * dp if DP_OUTER else dp + 2 * stage


def build_pipeline(rank):
    """MODE=pipeline: 2 pipeline stages x 2 data-parallel ranks (stage_and_dp): stage 0 holds the first layer,
    stage 1 the rest; each stage's data-parallel pair all-reduces its gradients (so the two ranks of a stage
    hold the same state)."""
    stage, _dp = stage_and_dp(rank)
    groups = [dist.new_group([rank_of(s, 0), rank_of(s, 1)]) for s in (0, 1)]
    current["dp_group"] = groups[stage]
    torch.manual_seed(stage)
    net = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU()) if stage == 0 else \
        nn.Sequential(nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def pipeline_step(net, opt, step, rank):
    """One step of the 2-stage pipeline: activations forward from stage 0 to stage 1, their gradient back."""
    stage, dp = stage_and_dp(rank)
    other = rank_of(1 - stage, dp)
    x, y = batch(step, dp)
    opt.zero_grad()
    if stage == 0:
        h = net(x)
        dist.send(h.detach().contiguous(), other)
        grad = torch.empty_like(h)
        dist.recv(grad, other)
        h.backward(grad)
    else:
        h = torch.empty(x.shape[0], 4 * DIM)
        dist.recv(h, other)
        h.requires_grad_()
        nn.functional.mse_loss(net(h), y).backward()
        dist.send(h.grad.contiguous(), other)
    for p in net.parameters():
        dist.all_reduce(p.grad, group=current["dp_group"])
        p.grad.div_(2)


def build(rank):
    if MODE == "pipeline":
        return build_pipeline(rank)
    model = bare_model()
    if MODE in ("ddp", "zero", "instances"):
        # small buckets, as a large model has several of the default 25 MB
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    elif MODE == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        net = fully_shard(model)

        def fault_in_backward(module, grad_output):   # reduce-scatters of later layers are in flight here
            maybe_fault("allreduce", current["step"], rank, current["gen"])
        model[2].register_full_backward_pre_hook(fault_in_backward)
    else:
        net = model
    if MODE == "zero":   # ZeRO-1: each rank holds the Adam state of its share of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    elif MODE == "instances":
        # Megatron's partial distributed optimizer: gradients all-reduced over every rank (DDP), the Adam state
        # sharded within each of INSTANCES contiguous instances - rank p of every instance holds the same shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        world, n = dist.get_world_size(), int(os.environ.get("INSTANCES", "2"))
        size = world // n
        groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(n)]
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                      process_group=groups[rank // size])
    else:
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    return net, opt


current = {"step": 0, "gen": 0, "params": []}


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


# BUILD_OUTSIDE=1: the model and optimizer are built once, outside the re-executed function; restore() rewinds
# them in place on re-entry, or keeps them. Hand-written all-reduce loop: as they are. MODE=ddp: the bare module
# and its optimizer outside, DistributedDataParallel made again around the module in every generation (it needs
# the process group) - before restore(), the DDP module passed as the state (the README's wrapping), or with
# WRAP_AFTER_RESTORE=1 after it, the bare module passed as the state.
if os.environ.get("BUILD_OUTSIDE") == "1" and MODE == "ddp":
    _bare = bare_model()
    OUTSIDE = (_bare, torch.optim.Adam(_bare.parameters(), lr=1e-3))
else:
    OUTSIDE = build(int(os.environ.get("RANK", 0))) if os.environ.get("BUILD_OUTSIDE") == "1" else None
WRAP_AFTER = os.environ.get("WRAP_AFTER_RESTORE") == "1"
# BIG_MB=N: N MiB more state that training never changes (a module's frozen parameter, so an offloaded save
# copies it in the background): a save that takes long enough for a fault to come while it is copied; BIG_RANK:
# only on that rank
BIG = None
if os.environ.get("BIG_MB") and os.environ.get("BIG_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
    BIG = nn.Module()
    BIG.weight = nn.Parameter(torch.ones(int(os.environ["BIG_MB"]) << 18), requires_grad=False)


def _finalize_gate() -> None:
    """FINALIZE_GATE: a survivor's recovery waits in finalize until the test creates that file (a recovery
    round the test can act in, however fast recovery is)."""
    gate = os.environ.get("FINALIZE_GATE")
    end = time.monotonic() + 120
    while gate and not os.path.exists(gate) and time.monotonic() < end:
        time.sleep(0.02)


@HPWrapper(checkpoint_manager=cm, abort_timeout=30, finalize=CheckpointlessFinalizeCleanup(extra=[_finalize_gate]))
def main(caller=None):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    net, opt = OUTSIDE if OUTSIDE is not None else build(rank)
    bare = None
    if OUTSIDE is not None and MODE == "ddp":
        bare = net
        if not WRAP_AFTER:
            net = nn.parallel.DistributedDataParallel(bare, bucket_cap_mb=0.1)
    current["params"] = list((bare or net).parameters())
    if MODE in ("ddp", "zero", "instances") and bare is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def faulty_allreduce(pg, bucket):   # the default all-reduce, with a fault point inside it
            maybe_fault("allreduce", current["step"], rank, caller.iteration)
            return allreduce_hook(pg, bucket)
        net.register_comm_hook(None, faulty_allreduce)
    state = {"model": net if bare is None or not WRAP_AFTER else bare, "opt": opt}
    if BIG is not None:
        state["big"] = BIG
    if os.environ.get("FORGE_INVENTORY") == f"{rank}:{caller.iteration}":
        _forge_inventory()
    start = cm.restore(state) or 0
    if bare is not None:
        if WRAP_AFTER:
            net = nn.parallel.DistributedDataParallel(bare, bucket_cap_mb=0.1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def faulty_allreduce_outside(pg, bucket):
            maybe_fault("allreduce", current["step"], rank, caller.iteration)
            return allreduce_hook(pg, bucket)
        net.register_comm_hook(None, faulty_allreduce_outside)
    with open(os.path.join(OUT_DIR, f"entries.rank{rank}"), "a") as fh:
        # the process: its pid and start time (the node-loss tests run each node in its own pid namespace, where
        # a replacement's workers may get the pids the lost node's had)
        started = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
        fh.write(f"{caller.iteration} {start} {os.getpid()}@{started}\n")
    with open(os.path.join(OUT_DIR, f"restores.rank{rank}"), "a") as fh:   # how this rank got its state
        fh.write(f"{caller.iteration} {start} {cm.restored_from}\n")
    with open(os.path.join(OUT_DIR, f"via.rank{rank}"), "a") as fh:   # how a replica peer sent it (restored_via)
        fh.write(f"{caller.iteration} {cm.restored_via}\n")
    for step in range(start, STEPS):
        current["step"], current["gen"] = step, caller.iteration
        caller.progress(step)
        maybe_fault("top", step, rank, caller.iteration)
        if MODE == "pipeline":
            pipeline_step(net, opt, step, rank)
        else:
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
        if MODE == "allreduce":
            maybe_fault("allreduce", step, rank, caller.iteration)
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        maybe_fault("prestep", step, rank, caller.iteration)
        opt.step()
        maybe_fault("poststep", step, rank, caller.iteration)
        cm.save(step + 1, state)
        if DUMP_PARAMS and rank == 0:   # the model after every step, for a test that loads a checkpoint elsewhere
            torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
                       os.path.join(OUT_DIR, f"params.step{step + 1}.pt"))
        if STEP_SLEEP:   # a slower job, so that a test can act while it trains (PROGRESS names the last step)
            time.sleep(STEP_SLEEP)
            # with the process's threads and open descriptors: a survivor's must stay flat across restarts
            threads, fds = len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
            with open(os.path.join(OUT_DIR, f"progress.rank{rank}.tmp"), "w") as fh:
                fh.write(f"{step + 1} {caller.iteration} {os.getpid()} {threads} {fds}\n")
            os.replace(os.path.join(OUT_DIR, f"progress.rank{rank}.tmp"), os.path.join(OUT_DIR, f"progress.rank{rank}"))
            with open(os.path.join(OUT_DIR, f"resources.rank{rank}"), "a") as fh:
                fh.write(f"{step + 1} {caller.iteration} {threads} {fds}\n")
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}
    if MODE == "instances":   # each rank's own shard (its replica in the other instance holds the same)
        osd = opt.optim.state_dict()["state"]
    elif MODE == "zero":
        opt.consolidate_state_dict(to=0)
        osd = opt.state_dict()["state"] if rank == 0 else {}
    else:
        osd = opt.state_dict()["state"]
    ost = {k: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() if torch.is_tensor(t) else t
               for n, t in s.items()} for k, s in osd.items()}
    torch.save({"model": full, "opt": ost}, os.path.join(OUT_DIR, f"rank{rank}.pt"))
    # the job's tensors go before the group: a gloo thread must not free one while Python exits
    net = opt = state = loss = full = osd = ost = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
