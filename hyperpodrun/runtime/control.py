"""The worker's side of the control plane: a monitor thread that heartbeats and receives commands.

zmq sockets are not thread-safe, so each thread that talks has its own DEALER socket: the monitor
thread (heartbeats; receives RESTART/GO/SHUTDOWN/INJECT) and the main thread (FAULT/READY/DONE).
Forked children (DataLoader workers) inherit neither: after fork the client is disabled in the child.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import zmq

from hyperpodrun import protocol as P

log = logging.getLogger("hyperpodrun.runtime")

_FORK_HOOKED = False
_CLIENTS: list["ControlClient"] = []


def _after_fork_in_child() -> None:
    for client in _CLIENTS:
        client._forked_away()
    _CLIENTS.clear()


class ControlClient:
    """Connection of one worker process to its agent."""

    def __init__(self, endpoint: str, rank: int, heartbeat_interval: float,
                 on_command: Callable[[P._Msg], None], status: Callable[[], dict]) -> None:
        global _FORK_HOOKED
        self.endpoint = endpoint
        self.rank = rank
        self.pid = os.getpid()
        self.interval = heartbeat_interval
        self._on_command = on_command
        self._status = status
        self._ctx = zmq.Context()
        self._main = self._socket(P.MAIN_CHANNEL)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()   # close() wakes the monitor thread's poll at once
        os.set_blocking(self._wake_w, False)
        self._disabled = False
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-monitor", daemon=True)
        if not _FORK_HOOKED:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOKED = True
        _CLIENTS.append(self)

    def _socket(self, tag: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, P.worker_identity(tag, self.rank, os.getpid()))
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.connect(self.endpoint)
        return sock

    def start(self, hello: P.Hello) -> None:
        self._hello = hello
        self._thread.start()

    def send(self, msg: P._Msg) -> None:
        """Main-thread send (FAULT, READY, DONE)."""
        if self._disabled or os.getpid() != self.pid:
            return
        try:
            self._main.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("control message %s not sent: %s", msg.type, exc)

    def _run(self) -> None:
        sock = self._socket(P.MONITOR_CHANNEL)
        sock.send(P.encode(self._hello))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                status = self._status()
                try:
                    sock.send(P.encode(P.Heartbeat(rank=self.rank, pid=self.pid, **status)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                next_beat = now + self.interval
            events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
            if sock in events:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                    msg = P.decode(frame)
                except zmq.ZMQError:
                    continue
                except P.ProtocolError as exc:
                    log.warning("dropped a control message: %s", exc)
                    continue
                try:
                    self._on_command(msg)
                except Exception:  # a handler bug must not kill the heartbeat
                    log.exception("control command %s failed", getattr(msg, "type", "?"))
        sock.close(linger=0)

    def _forked_away(self) -> None:
        """In a forked child: never touch the parent's sockets or context."""
        self._disabled = True
        self._stop.set()
        for fd in (self._wake_r, self._wake_w):   # this process's copies only
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        if self._disabled or os.getpid() != self.pid:
            return
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._main.close(linger=200)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
