"""Standby workers: processes started ahead that become a rank which died (a WorkerSource, agent/ports.py).

Why: a respawned rank is on the critical path of an in-process restart. A warm fork (agent/workers/sources.py,
WarmFork) saves the interpreter start and the imports, but the new process still makes its CUDA context
(0.3 s on an H200 host) and, on a GPU host, a fork after CUDA is impossible - so the fork must come first.
A standby is that fork made ahead: the zygote forks it once its imports are done, it makes the CUDA
context of its local rank's GPU and waits. When its rank dies it is told the rank's argv, environment,
directory and log descriptors and runs the script as `__main__` - no fork, no import, no context on the
critical path.

`--standby-workers N` standbys per local rank slot (0: off). A standby is never a worker: it has no rank,
is never counted in WORLD_SIZE, and lives in the zygote's session until it becomes a rank, so the reaper
kills it with the zygote's session if the agent dies. One that dies is replaced (event `standby_lost`),
one that is used is replaced (`standby_ready` when the new one is ready). When no standby can serve a
respawn (none ready yet, or the rank's CUDA_VISIBLE_DEVICES changed since the standby made its context)
the next source serves it (warm fork, cold start) and the event log says why (`standby_unused`).
Memory: each standby holds what the zygote imported (torch: about 0.3-0.5 GB of host memory, mostly shared
with the zygote's pages) and, on a GPU host, one CUDA context (about 0.5 GB of GPU memory).
On a GPU host a standby also does, before it reports ready, a one-rank NCCL group (NCCL's per-process start,
0.4 s, off the critical path), and while it waits it maps and registers with CUDA its local rank's snapshot
slots (hyperpodrun/state/slots/pinned_read.py, `prepin`): the restore after it takes over copies by DMA from
them at once and the rank's saves write through them. Those are the slot files' own pages (in /dev/shm):
pinning adds no copy, only locks them.
With `--standby-prerun auto` (the default) a standby also runs the script ahead, up to its first HPWrapper call,
and is ready only once it parks there (agent/workers/prerun.py, hyperpodrun/runtime/park.py): a replacement
then skips the script's top too (a model built at module level). Such a standby has a session and process group
of its own (the reaper knows it; it is killed as a group); it serves a rank only where the rank's environment is
the one it ran the script with (`prerun.mismatch`); and the first one that gives up (the script read a rank's
variable at its top, ...) turns pre-run off for the job with one `standby_prerun` event.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hyperpodrun.agent.workers import prerun, warm_spawner
from hyperpodrun.agent.ports import Events, SpawnRequest
from hyperpodrun.agent.workers.sources import WarmFork
from hyperpodrun.agent.workers.supervisor import Supervisor, WorkerProcess, describe_exit
from hyperpodrun.agent.workers.warm_spawner import AdoptedProcess

log = logging.getLogger("hyperpodrun.agent")

#: a standby that dies before it is ready is forked again after this long, doubling up to MAX_BACKOFF_S
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
#: how long the agent waits for a standby to confirm that it became the rank
ACTIVATE_TIMEOUT_S = 2.0


@dataclass
class _Standby:
    local_rank: int
    pid: int
    chan: socket.socket
    process: AdoptedProcess
    env_cuda: Optional[str]           # CUDA_VISIBLE_DEVICES when it was forked (its context is for that)
    ready: Optional[dict[str, Any]] = None
    born: float = 0.0
    ahead: Optional[dict[str, str]] = None   # the environment it runs the script ahead with (None: it waits before)
    gave_up: Optional[str] = None             # why it could not run the script ahead (it exits)


class StandbyPool:
    """The standbys of this node, per local rank slot. Used from the agent's loop thread only."""

    name = "standby"

    def __init__(self, sup: Supervisor, events: Events, warm: WarmFork, per_slot: int, nproc: int,
                 base_env: dict[str, str], slot_dir_for: Callable[[int], Optional[str]] = lambda _lr: None,
                 cuda_for: Optional[Callable[[int], str]] = None,
                 prerun_for: Optional[Callable[[int], dict[str, Any]]] = None) -> None:
        self.sup = sup
        # --standby-prerun auto: {argv, env, cwd} of a slot's standby that runs the script ahead (None: off)
        self.prerun_for = prerun_for
        self.prerun = prerun.PrerunState(prerun_for is not None)
        # the CUDA_VISIBLE_DEVICES a slot's worker gets where it is not the node's (--virtual-local-rank): the
        # standby sets it before it makes its CUDA context, so that its context is that worker's
        self.cuda_for = cuda_for
        self.slot_dir_for = slot_dir_for
        self.events = events
        self.warm = warm
        self.per_slot = per_slot
        self.base_env = base_env
        self.pool: dict[int, list[_Standby]] = {lr: [] for lr in range(nproc)}
        self._next_fork: dict[int, float] = {lr: 0.0 for lr in range(nproc)}
        self._backoff: dict[int, float] = {lr: BACKOFF_S for lr in range(nproc)}
        self.stopped = False

    # ------------------------------------------------------------------ upkeep (every loop tick)
    def poll(self) -> None:
        """Replace standbys that died, note the ones that became ready, fork the missing ones."""
        spawner = self.warm.spawner
        if not self.per_slot or self.stopped or spawner is None or not spawner.check_ready():
            return
        now = time.monotonic()
        for slot, items in self.pool.items():
            for sb in list(items):
                code = sb.process.poll()
                if code is not None:
                    if sb.ready is None and sb.gave_up is None:
                        self._read_ready(sb, now, exited=True)   # its last words: why it gave up the pre-run
                    self._forget(sb)
                    items.remove(sb)
                    if sb.gave_up is not None:   # said once by _gave_up; the next one waits before the script
                        continue
                    early = sb.ready is None
                    self._next_fork[slot] = now + (self._backoff[slot] if early else 0.0)
                    self._backoff[slot] = min(MAX_BACKOFF_S, self._backoff[slot] * 2) if early else BACKOFF_S
                    self.events.emit("standby_lost", f"the standby for local rank {slot} (pid {sb.pid}) exited: "
                                     f"{describe_exit(code)}; starting another", local_rank=slot, pid=sb.pid,
                                     level=logging.WARNING)
                elif sb.ready is None and sb.gave_up is None:
                    self._read_ready(sb, now)
            while len(items) < self.per_slot and now >= self._next_fork[slot]:
                cuda = self.cuda_for(slot) if self.cuda_for is not None else None
                ahead = self.prerun_for(slot) if self.prerun_for is not None and self.prerun.on else None
                extra: dict[str, Any] = {"prerun": ahead} if ahead is not None else {}
                try:
                    pid, chan = spawner.fork_standby(slot, slot_dir=self.slot_dir_for(slot), cuda_visible=cuda, **extra)
                except warm_spawner.WarmSpawnError as exc:
                    log.info("no standby for local rank %d for now: %s", slot, exc)
                    self._next_fork[slot] = now + self._backoff[slot]
                    break
                self.sup.track_extra(pid)
                if ahead is not None:   # its own session (prerun.run_ahead): the reaper ends it with the agent
                    self.sup.reaper.add(pid)
                items.append(_Standby(slot, pid, chan, AdoptedProcess(pid),
                                      cuda if cuda is not None else self.base_env.get("CUDA_VISIBLE_DEVICES"), born=now,
                                      ahead=ahead["env"] if ahead is not None else None))

    def _read_ready(self, sb: _Standby, now: float, exited: bool = False) -> None:
        """Its ready report, or a pre-run's reason to give up; `exited`: its process has been reaped (read what it
        left, kill nothing)."""
        r, _, _ = select.select([sb.chan], [], [], 0)
        if not r:
            return
        try:
            msg = sb.chan.recv(1 << 16)
        except OSError:
            msg = b""
        if not msg:
            if not exited:
                self._kill(sb)   # its socket closed before it was ready: it is on its way out (poll sees the exit)
            return
        report = json.loads(msg)
        if "prerun_gave_up" in report:
            self._gave_up(sb, str(report["prerun_gave_up"]))
            return
        sb.ready = report
        self._backoff[sb.local_rank] = BACKOFF_S
        where = f"CUDA context on GPU {sb.ready.get('device')}" if sb.ready.get("cuda") else "no GPU"
        if sb.ready.get("kernel_warm") == "background":
            where += ", warming its kernels"
        ahead = sb.ready.get("prerun")
        if isinstance(ahead, dict):
            where += f", the script run ahead to {ahead.get('function')} in {ahead.get('prerun_s')}s"
        self.events.emit("standby_ready", f"standby for local rank {sb.local_rank} ready (pid {sb.pid}, {where}, "
                         f"{now - sb.born:.2f}s)", local_rank=sb.local_rank, pid=sb.pid, cuda=bool(sb.ready.get("cuda")),
                         ready_s=round(now - sb.born, 3), prerun=isinstance(ahead, dict), level=logging.DEBUG)

    def _gave_up(self, sb: _Standby, why: str) -> None:
        """A standby could not run the script ahead (it exits): say so once; the ones after it wait before the
        script. Not a lost standby: its replacement starts at once."""
        sb.gave_up = why
        message, level = self.prerun.give_up(why)
        self.events.emit("standby_prerun", message, local_rank=sb.local_rank, pid=sb.pid, why=why, level=level)
        self._next_fork[sb.local_rank] = 0.0

    # ------------------------------------------------------------------ the WorkerSource port
    def spawn(self, req: SpawnRequest) -> Optional[WorkerProcess]:
        """The rank of `req` from a ready standby of its slot, or None (the event log says why)."""
        if not self.per_slot or self.stopped:
            return None
        items = self.pool.get(req.local_rank, [])
        sb = next((s for s in items if s.ready is not None), None)
        if sb is None:
            why = "its standby is still starting" if items else "no standby (starting again after one was used or lost)"
            if items and all(s.ahead is not None for s in items):
                why = "its standby is still running the script ahead (--standby-prerun)"
            self._unused(req, why)
            return None
        if req.env.get("CUDA_VISIBLE_DEVICES") != sb.env_cuda:
            self._unused(req, "the rank's CUDA_VISIBLE_DEVICES changed since its standby made its CUDA context")
            return None
        differs = prerun.mismatch(sb.ahead, req.env) if sb.ahead is not None else None
        if differs is not None:   # its script's top may have read what changed: it goes, another comes
            items.remove(sb)
            self._kill(sb)
            self._forget(sb)
            self._unused(req, differs)
            return None
        items.remove(sb)
        fds = [fd if fd is not None else std for fd, std in zip((req.stdout, req.stderr), (1, 2))]
        answered = False
        try:
            socket.send_fds(sb.chan, [json.dumps({"argv": list(req.argv[2:]), "env": dict(req.env),
                                                  "cwd": os.getcwd()}).encode()], fds)
            r, _, _ = select.select([sb.chan], [], [], ACTIVATE_TIMEOUT_S)
            answered = bool(r)
            ack = sb.chan.recv(1 << 10) if r else b""
        except OSError:
            ack, answered = b"", True
        if not ack:
            self._kill(sb)
            self._forget(sb)
            self._unused(req, f"its standby (pid {sb.pid}) did not take the rank "
                         f"({'it exited' if answered else f'no answer within {ACTIVATE_TIMEOUT_S:g}s'})")
            return None
        self._forget(sb, became_rank=True)
        return self.sup.adopt(req.local_rank, req.rank, req.generation, sb.process, source=self.name)

    def _unused(self, req: SpawnRequest, why: str) -> None:
        self.events.emit("standby_unused", f"rank {req.rank}: not from a standby: {why}", rank=req.rank,
                         local_rank=req.local_rank, why=why, level=logging.INFO)

    # ------------------------------------------------------------------ the end
    def _kill(self, sb: _Standby) -> None:
        """SIGKILL it - a pre-run standby with its process group (what its script started)."""
        if sb.ahead is not None:
            try:
                os.killpg(sb.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):   # not its own group yet (before its setsid)
                pass
        try:
            os.kill(sb.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _forget(self, sb: _Standby, became_rank: bool = False) -> None:
        """Not the pool's any more: used (`became_rank`: the supervisor owns it now), or gone. What a pre-run
        standby's script started goes with it (its process group, while the group has members)."""
        try:
            sb.chan.close()
        except OSError:
            pass
        self.sup.untrack_extra(sb.pid)
        if sb.ahead is not None and not became_rank:
            try:
                os.killpg(sb.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.sup.reaper.remove(sb.pid)

    def stop(self) -> None:
        """No more respawns: every standby goes (SIGKILL: it holds nothing; reaped here)."""
        self.stopped = True
        standbys = [sb for items in self.pool.values() for sb in items]
        for items in self.pool.values():
            items.clear()
        for sb in standbys:
            self._kill(sb)
        end = time.monotonic() + 2.0
        for sb in standbys:
            while sb.process.poll() is None and time.monotonic() < end:
                time.sleep(0.005)
            self._forget(sb)

    def live_pids(self) -> list[int]:
        return [sb.pid for items in self.pool.values() for sb in items]


__all__ = ["StandbyPool"]
