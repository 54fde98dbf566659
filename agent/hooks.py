"""--pre-train-script / --post-train-script: run once per node, before and after the workers."""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from hyperpodrun.agent.workers.reaper import kill_sessions, session_members
from hyperpodrun.agent.workers.supervisor import describe_exit, shell_code

log = logging.getLogger("hyperpodrun.agent")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def hook_argv(script: str, args: list[str]) -> list[str]:
    """An executable runs as is; a .py file with this Python; anything else with /bin/sh."""
    if os.access(script, os.X_OK) and not os.path.isdir(script):
        return [script, *args]
    if script.endswith(".py"):
        return [sys.executable, script, *args]
    return ["/bin/sh", script, *args]


class _Forwarder:
    """While a hook runs, a signal the agent handles also goes to the hook's process group (as to workers);
    the agent's own handler still sees it. Installed before the hook starts, so no signal slips through."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.received: list[int] = []
        self.first_at: Optional[float] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Forwarder":
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                handler = signal.getsignal(sig)
                if callable(handler):
                    self._previous[sig] = handler
                    signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.send(signum)
        self._previous[signum](signum, frame)

    def send(self, signum: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signum)
            except OSError:
                pass

    def wait(self, proc: subprocess.Popen, shutdown_timeout: float) -> int:
        """Wait for the hook; SIGKILL its process group `shutdown_timeout` after the first signal."""
        self.proc = proc
        for signum in self.received:   # arrived while the hook was being started
            self.send(signum)
        while True:
            try:
                return proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                if self.first_at is not None and time.monotonic() - self.first_at >= shutdown_timeout:
                    self.send(signal.SIGKILL)


def run_hook(kind: str, script: str, args: list[str], events: Any, sup: Any, shutdown_timeout: float = 30.0) -> int:
    """Run a hook to completion; return its exit status (signal N -> 128+N) and log a clear line.

    The hook runs in its own session, registered with the reaper like a worker: a signal to the agent is
    forwarded to it, and nothing it started outlives it or the agent.
    """
    argv = hook_argv(script, args)
    events.emit(f"{kind}_start", f"{kind} script: {shlex.join(argv)}")
    with _Forwarder() as forwarder:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            events.emit(f"{kind}_failed", f"{kind} script {script!r} cannot start: {exc.strerror}",
                        level=logging.ERROR)
            return 127
        sup.track_extra(proc.pid)
        sup.reaper.add(proc.pid)
        try:
            code = forwarder.wait(proc, shutdown_timeout)
        finally:
            if session_members({proc.pid}):
                kill_sessions({proc.pid}, deadline_s=2.0)
            sup.reaper.remove(proc.pid)
        stopped = bool(forwarder.received)
    status = shell_code(code)
    if status and stopped:
        events.emit(f"{kind}_stopped", f"{kind} script {script!r} stopped ({describe_exit(code)}) by the signal "
                    "hyperpodrun received", level=logging.WARNING, exit_code=status)
    elif status:
        events.emit(f"{kind}_failed", f"{kind} script {script!r} failed with exit code {status}; "
                    "fix the script or drop the flag", level=logging.ERROR, exit_code=status)
    else:
        events.emit(f"{kind}_done", f"{kind} script finished")
    return status
