"""The agent's control server: a zmq ROUTER on an ipc:// socket in a short private directory.

Socket paths must stay under 107 bytes, so the directory is a fresh 0700 temp dir, not the log dir.
Only the loop thread touches the socket. Malformed frames are logged and dropped.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Iterator, Optional

import zmq

from hyperpodrun import protocol as P

log = logging.getLogger("hyperpodrun.agent")


class ControlServer:
    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="hpr-", dir="/tmp" if os.path.isdir("/tmp") else None)
        os.chmod(self._dir, 0o700)
        self.endpoint = f"ipc://{self._dir}/ctl"
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(self.endpoint)

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
        if ident is None:
            return False
        try:
            self.sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:   # peer gone (EHOSTUNREACH) or queue full
            log.debug("control send %s to %r failed: %s", msg.type, ident, exc)
            return False

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
