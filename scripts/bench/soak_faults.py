"""The chaos soak's faults (scripts/bench/soak.py): the seeded schedule, and each kind done to a running job
(soak_jobs.HprJob or soak_jobs.TorchrunJob) the way it happens to a real one - from outside wherever it can be:

  raise        a rank raises an exception (at the top of its next step)
  oom          a rank's allocation fails: a real MemoryError
  kill         a rank's process is SIGKILLed, mid-step
  hang         a rank's process is SIGSTOPped (and never continued): found by the hang timeout
  node         a node dies whole (its pid namespace's init SIGKILLed: agent, workers, its /dev/shm); its command
               is started again 1 s later (a replacement, as a scheduler does)
  spare        a node dies whole and the hot spare already waiting (hyperpodrun: a third agent, not in the
               world size) takes its ranks; nothing is started again for it, and once the job recovered a new
               spare is started to wait for the next loss (torchrun has no waiting spare here: its node's
               command is started again 1 s later, as for `node`)
  double       a rank raises, and once the recovery round has begun (the first restart_signal) another rank,
               on another node, is SIGKILLed: a second fault during the recovery
  coordinator  the standalone coordinator is SIGKILLed and started again at the same address 2-6 s later
  rot          a rank is stopped, a byte of its newest sealed snapshot slot in its node's /dev/shm flipped,
               and the rank SIGKILLed: its replacement must not restore the rotten copy
  logfull      the log filesystem (a small tmpfs holding every node's log dir) is filled to the last byte,
               a rank raises while it is full, and the space comes back once the job recovered

A kind a system has no such part for (torchrun: no coordinator of its own to kill, no snapshot slot, no log
dir of its own; node 0 hosts its rendezvous store) is skipped there and said so.
"""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Optional

KINDS = ("raise", "oom", "kill", "hang", "node", "spare", "double", "coordinator", "rot", "logfull")
WEIGHTS = {"raise": 3, "oom": 1, "kill": 3, "hang": 2, "node": 2, "spare": 2, "double": 1, "coordinator": 1, "rot": 1,
           "logfull": 1}


