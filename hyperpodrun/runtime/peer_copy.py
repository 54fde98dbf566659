"""Copies of each rank's newest snapshot slot in the shared memory of a rank on another node.

Why: a snapshot in a node's shared memory survives the death of the process but not the loss of the
node. With several nodes, every complete slot of rank r is also sent to its peer rank
(r + ranks per node) mod world - always on another node - which keeps it under
`<shm>/hyperpodrun-<uid>/<run>/peer-of-rank<r>/`. A copy counts only once it has been received completely
(it is written under a temporary name and renamed). At restore, a rank whose own slots are gone gets the
copy from the rank that holds it.

Transport: one TCP connection per sender to the peer's receiver thread, whose address is published in the
generation's store. Sending runs in a background thread and only the newest slot is sent: a slow network
makes copies lag (they are then older than the newest step and simply not used), never slows the step.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Any, Optional

log = logging.getLogger("hyperpodrun.runtime")

_HDR = struct.Struct("<iqq")          # source rank, step, length
_SLOT_HEADER_PROBE = b"\0" * 64       # a slot's header is zeroed before its data changes, rewritten after


def peer_of(rank: int, world: int, local_world: int) -> Optional[int]:
    """The rank on the next node that keeps copies of `rank`'s slots; None on a single node."""
    if world <= local_world:
        return None
    return (rank + local_world) % world


def _local_ip(towards: str) -> str:
    """This host's address on the route to `towards` (the store host)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((towards, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class PeerCopies:
    """Receiver of other ranks' slot copies and sender of this rank's, for the life of the process."""

    def __init__(self, base_dir: str, rank: int) -> None:
        self.base_dir, self.rank = base_dir, rank
        self._server: Optional[socket.socket] = None
        self._pending: Optional[tuple[int, str]] = None
        self._cv = threading.Condition()
        self._target: Optional[tuple[str, int]] = None
        self._conn: Optional[socket.socket] = None
        self._sender: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- receiving
    def held(self) -> dict[int, dict[int, str]]:
        """source rank -> {step: path} of the complete copies held here."""
        from hyperpodrun.runtime import snapshot_io as io
        out: dict[int, dict[int, str]] = {}
        if not os.path.isdir(self.base_dir):
            return out
        for name in os.listdir(self.base_dir):
            if not name.startswith("peer-of-rank"):
                continue
            src = int(name.removeprefix("peer-of-rank"))
            d = os.path.join(self.base_dir, name)
            for f in os.listdir(d):
                if f.endswith(".tmp"):
                    continue
                try:
                    with open(os.path.join(d, f), "rb") as fh:
                        step = io.verify(fh.read(), f)
                except (io.SnapshotCorrupt, OSError) as exc:
                    log.error("ignoring peer copy %s", exc)
                    continue
                out.setdefault(src, {})[step] = os.path.join(d, f)
        return out

    def serve(self, store: Any, store_host: str) -> None:
        """Start the receiver (once per process) and publish its address in this generation's store."""
        if self._server is None:
            self._server = socket.create_server(("", 0))
            threading.Thread(target=self._accept, name="hyperpodrun-peer-recv", daemon=True).start()
        port = self._server.getsockname()[1]
        store.set(f"hyperpodrun/peer-copy/{self.rank}", f"{_local_ip(store_host)}:{port}")

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn,), name="hyperpodrun-peer-recv", daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            while True:
                hdr = _recv_exact(conn, _HDR.size)
                if hdr is None:
                    return
                src, step, length = _HDR.unpack(hdr)
                d = os.path.join(self.base_dir, f"peer-of-rank{src}")
                os.makedirs(d, exist_ok=True)
                path = os.path.join(d, f"slot{step % 2}")
                with open(path + ".tmp", "wb") as fh:
                    left = length
                    while left:
                        chunk = conn.recv(min(left, 1 << 22))
                        if not chunk:
                            return                     # sender gone mid-copy: the copy never counts
                        fh.write(chunk)
                        left -= len(chunk)
                os.replace(path + ".tmp", path)
                conn.sendall(b"\1")

    # ---------------------------------------------------------------- sending
    def connect(self, store: Any, peer: int, timeout: float = 30.0) -> None:
        """Look up the peer's receiver in this generation's store (it may have moved after a restart)."""
        from datetime import timedelta
        store.wait([f"hyperpodrun/peer-copy/{peer}"], timedelta(seconds=timeout))
        host, port = store.get(f"hyperpodrun/peer-copy/{peer}").decode().rsplit(":", 1)
        with self._cv:
            self._target = (host, int(port))
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def send(self, step: int, path: str) -> None:
        """Queue the newest complete slot for the peer (an older one still queued is dropped)."""
        with self._cv:
            if self._target is None:
                return
            self._pending = (step, path)
            self._cv.notify()
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name="hyperpodrun-peer-send", daemon=True)
                self._sender.start()

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                (step, path), self._pending = self._pending, None
                target = self._target
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                    fh.seek(0)
                    if fh.read(len(_SLOT_HEADER_PROBE)) != data[:len(_SLOT_HEADER_PROBE)]:
                        continue           # the slot was rewritten while being read: a newer one is queued
                if self._conn is None and target is not None:
                    self._conn = socket.create_connection(target, timeout=60)
                if self._conn is not None:
                    self._conn.sendall(_HDR.pack(self.rank, step, len(data)) + data)
                    if _recv_exact(self._conn, 1) is None:
                        raise OSError("peer closed the connection")
            except OSError as exc:
                log.warning("copy of step %d to the peer on another node failed: %s", step, exc)
                if self._conn is not None:
                    self._conn.close()
                self._conn = None


def _recv_exact(conn: socket.socket, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf
