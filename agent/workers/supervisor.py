"""Worker processes: spawn each in its own session, track its exit by pid, end its whole tree.

Exits are observed per pid (pidfd where the kernel has it, else polling that pid) - never a bare
waitpid(-1) that would steal statuses. A failing worker is declared dead as soon as it begins to exit
(agent/workers/death_watch.py), before its teardown ends; it is reaped, and its session ended, when the kernel is
done with it. The agent marks itself a child subreaper, so grandchildren that
outlive a worker are re-parented to us and reaped here. A separate reaper process (agent/workers/reaper.py)
kills every registered session if the agent dies, even by SIGKILL.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hyperpodrun.agent.workers.death_watch import DeathWatch
from hyperpodrun.agent.workers.reaper import kill_sessions, session_members
from hyperpodrun.errors import WorkerSpawnError

log = logging.getLogger("hyperpodrun.agent")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (as if it were PID 1)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def describe_exit(code: int) -> str:
    """`exit code 7` or `signal SIGKILL (9)` for a Popen-style return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{name} ({-code})"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    """Popen return code -> process exit status as a shell reports it (signal N -> 128+N)."""
    return 128 - code if code < 0 else code


@dataclass
class WorkerProcess:
    """One worker: its identity in the job and its OS process."""

    local_rank: int
    rank: int
    generation: int
    popen: Any   # subprocess.Popen, or warm_spawner.AdoptedProcess: .pid and .poll()
    started: float = field(default_factory=time.monotonic)
    source: str = "cold"      # the WorkerSource it came from (agent/workers/sources.py)
    pidfd: Optional[int] = None
    returncode: Optional[int] = None
    signalled: bool = False   # we sent it a signal (shutdown, restart): its death is not the root cause

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.returncode is None


class Reaper:
    """Handle on the reaper process; tells it which sessions to kill should the agent die."""

    def __init__(self) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-u", script], stdin=subprocess.PIPE, start_new_session=True,
            close_fds=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):
            log.warning("reaper process is gone; workers may outlive a crash of the agent")

    def add(self, sid: int) -> None:
        self._send(f"add {sid}\n")

    def remove(self, sid: int) -> None:
        self._send(f"del {sid}\n")

    def close(self) -> None:
        """Normal shutdown: sessions were already removed, so the reaper just exits."""
        try:
            if self._proc.stdin:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class Supervisor:
    """Owns the worker processes of this node. Called only from the agent's loop thread."""

    def __init__(self, reaper: Reaper) -> None:
        self.reaper = reaper
        self.workers: dict[int, WorkerProcess] = {}   # by local rank (the live incarnation)
        self._extra: set[int] = {reaper.pid}          # our other children (reaper, hooks)
        self._dying: list[WorkerProcess] = []         # declared dead, still tearing down (not reaped yet)
        self.death_watch: Optional[DeathWatch] = None

    def watch_deaths(self, wake: Callable[[], None]) -> None:
        """See failures when they begin (agent/workers/death_watch.py); `wake` wakes the caller's loop."""
        if self.death_watch is None:
            self.death_watch = DeathWatch(wake)
            for proc in self.live():
                self.death_watch.watch(proc.pid)

    def spawn(self, local_rank: int, rank: int, generation: int, argv: list[str], env: dict[str, str],
              stdout: Optional[int], stderr: Optional[int], cwd: Optional[str] = None) -> WorkerProcess:
        """Start one worker in its own session; stdout/stderr to these fds (the write ends of the pipes the
        agent drains, agent/workers/tee.py; the caller closes them), or the agent's own when None."""
        try:
            popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                     start_new_session=True, close_fds=True)
        except OSError as exc:
            raise WorkerSpawnError(f"cannot start local rank {local_rank} ({argv[0]!r}): {exc.strerror}") from exc
        return self.adopt(local_rank, rank, generation, popen)

    def adopt(self, local_rank: int, rank: int, generation: int, popen: Any, source: str = "cold") -> WorkerProcess:
        """Track a worker process as the live incarnation of `local_rank`: one we started, or the warm
        spawner's fork, re-parented to this subreaper. `popen` has .pid and .poll() like subprocess.Popen."""
        self.reaper.add(popen.pid)
        proc = WorkerProcess(local_rank=local_rank, rank=rank, generation=generation, popen=popen, source=source)
        try:
            proc.pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            proc.pidfd = None
        self.workers[local_rank] = proc
        if self.death_watch is not None:
            self.death_watch.watch(popen.pid)
        return proc

    def poll_exits(self) -> list[WorkerProcess]:
        """Workers that ended since the last call: reaped (their leftover session killed), or declared dead
        because their exit with a failure status has begun (then reaped by a later call)."""
        done = []
        dying = self.death_watch.take() if self.death_watch is not None else {}
        for proc in list(self.workers.values()):
            if proc.returncode is not None:
                continue
            code = proc.popen.poll()
            if code is None:
                if proc.pid not in dying:
                    continue
                proc.returncode = dying[proc.pid]
                self._dying.append(proc)
                try:     # its children and threads go with it now, not after its teardown
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                done.append(proc)
                continue
            proc.returncode = code
            self._finish(proc)
            done.append(proc)
        for proc in list(self._dying):
            if proc.popen.poll() is not None:
                self._dying.remove(proc)
                self._finish(proc)
        return done

    def _finish(self, proc: WorkerProcess) -> None:
        self._close_pidfd(proc)
        if self.death_watch is not None:
            self.death_watch.forget(proc.pid)
        self._end_session(proc.pid)

    def pidfds(self) -> list[int]:
        return [p.pidfd for p in self.live() if p.pidfd is not None]

    def live(self) -> list[WorkerProcess]:
        """Workers still running: the live ones, and the ones declared dead whose teardown has not ended."""
        return [p for p in self.workers.values() if p.alive] + list(self._dying)

    def signal_all(self, sig: int, procs: Optional[list[WorkerProcess]] = None) -> None:
        """Send `sig` to each live worker's whole process group."""
        for proc in procs if procs is not None else self.live():
            proc.signalled = True
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                log.warning("cannot signal rank %d (pid %d): %s", proc.rank, proc.pid, exc)

    def kill(self, proc: WorkerProcess) -> None:
        """SIGKILL a worker's process group now."""
        self.signal_all(signal.SIGKILL, [proc])

    def _end_session(self, sid: int) -> None:
        """Kill whatever the worker left behind in its session, then forget the session."""
        if session_members({sid}):
            kill_sessions({sid}, deadline_s=2.0)
        self.reaper.remove(sid)

    @staticmethod
    def _close_pidfd(proc: WorkerProcess) -> None:
        if proc.pidfd is not None:
            try:
                os.close(proc.pidfd)
            except OSError:
                pass
            proc.pidfd = None

    def close(self) -> None:
        """Stop the death watch (the agent's end)."""
        if self.death_watch is not None:
            self.death_watch.close()

    def track_extra(self, pid: int) -> None:
        self._extra.add(pid)

    def untrack_extra(self, pid: int) -> None:
        self._extra.discard(pid)

    def reap_orphans(self) -> None:
        """Reap re-parented orphans (we are a subreaper, or PID 1) without touching our own children."""
        ours = {p.pid for p in self.workers.values() if p.returncode is None} | {p.pid for p in self._dying} \
            | self._extra
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return
        for task in tasks:
            try:
                with open(f"/proc/self/task/{task}/children") as fh:
                    children = [int(x) for x in fh.read().split()]
            except (OSError, ValueError):
                continue
            for pid in children:
                if pid in ours:
                    continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
