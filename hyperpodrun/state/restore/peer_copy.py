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

Security (docs/security.md): the receiver listens on the job's interface only (netaddr.py), and every
connection starts with a mutual HMAC challenge-response on a key derived from the workers' key the agent
hands down (HYPERPODRUN_JOB_KEY); nothing else is read before the sender has proved it knows it, and the
sender sends nothing to a receiver that does not. Every copy then carries a MAC under the connection's
session key. A receiver takes copies from one rank only - the one whose peer it is - and only up to
`MARGIN` times the size of its own snapshot (the ranks a peer pairs up hold comparable state; before its
first snapshot: half the free shared memory), and only while the copy leaves `RESERVE` bytes of the shared
memory free. Copies are files of mode 0600 in 0700 directories; they are read back only from such a
directory, never through a symlink, and only after `snapshot_io.verify` accepts them.
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
from typing import Any, Optional

from hyperpodrun import auth, netaddr, safe_fs
from hyperpodrun.env import real_local_rank
from hyperpodrun.state.slots import shm_runs

log = logging.getLogger("hyperpodrun.runtime")

_HDR = struct.Struct("<iqq")          # source rank, step, length
_SLOT_HEADER_PROBE = b"\0" * 64       # a slot's header is zeroed before its data changes, rewritten after
_ACCEPTED, _REFUSED = b"\1", b"\0"
MARGIN = 4                            # a copy may be up to this many times this rank's own snapshot
RESERVE = 64 << 20                    # shared memory a copy must leave free
HANDSHAKE_TIMEOUT_S = 10.0
MAX_HANDSHAKES = 4                    # connections authenticating at once; more are closed at once
_CHUNK = 1 << 22


def peer_of(rank: int, world: int, local_world: int) -> Optional[int]:
    """The rank on the next node that keeps copies of `rank`'s slots; None on a single node."""
    if world <= local_world:
        return None
    return (rank + local_world) % world


def source_of(rank: int, world: int, local_world: int) -> Optional[int]:
    """The one rank whose copies `rank` keeps (peer_of's inverse); None on a single node."""
    if world <= local_world:
        return None
    return (rank - local_world) % world


def _context(run_id: str, receiver: int) -> bytes:
    return f"peer-copy/{run_id}/{receiver}".encode()


