"""The agent's control server: a zmq ROUTER on an ipc:// socket in a short private directory.

Socket paths must stay under 107 bytes, so the directory is a fresh 0700 temp dir, not the log dir.
Only the loop thread touches the socket. Malformed frames are logged and dropped.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Iterable, Iterator, Optional

import zmq

from hyperpodrun import protocol as P

log = logging.getLogger("hyperpodrun.agent")


def symptom_grace() -> float:
    """How long a batch that holds only symptoms ("connection closed by peer" from ranks whose peer failed)
    waits for the report of the real cause (HYPERPODRUN_SYMPTOM_GRACE_S, checked in hyperpodrun/launch/settings.py).
    zmq's ROUTER fair-queues between workers, so the rank that raised may be read after a rank that only saw
    the broken connection, although it sent first; and a SIGKILLed rank's exit may be seen after its peers'
    reports."""
    from hyperpodrun.launch import settings
    return settings.current().symptom_grace_s


def is_symptom(msg: P._Msg) -> bool:
    """A fault report that is most likely the consequence of another rank's fault."""
    return isinstance(msg, P.Fault) and msg.secondary and msg.retryable


def split_batch(batch: Iterable[tuple[bytes, P._Msg]]) -> tuple[list[tuple[bytes, P._Msg]], list[tuple[bytes, P._Msg]]]:
    """(everything else, fault reports with real causes first): so that the fault that starts a restart round,
    and is logged as its cause, is a real one whenever the batch holds one."""
    batch = list(batch)
    others = [m for m in batch if not isinstance(m[1], P.Fault)]
    faults = [m for m in batch if isinstance(m[1], P.Fault)]
    faults.sort(key=lambda m: is_symptom(m[1]))   # stable: arrival order within each kind
    return others, faults


class ControlServer:
    """The agent's end of the control plane (the ControlSender port): workers and `hyperpodrun inject` connect
    as DEALERs; messages are addressed by the sender's zmq identity."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="hpr-", dir="/tmp" if os.path.isdir("/tmp") else None)
        os.chmod(self._dir, 0o700)
        self.endpoint = f"ipc://{self._dir}/ctl"
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(self.endpoint)
        os.chmod(f"{self._dir}/ctl", 0o600)   # in a 0700 dir (mkdtemp) already: only this user and root connect

    def receive(self) -> Iterator[tuple[bytes, P._Msg]]:
        """Every message waiting now, as (sender identity, message)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a control frame with %d parts", len(frames))
                continue
            try:
                yield frames[0], P.decode(frames[1])
            except P.ProtocolError as exc:
                log.warning("dropped a control message from %r: %s", frames[0][:32], exc)

    def send(self, ident: Optional[bytes], msg: P._Msg) -> bool:
        """Queue `msg` for the peer `ident` without blocking; False when it cannot be delivered (not connected:
        ROUTER_MANDATORY says so; or its queue is full). The caller decides what an unreachable peer means."""
        if ident is None:
            return False
        try:
            self.sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:   # peer gone (EHOSTUNREACH) or queue full
            log.debug("control send %s to %r failed: %s", getattr(msg, "type", "?"), ident, exc)
            return False

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
