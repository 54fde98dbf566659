"""One cache group: the batch files of one producer and the positions of the consumers reading them.

    <run dir>/<name>.rank<r>/  or  <run dir>/<name>.share-<key>/
        producer.lock           the producer holds an exclusive POSIX lock (released by the kernel when
                                its process dies: a surviving consumer, or the respawned rank, takes over)
        pos.<rank>              8 bytes per consumer: the step it reads or waits for (x2, +1 when finished)
        b<step>.batch           batch files (storage.py); .tmp while being written
        END                     the step at which the wrapped loader ran out (no batch there)
        DEGRADED                the cache could not take a batch (full, unwritable): read directly

POSIX (fcntl) locks, not flock: they belong to the process, so forked DataLoader workers never inherit
the producer role. A process opens each group once (the registry below), so closing a descriptor never
drops a lock by accident.
"""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import struct
import threading
import time
from typing import Any, Optional

from hyperpodrun.data import storage
from hyperpodrun.safe_fs import open_private, private_dir

log = logging.getLogger("hyperpodrun.data")

_POS = struct.Struct("<q")
END_MARKER = "END"
#: how often a group re-lists its consumers' position files
POSITIONS_RESCAN_S = 0.1
DEGRADED_MARKER = "DEGRADED"


def _read_small(path: str) -> str:
    """A marker file's text (never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def batch_name(step: int) -> str:
    return f"b{step:012d}.batch"


def step_of(name: str) -> Optional[int]:
    if name.startswith("b") and name.endswith(".batch"):
        try:
            return int(name[1:-6])
        except ValueError:
            return None
    return None


class Group:
    """This process's handle on one group directory (one per directory per process: use `get`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        private_dir(path)
        self.cond = threading.Condition()          # producer <-> consumers of this process
        self.commit_lock = threading.Lock()        # fences a replaced producer's last commit
        self.producer: Any = None                  # the Producer thread of this process, if it owns the group
        self.error: Optional[BaseException] = None  # what ended this process's producer
        self.degraded_reason: Optional[str] = None
        self._lock_fd: Optional[int] = None
        self._pos_fds: dict[int, int] = {}
        self._pos_values: dict[int, int] = {}
        self._read_fds: dict[int, int] = {}
        self._scan_due = 0.0
        self._pos_lock = threading.Lock()
        self.finished_here: dict[int, bool] = {}   # rank -> this process's consumer finished its stream

    # ------------------------------------------------------------------ producer role
    @property
    def owned(self) -> bool:
        return self._lock_fd is not None

    def try_own(self) -> bool:
        """Take the producer role if no live process has it (non-blocking)."""
        if self._lock_fd is not None:
            return True
        fd = open_private(os.path.join(self.path, "producer.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def disown(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ consumer positions
    def set_position(self, rank: int, step: int, finished: bool = False) -> None:
        value = step * 2 + (1 if finished else 0)
        if self._pos_values.get(rank) == value:
            return
        fd = self._pos_fds.get(rank)
        if fd is None:
            fd = open_private(os.path.join(self.path, f"pos.{rank}"), os.O_RDWR | os.O_CREAT)
            self._pos_fds[rank] = fd
        os.pwrite(fd, _POS.pack(value), 0)
        self._pos_values[rank] = value
        self.finished_here[rank] = finished
        with self.cond:
            self.cond.notify_all()

    def positions(self) -> dict[int, tuple[int, bool]]:
        """rank -> (step, finished) of every consumer that ever registered in this group.

        The position files are listed at most every POSITIONS_RESCAN_S (consumers of other processes
        register rarely) and read through descriptors kept open (one pread each)."""
        with self._pos_lock:
            return self._positions()

    def _positions(self) -> dict[int, tuple[int, bool]]:
        now = time.monotonic()
        if now >= self._scan_due:
            self._scan_due = now + POSITIONS_RESCAN_S
            for path in glob.glob(os.path.join(self.path, "pos.*")):
                try:
                    rank = int(path.rsplit(".", 1)[1])
                except ValueError:
                    continue
                if rank not in self._read_fds:
                    try:
                        self._read_fds[rank] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    except OSError:
                        continue
        out = {}
        for rank, fd in list(self._read_fds.items()):
            try:
                data = os.pread(fd, _POS.size, 0)
            except OSError:
                continue
            if len(data) == _POS.size:
                value = _POS.unpack(data)[0]
                out[rank] = (value >> 1, bool(value & 1))
        return out

    def min_position(self) -> Optional[int]:
        """The lowest step an unfinished consumer reads or waits for (None: nobody needs a batch)."""
        active = [step for step, finished in self.positions().values() if not finished]
        return min(active) if active else None

    # ------------------------------------------------------------------ files and markers
    def batch_path(self, step: int) -> str:
        return os.path.join(self.path, batch_name(step))

    def steps(self) -> dict[int, int]:
        """step -> size of every complete batch file."""
        out = {}
        for entry in os.scandir(self.path):
            step = step_of(entry.name)
            if step is not None:
                try:
                    out[step] = entry.stat().st_size
                except OSError:
                    pass
        return out

    def meta(self, step: int) -> Optional[dict]:
        """The meta (loader state, epoch, ...) of the cached batch `step`, or None."""
        try:
            return storage.read_meta(self.batch_path(step))
        except (OSError, storage.CacheCorruptError):
            return None

    def _write_marker(self, name: str, text: str) -> None:
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as fh:
            fh.write(text)
        os.replace(tmp, os.path.join(self.path, name))

    def mark_end(self, step: int) -> None:
        self._write_marker(END_MARKER, str(step))

    def end_step(self) -> Optional[int]:
        try:
            return int(_read_small(os.path.join(self.path, END_MARKER)).strip())
        except (OSError, ValueError):
            return None

    def mark_degraded(self, reason: str) -> None:
        """Every consumer of the group reads the wrapped loader directly from now on."""
        self.degraded_reason = reason
        try:
            self._write_marker(DEGRADED_MARKER, reason)
        except OSError as exc:   # consumers of other processes then wait for a new producer (wait_timeout)
            log.error("could not mark the MMAP cache group %s as degraded: %s", self.path, exc)
        with self.cond:
            self.cond.notify_all()

    def degraded(self) -> Optional[str]:
        if self.degraded_reason is not None:
            return self.degraded_reason
        try:
            self.degraded_reason = _read_small(os.path.join(self.path, DEGRADED_MARKER)) or "degraded"
        except OSError:
            return None
        return self.degraded_reason

    def clean_tmp(self) -> None:
        """Remove half-written files of producers that died (only the producer calls this)."""
        for path in glob.glob(os.path.join(self.path, ".*.tmp")):
            try:
                os.unlink(path)
            except OSError:
                pass

    # ------------------------------------------------------------------ end of use
    def close(self) -> bool:
        """At exit: stop our producer, leave the group; remove it when every consumer finished."""
        producer = self.producer
        if producer is not None:
            producer.fence()
            producer.retired.set()
            producer.join(2.0)
        self.disown()
        for fd in self._pos_fds.values():
            os.close(fd)
        self._pos_fds.clear()
        self._pos_values.clear()
        self._scan_due = 0.0
        positions = self.positions()
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()
        if positions and all(finished for _, finished in positions.values()) and \
                all(self.finished_here.values()):
            shutil.rmtree(self.path, ignore_errors=True)
            return True
        return False


_GROUPS: dict[str, Group] = {}
_REGISTRY_LOCK = threading.Lock()
_PID = os.getpid()


def get(path: str) -> Group:
    """This process's Group for `path` (one per process: it survives in-process restarts)."""
    global _PID
    with _REGISTRY_LOCK:
        if _PID != os.getpid():   # a forked child inherited the parent's handles: not its own
            _GROUPS.clear()
            _PID = os.getpid()
        group = _GROUPS.get(path)
        if group is None:
            group = Group(path)
            _GROUPS[path] = group
        return group


def release(path: str) -> bool:
    """Close this process's Group for `path` now rather than at exit (removed when every consumer finished);
    True when its files were removed."""
    with _REGISTRY_LOCK:
        group = _GROUPS.pop(path, None)
    return group.close() if group is not None else False


def close_all() -> None:
    with _REGISTRY_LOCK:
        groups = list(_GROUPS.values())
        _GROUPS.clear()
    for group in groups:
        try:
            group.close()
        except Exception as exc:  # exit path: never raise
            log.debug("closing %s: %s", group.path, exc)


__all__ = ["Group", "get", "release", "close_all", "batch_name", "step_of"]
