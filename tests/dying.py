"""Hold a process in the middle of its death, as a GPU worker's slow teardown does (tests only).

The test process attaches with ptrace (PTRACE_SEIZE with PTRACE_O_TRACEEXIT) and delivers a fatal signal to
the process's main thread: the kernel begins the exit (PF_EXITING set, exit status recorded) and stops the
task at PTRACE_EVENT_EXIT, before its memory and files are released. Until `release()` the process is dying
but not dead: no exit notice (pidfd, waitpid) reaches its parent and its sockets stay open. Every call must
come from the thread that made the object (ptrace's tracer is a thread).
"""
from __future__ import annotations

import ctypes
import os
import signal

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_O_TRACEEXIT = 0x40
PTRACE_EVENT_EXIT = 6
WALL = 0x40000000


def _ptrace(request: int, pid: int, data: int = 0) -> None:
    if _libc.ptrace(request, pid, None, ctypes.c_void_p(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {pid}): {os.strerror(err)}")


class HeldDeath:
    """Kill `pid` with `sig` (default action: terminate) and hold it in its exit."""

    def __init__(self, pid: int, sig: int = signal.SIGALRM) -> None:
        self.pid = pid
        self.sig = sig
        self.held = False
        _ptrace(PTRACE_SEIZE, pid, PTRACE_O_TRACEEXIT)
        if _libc.tgkill(pid, pid, sig) != 0:   # the main thread, the one we trace, takes the signal
            raise OSError(ctypes.get_errno(), "tgkill")
        while True:
            _, status = os.waitpid(pid, WALL)
            if not os.WIFSTOPPED(status):
                raise AssertionError(f"pid {pid} ended before its exit stop (status {status:#x})")
            if status >> 8 == signal.SIGTRAP | (PTRACE_EVENT_EXIT << 8):
                self.held = True
                return
            stopsig = os.WSTOPSIG(status)
            _ptrace(PTRACE_CONT, pid, stopsig if stopsig != signal.SIGTRAP else 0)

    def state(self) -> str:
        """The process's state letter in /proc (t: stopped in its exit), or '' once it is gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""

    def release(self) -> None:
        """Let the exit finish."""
        if self.held:
            self.held = False
            try:
                _ptrace(PTRACE_DETACH, self.pid, 0)
            except OSError:
                pass   # killed meanwhile (SIGKILL ends the stop)