class PeerCopies:
    """Receiver of other ranks' slot copies and sender of this rank's, for the life of the process.

    Without the workers' key (not started by hyperpodrun's agent) it neither listens nor sends."""

    def __init__(self, base_dir: str, rank: int, world: Optional[int] = None, local_world: Optional[int] = None,
                 key: Optional[bytes] = None, run_id: Optional[str] = None) -> None:
        self.base_dir, self.rank = base_dir, rank
        self.own_dir = os.path.join(base_dir, f"local{real_local_rank()}")   # CheckpointManager's
        world = world if world is not None else int(os.environ.get("WORLD_SIZE", 1))
        local_world = local_world if local_world is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.source = source_of(rank, world, local_world)
        worker_key = key if key is not None else auth.worker_key()
        self._key = auth.derive(worker_key, "peer-copy") if worker_key else None
        self._run = run_id if run_id is not None else shm_runs.run_id()
        if self._key is None:
            log.warning("no HYPERPODRUN_JOB_KEY in the environment (not started by hyperpodrun?): slot copies to "
                        "another node are off")
        self._server: Optional[socket.socket] = None
        self._published = ""
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._recv_lock = threading.Lock()          # one copy written at a time
        self._active: Optional[socket.socket] = None
        self._refusals = 0
        self._pending: Optional[tuple[int, str]] = None
        self._cv = threading.Condition()
        self._target: Optional[tuple[str, int]] = None
        self._peer: Optional[int] = None
        self._conn: Optional[socket.socket] = None
        self._session = b""
        self._seq = 0
        self._sender: Optional[threading.Thread] = None
        self._failing = False

    @property
    def enabled(self) -> bool:
        return self._key is not None

    # ---------------------------------------------------------------- receiving
    def _peer_dir(self) -> str:
        return os.path.join(self.base_dir, f"peer-of-rank{self.source}")

    def held(self) -> dict[int, dict[int, str]]:
        """source rank -> {step: path} of the complete copies held here."""
        from hyperpodrun.state.slots import snapshot_io as io
        out: dict[int, dict[int, str]] = {}
        d = self._peer_dir()
        if self.source is None or not (safe_fs.is_private_dir(self.base_dir) and safe_fs.is_private_dir(d)):
            return out
        for name in ("slot0", "slot1"):
            path = os.path.join(d, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.error("ignoring peer copy %s: %s", path, exc)
                continue
            try:
                with os.fdopen(fd, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                        raise io.SnapshotCorrupt(f"{path}: not a private file of this user")
                    step = io.verify(fh.read(), path)
            except (io.SnapshotCorrupt, OSError) as exc:
                log.error("ignoring peer copy %s", exc)
                continue
            out.setdefault(self.source, {})[step] = path
        return out

    def serve(self, store: Any, store_host: str) -> None:
        """Start the receiver (once per process) and publish its address in this generation's store."""
        if self._key is None or self.source is None:
            return
        if self._server is None:
            bind = netaddr.multi_node_bind(store_host)
            self._server = netaddr.listen_socket(bind, 0, backlog=16)
            host = bind
            if bind in ("0.0.0.0", "::"):
                host = netaddr.route_source(store_host) or socket.gethostbyname(socket.gethostname())
            self._published = f"{host}:{self._server.getsockname()[1]}"
            threading.Thread(target=self._accept, name="hyperpodrun-peer-recv", daemon=True).start()
        store.set(f"hyperpodrun/peer-copy/{self.rank}", self._published)

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, addr = self._server.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()                    # a flood of connections: only a few may authenticate at once
                continue
            threading.Thread(target=self._connection, args=(conn, addr), name="hyperpodrun-peer-recv",
                             daemon=True).start()

    def _refused(self, what: str) -> None:
        self._refusals += 1
        if self._refusals == 1 or self._refusals % 100 == 0:
            log.warning("peer-copy receiver of rank %d refused %s (%d refused so far)", self.rank, what,
                        self._refusals)

    def _connection(self, conn: socket.socket, addr: Any) -> None:
        assert self._key is not None
        with conn:
            try:
                try:
                    conn.settimeout(HANDSHAKE_TIMEOUT_S)
                    session = auth.server_handshake(conn, self._key, _context(self._run, self.rank))
                    conn.settimeout(None)
                finally:
                    self._handshakes.release()
            except (auth.AuthError, OSError) as exc:
                self._refused(f"a connection from {addr[0] if addr else '?'}: {exc}")
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            old, self._active = self._active, conn      # the sender reconnected: its old connection is done
            if old is not None:
                try:
                    old.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._receive(conn, session)

    def limit(self) -> int:
        """The largest copy this rank accepts now (see the module docstring)."""
        own = 0
        for name in ("slot0", "slot1"):
            try:
                own = max(own, os.lstat(os.path.join(self.own_dir, name)).st_size)
            except OSError:
                pass
        free = _free_bytes(self.base_dir)
        bound = MARGIN * own if own else free // 2
        return max(0, min(bound, free - RESERVE))

    def _receive(self, conn: socket.socket, session: bytes) -> None:
        from hyperpodrun.state.slots import snapshot_io as io
        seq = 0
        while True:
            hdr = _recv_exact(conn, _HDR.size)
            if hdr is None:
                return
            src, step, length = _HDR.unpack(hdr)
            limit = self.limit()
            why = ""
            if src != self.source:
                why = f"a copy of rank {src}'s state (only rank {self.source}'s is kept here)"
            elif step < 0 or length < io.HEADER_LEN:
                why = f"a malformed copy header (step {step}, {length} bytes)"
            elif length > limit:
                why = f"a copy of {length} bytes from rank {src} (at most {limit} bytes now: {MARGIN}x this rank's " \
                      "own snapshot, within the free shared memory)"
            if why:
                self._refused(why)
                _send_quietly(conn, _REFUSED)
                return
            mac = auth.message_mac(session, seq)
            mac.update(hdr)
            with self._recv_lock:
                try:
                    kept = self._write_copy(conn, src, step, length, mac)
                except (OSError, safe_fs.UnsafePathError) as exc:
                    self._refused(f"a copy of step {step} from rank {src}: cannot keep it here ({exc})")
                    return
                if not kept:
                    return
            seq += 1
            _send_quietly(conn, _ACCEPTED)

    def _write_copy(self, conn: socket.socket, src: int, step: int, length: int, mac: Any) -> bool:
        """Receive one copy into a 0600 temporary file; keep it (rename) only once its MAC verifies."""
        root = os.path.dirname(os.path.dirname(self.base_dir))
        os.makedirs(root, exist_ok=True)         # the shared-memory dir itself (HYPERPODRUN_SHM_DIR)
        d = safe_fs.private_tree(os.path.dirname(self.base_dir), os.path.basename(self.base_dir),
                                 f"peer-of-rank{src}")
        path = os.path.join(d, f"slot{step % 2}")
        tmp = path + ".tmp"
        ok = False
        try:
            with os.fdopen(safe_fs.open_private(tmp), "wb") as fh:
                left = length
                while left:
                    try:
                        chunk = conn.recv(min(left, _CHUNK))
                    except OSError:
                        chunk = b""
                    if not chunk:
                        return False                # sender gone mid-copy: the copy never counts
                    mac.update(chunk)
                    fh.write(chunk)
                    left -= len(chunk)
            tag = _recv_exact(conn, auth.MAC_BYTES)
            if tag is None or not hmac.compare_digest(tag, mac.digest()):
                self._refused(f"a copy of step {step} from rank {src} whose MAC does not verify")
                return False
            os.replace(tmp, path)
            ok = True
            return True
        finally:
            if not ok:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    # ---------------------------------------------------------------- sending
    def connect(self, store: Any, peer: int, timeout: float = 30.0) -> None:
        """Look up the peer's receiver in this generation's store (it may have moved after a restart)."""
        if self._key is None:
            return
        from datetime import timedelta
        store.wait([f"hyperpodrun/peer-copy/{peer}"], timedelta(seconds=timeout))
        host, port = store.get(f"hyperpodrun/peer-copy/{peer}").decode().rsplit(":", 1)
        with self._cv:
            self._target = (host, int(port))
            self._peer = peer
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

    def _open(self, target: tuple[str, int], peer: int) -> None:
        assert self._key is not None
        conn = socket.create_connection(target, timeout=60)
        try:
            self._session = auth.client_handshake(conn, self._key, _context(self._run, peer))
        except BaseException:
            conn.close()
            raise
        self._conn, self._seq = conn, 0

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                (step, path), self._pending = self._pending, None
                target, peer = self._target, self._peer
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                    fh.seek(0)
                    if fh.read(len(_SLOT_HEADER_PROBE)) != data[:len(_SLOT_HEADER_PROBE)]:
                        continue           # the slot was rewritten while being read: a newer one is queued
                if self._conn is None and target is not None and peer is not None:
                    self._open(target, peer)
                if self._conn is not None:
                    hdr = _HDR.pack(self.rank, step, len(data))
                    mac = auth.message_mac(self._session, self._seq)
                    mac.update(hdr)
                    mac.update(data)
                    self._conn.sendall(hdr)
                    self._conn.sendall(data)
                    self._conn.sendall(mac.digest())
                    self._seq += 1
                    answer = _recv_exact(self._conn, 1)
                    if answer != _ACCEPTED:
                        raise OSError("the peer refused the copy (see its log)" if answer == _REFUSED
                                      else "peer closed the connection")
                    self._failing = False
            except (OSError, auth.AuthError) as exc:
                (log.debug if self._failing else log.warning)(
                    "copy of step %d to the peer on another node failed: %s", step, exc)
                self._failing = True
                if self._conn is not None:
                    self._conn.close()
                self._conn = None


def _free_bytes(path: str) -> int:
    """Free bytes of the filesystem that holds `path` (or its nearest existing parent)."""
    while True:
        try:
            st = os.statvfs(path)
            return st.f_bavail * st.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return 0
            path = parent
        except OSError:
            return 0


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


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
