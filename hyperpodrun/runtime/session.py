"""This worker process's link to its agent under `hyperpodrun --inprocess-restart` (one per process).

The session owns the control client (heartbeats and commands, hyperpodrun/runtime/control.py), the
interrupter that unwinds the training function at a RESTART, the armed fault injections, and what the
agent has said so far: the GO of each generation, a SHUTDOWN. Commands arrive on the monitor thread; the
main thread (HPWrapper's generation loop, hyperpodrun/runtime/wrapper.py) waits on them with `wait()`.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable, ClassVar, Optional

from hyperpodrun import env as E
from hyperpodrun import protocol as P
from hyperpodrun.errors import OutOfOrderError
from hyperpodrun.runtime.abort import park_process_groups
from hyperpodrun.runtime.inject import Injector, execute

log = logging.getLogger(__name__)
from hyperpodrun.runtime.interrupt import Interrupter
from hyperpodrun.runtime.torch_state import _abort_nccl_from_monitor, _collective_seq, _device_ids, _main_stack

#: our wrapper of torch's destroy_process_group, once installed (installed once per process)
_parking_destroy: Optional[Callable[..., Any]] = None


class Session:
    """This process's connection to the agent and its restart bookkeeping (`Session.get()`: one per process)."""

    _instance: ClassVar[Optional["Session"]] = None

    def __init__(self, channel_factory: Optional[Callable[..., Any]] = None) -> None:
        from hyperpodrun.runtime.agent_channel import HPAgentK8sAPIFactory
        ctx = E.worker_context()
        if ctx.control is None:
            raise OutOfOrderError("a control session outside --inprocess-restart (no HYPERPODRUN_CONTROL)")
        self.rank = int(os.environ["RANK"])
        self.local_rank = E.real_local_rank()   # the agent's slot of it (LOCAL_RANK is 0 under --virtual-local-rank)
        self.generation = ctx.generation
        self.step: Optional[int] = None
        self.state = "running"                  # running | recovering | waiting | done (heartbeats carry it)
        self.device: dict[str, Any] = _device_ids()   # GPU UUID / PCI bus id, once CUDA is initialised
        self.interrupter = Interrupter()
        self.restart_seen = -1     # highest generation a RESTART named (set before any abort)
        self._before_abort: list[Callable[[], None]] = []
        self.interrupter.install_optimizer_hooks()
        _park_on_destroy()
        self.injector = Injector()
        self.go: dict[int, P.Go] = {}
        self.shutdown: Optional[P.Shutdown] = None
        self.reason = ""
        #: seconds the abort right after a fault took (added to the next READY's abort_s)
        self.first_abort_s = 0.0
        #: (abort_s, finalize_s, health_s) of the last recovery, reported with READY
        self.timings: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._cv = threading.Condition()
        # the channel to the agent: HPWrapper(hp_api_factory=...)'s factory, by default the agent hyperpodrun gave
        self.client = (channel_factory or HPAgentK8sAPIFactory())(self.rank, self._on_command, self._status)
        self.client.start(P.Hello(rank=self.rank, local_rank=self.local_rank, pid=os.getpid(),
                                  generation=self.generation, **self.device))

    def move_to(self, rank: int) -> None:
        """This process's global rank changed (an elastic job shrank or grew): say so in every message from now."""
        self.rank = rank
        self.client.rank = rank

    @classmethod
    def get(cls, channel_factory: Optional[Callable[..., Any]] = None) -> "Session":
        """This process's session (a forked child gets its own); `channel_factory` builds its channel to the
        agent when the session is made here (HPAgentK8sAPIFactory's signature; default HPAgentK8sAPIFactory())."""
        if cls._instance is None or cls._instance.client.pid != os.getpid():
            cls._instance = Session(channel_factory)
        return cls._instance

    # monitor thread
    def _status(self) -> dict[str, Any]:
        status = {"generation": self.generation, "step": self.step, "seq": _collective_seq(), "state": self.state,
                  **self.device}
        if self.state == "recovering" or (self.state == "running" and self.interrupter.target > self.generation):
            status["stack"] = _main_stack()   # a restart is under way: where this rank is, should it not get READY
        return status

    def on_abort(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever an abort is about to begin (a RESTART arrived, or this rank failed),
        before any communicator is touched; registered once per callback."""
        if callback not in self._before_abort:
            self._before_abort.append(callback)

    def aborting(self) -> None:
        """An abort begins: run the on_abort callbacks (a failing one is logged, never raised)."""
        for callback in list(self._before_abort):
            try:
                callback()
            except Exception as exc:
                log.warning("rank %d: an on_abort callback failed: %r", self.rank, exc)

    def _on_command(self, msg: P._Msg) -> None:
        if isinstance(msg, P.Restart):
            self.reason = msg.reason
            self.aborting()
            # before the abort: a snapshot whose copy completes from here on may hold aborted work
            self.restart_seen = max(self.restart_seen, msg.generation)
            if msg.generation > self.interrupter.target and self.state == "running":
                _abort_nccl_from_monitor()
            self.interrupter.request(msg.generation)
        elif isinstance(msg, P.Inject):
            if msg.step is None and msg.kind in ("kill", "segv", "exit"):
                execute(msg, self.step)
            else:
                self.injector.arm(msg)
            return
        with self._cv:
            if isinstance(msg, P.Go):
                self.go[msg.generation] = msg
            elif isinstance(msg, P.Shutdown):
                self.shutdown = msg
            self._cv.notify_all()

    # main thread
    def wait(self, done: Callable[[], bool]) -> None:
        """Block until `done()` holds; it is re-checked whenever a command arrives (and twice a second)."""
        with self._cv:
            while not done():
                self._cv.wait(0.5)

    def send(self, msg: P._Msg) -> None:
        """Send FAULT / READY / DONE / RESTORED to the agent (never blocks)."""
        self.client.send(msg)


def _park_on_destroy() -> None:
    """Make the user's own `destroy_process_group()` park the groups first (see abort.park_process_groups):
    otherwise the group dies when the function's frame (holding DDP) is freed, in the main thread."""
    global _parking_destroy
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return
    original = c10d.destroy_process_group
    if _parking_destroy is not None and original is _parking_destroy:
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        park_process_groups()
        return original(*args, **kwargs)
    _parking_destroy = destroy_process_group
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
