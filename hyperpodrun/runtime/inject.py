"""Fault injection inside a worker, armed by the agent (`hyperpodrun inject`) for tests and chaos drills.

An armed fault fires in the worker's main thread when training reports progress at or past its step
(`caller.progress(step)`), so it lands at a known point of the training loop.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from typing import Optional

from hyperpodrun import protocol as P
from hyperpodrun.errors import InjectedFault

log = logging.getLogger("hyperpodrun.runtime")


class Injector:
    """Holds armed faults; `fire_due(step, generation)` runs the ones that are due."""

    def __init__(self) -> None:
        self._armed: list[P.Inject] = []
        self._lock = threading.Lock()

    def arm(self, cmd: P.Inject) -> None:
        with self._lock:
            self._armed.append(cmd)
        log.warning("fault injection armed: %s at step %s", cmd.kind, cmd.step)

    def fire_due(self, step: Optional[int], generation: int) -> None:
        with self._lock:
            due = [c for c in self._armed if (c.generation is None or c.generation == generation)
                   and (c.step is None or (step is not None and step >= c.step))]
            self._armed = [c for c in self._armed if c not in due]
        for cmd in due:
            execute(cmd, step)


def execute(cmd: P.Inject, step: Optional[int]) -> None:
    """Perform one fault in the calling thread."""
    log.warning("injecting %s at step %s", cmd.kind, step)
    if cmd.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif cmd.kind == "segv":
        ctypes.string_at(0)
    elif cmd.kind == "exit":
        os._exit(cmd.exit_code)
    elif cmd.kind == "raise":
        raise InjectedFault(f"injected fault at step {step}")
    elif cmd.kind == "hang":
        n = 0
        while True:  # a Python-level loop: interruptible by the runtime
            n += 1
    elif cmd.kind == "hang-gil":
        ctypes.PyDLL(None).sleep(10 ** 6)   # a C call that keeps the GIL: heartbeats stop
    elif cmd.kind == "hang-c":
        ctypes.CDLL(None).sleep(10 ** 6)    # a C call without the GIL (like a stuck collective)
