"""Death watch: see a worker's death when it begins, not when its teardown ends.

Why: the kernel reports an exit (pidfd readable, waitpid) only after the dying process has released its
memory and closed its files. For a GPU worker that teardown - unmapping gigabytes of pinned host memory,
the driver destroying its CUDA context - takes 0.5-1 s, and an in-process restart cannot begin before the
agent knows. But the moment of death is visible at once: the kernel's exit path first marks the task
(PF_POSTCOREDUMP since Linux 5.16, then PF_EXITING) and records its exit status, both readable in
/proc/<pid>/stat (fields 9 and 52) while the teardown still runs. A thread reads that file for every live worker every few
milliseconds and wakes the agent's loop when one is exiting with a failure status; the supervisor then
treats the worker as dead (agent/workers/supervisor.py) and reaps it later, when the kernel is done.

Only failures are reported early: an exit status of 0 waits for the real exit, so a job's success is
never decided before every worker has really ended. Where the status cannot be read (a worker that made
itself non-dumpable shows 0) the normal exit notice still comes: nothing is missed, only later.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

log = logging.getLogger("hyperpodrun.agent")

PF_EXITING = 0x00000004
PF_POSTCOREDUMP = 0x00000008   # set first thing in do_exit (Linux >= 5.16; unused before)
EXIT_BEGUN = PF_EXITING | PF_POSTCOREDUMP
#: how often the thread reads each live worker's /proc/<pid>/stat (a few microseconds per read)
POLL_S = 0.005
#: and how often it looks again while it watches nothing (a hot spare, between generations)
IDLE_S = 0.1


def exiting_status(stat: bytes) -> Optional[int]:
    """The wait status of a task that has begun to exit with a failure, from its /proc/<pid>/stat line;
    None while it runs (or exits with status 0, or the line is not what the kernel writes)."""
    close = stat.rfind(b")")   # the command name (field 2) may hold spaces and parentheses
    if close < 0:
        return None
    fields = stat[close + 1:].split()
    # fields[0] is field 3 (state); flags is field 9, exit_code field 52 (Linux >= 3.5)
    if len(fields) < 50:
        return None
    try:
        flags, status = int(fields[6]), int(fields[49])
    except ValueError:
        return None
    if not flags & EXIT_BEGUN or status == 0:
        return None
    return status


def exit_code_of(status: int) -> int:
    """A wait status as a Popen return code: -N for signal N, else the exit code."""
    try:
        return os.waitstatus_to_exitcode(status)
    except ValueError:
        return 1


class DeathWatch:
    """Watches pids; `take()` returns those seen dying (pid -> Popen-style return code) since the last call.

    `wake` is called from the watch thread when there is something to take (the agent loop's wake-up)."""

    def __init__(self, wake: Callable[[], None], interval_s: float = POLL_S) -> None:
        self._wake = wake
        self._interval = interval_s
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-death-watch", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return   # already gone: its exit notice comes the usual way
        with self._lock:
            old = self._fds.pop(pid, None)
            self._fds[pid] = fd
        if old is not None:
            os.close(old)

    def forget(self, pid: int) -> None:
        with self._lock:
            fd = self._fds.pop(pid, None)
            self._seen.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def take(self) -> dict[int, int]:
        with self._lock:
            seen, self._seen = self._seen, {}
        return seen

    def _run(self) -> None:
        while not self._stop.wait(self._interval if self._fds else IDLE_S):
            found = False
            with self._lock:
                for pid, fd in list(self._fds.items()):
                    try:
                        status = exiting_status(os.pread(fd, 1024, 0))
                    except OSError:    # reaped meanwhile: the supervisor has it
                        status = None
                    if status is not None:
                        self._seen[pid] = exit_code_of(status)
                        del self._fds[pid]
                        os.close(fd)
                        found = True
            if found:
                self._wake()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


__all__ = ["DeathWatch", "exiting_status", "exit_code_of"]