def schedule(seed: int, minutes: float, mean_s: float, kinds: tuple[str, ...], warmup_s: float,
             ranks: int = 4) -> list[dict[str, Any]]:
    """Faults at offsets (seconds after training began) `mean_s` apart on average (uniformly 2/3..4/3 of it):
    each kind once first (so that a short run has them all), then kinds drawn with WEIGHTS; victims at random.
    The same for every system run on it."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    at = warmup_s
    first = rng.sample(list(kinds), len(kinds))   # every kind once, in a seeded order, then at random
    while at < minutes * 60:
        kind = first[len(out)] if len(out) < len(first) else rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
        rank = rng.randrange(ranks)
        other = rng.choice([r for r in range(ranks) if r // 2 != rank // 2])
        out.append({"i": len(out), "offset": round(at, 2), "kind": kind, "rank": rank, "other": other,
                    "outage_s": round(rng.uniform(2, 6), 2)})
        at += rng.uniform(2 * mean_s / 3, 4 * mean_s / 3)
    return out


def _command(job: Any, rank: int, what: str) -> None:
    path = job.out / f"cmd.rank{rank}"
    path.with_suffix(".tmp").write_text(what)
    os.replace(path.with_suffix(".tmp"), path)


def _signal_rank(job: Any, rank: int, sig: int) -> int:
    pid = job.rank_pid(rank)
    os.kill(pid, sig)
    return pid


def rot_newest_slot(slot_dir: Path) -> Optional[int]:
    """Flip a byte of the checksummed data of the newest sealed slot in `slot_dir`; its step, None if none."""
    from hyperpodrun.state.slots import snapshot_io
    newest = None
    for path in slot_dir.iterdir() if slot_dir.is_dir() else ():
        try:
            data = path.read_bytes()
            step, end = snapshot_io.header(data, str(path))[0], snapshot_io.data_end(data, str(path))
        except Exception:   # a slot being written, or not a slot
            continue
        if newest is None or step > newest[0]:
            newest = (step, path, end)
    if newest is None:
        return None
    with open(newest[1], "r+b") as fh:
        fh.seek(newest[2] - 10)
        byte = fh.read(1)
        fh.seek(newest[2] - 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return newest[0]


def fill(directory: Path) -> int:
    """Write zeros into directory/filler until its filesystem is full; the bytes written."""
    n = 0
    chunk = b"\0" * (1 << 20)
    with open(directory / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                n += fh.write(chunk)
        except OSError:
            pass
        try:   # the last partial chunk
            while fh.write(b"\0" * 4096):
                n += 4096
        except OSError:
            pass
    return n


def inject(job: Any, f: dict[str, Any]) -> dict[str, Any]:
    """Do fault `f` to `job`; returns what was done: t (the fault's time), check_from (the time after which the
    job must have recovered: the last action), and details. Raises NotImplementedError(why) for a kind this
    job cannot have."""
    why = job.unsupported(f)
    if why:
        raise NotImplementedError(why)
    kind, rank = f["kind"], f["rank"]
    rec: dict[str, Any] = {"kind": kind, "rank": rank, "step": job.max_step()}
    t = time.time()
    if kind in ("raise", "oom"):
        _command(job, rank, kind)
    elif kind == "kill":
        rec["pid"] = _signal_rank(job, rank, signal.SIGKILL)
    elif kind == "hang":
        rec["pid"] = _signal_rank(job, rank, signal.SIGSTOP)
    elif kind == "node":
        rec["node"] = rank // 2
        job.kill_node(rank // 2)
        job.wait_node_gone(rank // 2)
        time.sleep(max(0.0, 1.0 - (time.time() - t)))   # "started again 1 s after the loss"
        job.replace_node(rank // 2)
    elif kind == "spare":
        rec["node"] = rank // 2
        rec["taken_over_by"] = job.lose_to_spare(rank // 2)
    elif kind == "double":
        _command(job, rank, "raise")
        rec["second_rank"] = f["other"]
        began = job.wait_event("restart_signal", since=t, timeout=60)
        rec["second_in_round"] = began is not None
        t2 = time.time()
        try:
            rec["second_pid"] = _signal_rank(job, f["other"], signal.SIGKILL)
        except (ProcessLookupError, RuntimeError) as exc:   # its launcher was already ending it (torchrun)
            rec["second_pid"] = None
            rec["second_missed"] = f"{type(exc).__name__}: {exc}"
        rec["second_t"] = t2
    elif kind == "coordinator":
        job.kill_coordinator()
        rec["lost_seen"] = job.wait_event("coordinator_lost", since=t, timeout=30, every_node=True) is not None
        time.sleep(f["outage_s"])   # the outage itself (the fault's length), not a wait for anything
        job.start_coordinator()
        rec["outage_s"] = f["outage_s"]
    elif kind == "rot":
        pid = _signal_rank(job, rank, signal.SIGSTOP)
        rec["rotted_step"] = rot_newest_slot(job.slot_dir(rank))
        os.kill(pid, signal.SIGKILL)
        rec["pid"] = pid
    elif kind == "logfull":
        rec["filled_bytes"] = fill(job.log_fs)
        _command(job, rank, "raise")
    rec["t"] = t
    rec["check_from"] = rec.get("second_t", t)
    return rec


def after_recovery(job: Any, rec: dict[str, Any]) -> None:
    """Undo what outlives a fault once the job recovered from it: the full log filesystem gets its space back;
    a spare that took over is followed by a new one, waiting for the next loss."""
    if rec["kind"] == "spare":
        rec["next_spare_waiting_s"] = job.start_spare()
    if rec["kind"] == "logfull":
        (job.log_fs / "filler").unlink(missing_ok=True)
        rec["freed_at"] = time.time()
