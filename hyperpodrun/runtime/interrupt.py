"""Interrupting the worker's main thread on RESTART without ever splitting an optimizer step.

The monitor thread raises `RestartInterrupt` asynchronously in the main thread (it lands at the next
Python bytecode boundary; code inside a C call cannot be interrupted - the agent kills such a rank when
it has to). Global optimizer step hooks mark `Optimizer.step` as a critical section: an interrupt that
arrives during a step is deferred and raised right after the step completed; one that was queued just
before a step began is withdrawn and deferred the same way.
"""
from __future__ import annotations

import ctypes
import contextlib
import threading
from typing import Any, Iterator, Optional


class RestartInterrupt(BaseException):
    """Raised in the main thread when the agent starts a restart. A BaseException, so `except Exception`
    in user code does not swallow it."""


def _set_async_exc(tid: int, exc: Any) -> int:
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid),
                                                      ctypes.py_object(exc) if exc is not None else None)


class Interrupter:
    """One per process; methods are called from the main thread and the monitor thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tid = threading.main_thread().ident or 0
        self._in_fn = False
        self._depth = 0
        self._queued = False      # an async exception is pending in the main thread
        self._deferred = False    # raise once the current optimizer step is over
        self.target = -1          # highest generation a RESTART asked for
        self._hooks: Optional[tuple[Any, ...]] = None   # the optimizer step hooks' handles, once installed

    def install_optimizer_hooks(self) -> None:
        if self._hooks is not None:
            return
        try:
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)
        except ImportError:   # very old torch: steps are not protected (documented)
            self._hooks = ()
            return
        self._hooks = (register_optimizer_step_pre_hook(self._pre_step),
                       register_optimizer_step_post_hook(self._post_step))

    # --- monitor thread
    def request(self, generation: int) -> None:
        """A RESTART for `generation` arrived: interrupt fn now, or right after the optimizer step."""
        with self._lock:
            if generation <= self.target:
                return
            self.target = generation
            if not self._in_fn or self._queued or self._deferred:
                return
            if self._depth > 0:
                self._deferred = True
            else:
                _set_async_exc(self._tid, RestartInterrupt)
                self._queued = True

    # --- main thread
    def enter_fn(self, generation: int) -> None:
        with self._lock:
            self._in_fn = True
            self._depth = 0
            self._queued = self._deferred = False
            pending = self.target > generation
        if pending:
            self.leave_fn()
            raise RestartInterrupt()

    def leave_fn(self) -> None:
        with self._lock:
            self._in_fn = False
            if self._queued:
                _set_async_exc(self._tid, None)   # withdraw an exception not yet delivered
            self._queued = self._deferred = False
            self._depth = 0

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section an interrupt must not split (a snapshot being written): it lands right after."""
        self._pre_step()
        try:
            yield
        finally:
            self._post_step()

    def _pre_step(self, *_args: Any) -> None:
        with self._lock:
            if self._queued:
                _set_async_exc(self._tid, None)
                self._queued = False
                self._deferred = True
            self._depth += 1

    def _post_step(self, *_args: Any) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            fire = self._deferred and self._depth == 0 and self._in_fn
            if fire:
                self._deferred = False
        if fire:
            raise RestartInterrupt()
