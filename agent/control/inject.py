"""`hyperpodrun inject`: the agent's side of fault drills (an INJECT_REQUEST on the control socket).

GPU events (nvml-xid, gpu-lost) go to GPU health as if NVML had reported them; process faults need
--inprocess-restart: `kill` without a step is done here at once (SIGKILL, as an outside `kill -9`: it
counts as the rank's fault), everything else is armed in the rank (INJECT) and fires there. Each request is
answered with one INJECT_REPLY.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Optional

from hyperpodrun import protocol as P
from hyperpodrun.agent.health.gpu_health import GpuHealth
from hyperpodrun.agent.inprocess import InProcess
from hyperpodrun.agent.ports import ControlSender, Events, ProcessTable


class Injector:
    """Answers fault-injection requests. Used from the agent's loop thread only."""

    def __init__(self, control: ControlSender, events: Events, procs: ProcessTable, gpu: Optional[GpuHealth],
                 inproc: Optional[InProcess]) -> None:
        self.control = control
        self.events = events
        self.procs = procs
        self.gpu = gpu
        self.inproc = inproc

    def _reply(self, ident: bytes, ok: bool, detail: str) -> None:
        self.control.send(ident, P.InjectReply(ok=ok, detail=detail))   # a tool that went away needs no answer

    def handle(self, ident: bytes, req: P.InjectRequest) -> None:
        if req.kind in ("nvml-xid", "gpu-lost"):
            ok, detail = self.gpu.inject(req.rank, req.kind, req.xid) if self.gpu is not None else \
                (False, "GPU health checks are off (--health-check none)")
            if ok:
                self.events.emit("inject", f"fault injection: {detail}", rank=req.rank, kind=req.kind, xid=req.xid,
                                 level=logging.WARNING)
            self._reply(ident, ok, detail)
            return
        if self.inproc is None:
            self._reply(ident, False, f"--kind {req.kind} needs a job started with --inprocess-restart")
            return
        st = self.inproc.by_rank(req.rank)
        if st is None or st.pid is None:
            self._reply(ident, False, f"rank {req.rank} is not on this node")
            return
        if not (req.kind == "kill" and req.step is None) and not st.hello:
            self._reply(ident, False, f"rank {req.rank} has not connected yet")
            return
        self.events.emit("inject", f"fault injection: {req.kind} on rank {req.rank}"
                         + (f" at step {req.step}" if req.step is not None else " now"), rank=req.rank,
                         kind=req.kind, step=req.step, level=logging.WARNING)
        if req.kind == "kill" and req.step is None:
            proc = self.procs.workers.get(st.local_rank)
            if proc is not None and proc.alive:
                os.kill(proc.pid, signal.SIGKILL)
            self._reply(ident, True, f"killed rank {req.rank} pid {st.pid}")
            return
        if not self.control.send(st.ident, P.Inject(kind=req.kind, step=req.step, exit_code=req.exit_code,
                                                    xid=req.xid)):
            self._reply(ident, False, f"rank {req.rank} (pid {st.pid}) cannot be reached on the control socket")
            return
        self._reply(ident, True, f"armed {req.kind} on rank {req.rank} (pid {st.pid})")
