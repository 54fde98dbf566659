"""Run directories in shared memory: who owns them, who uses them, when they are stale, how they go.

    <base>/<run id>.<owner pid>/      one per job and node (mode 0700)
        owner.json                    the owner process (pid, start time, host) and the run id
        alive.lock                    every process using the run holds a shared POSIX lock on it

Used by CheckpointManager (base `<shm>/hyperpodrun-<uid>`, slots under `rank<r>/`) and by the MMAP data
cache (base `cache_dir`). Torch-free: the agent imports it to remove a finished job's snapshots.

The owner is the process whose life bounds the run on this node: the hyperpodrun agent
(HYPERPODRUN_AGENT_PID), torchrun's agent (the worker's parent) or, in a plain `python train.py`, the
process itself. Workers come and go (respawned ranks, process-level restarts) under the same owner and
find their files again; a new job (a new owner) gets a new directory and never reads an older job's files.

A run directory is stale when its owner is gone (no such process, or a process with another start time:
a reused pid) *and* no process holds its alive.lock; stale runs are removed when a run is first opened.
Only directories of this user that carry an owner.json are ever touched. In another pid namespace (a
container sharing the tmpfs) the owner is not visible; the lock alone then protects a run.

Every directory is created with safe_fs (0700, our own, never through a symlink): a directory that another
user created first makes the job fail with UnsafePathError instead of reading what they planted.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from hyperpodrun import env as E
from hyperpodrun.launch import settings
from hyperpodrun.safe_fs import UnsafePathError, open_private, private_dir

log = logging.getLogger("hyperpodrun.runtime")

OWNER_FILE = "owner.json"
ALIVE_LOCK = "alive.lock"
_OWNER_MAX = 4096


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80].lstrip(".") or "_"


def run_id() -> str:
    """The job's id as the worker sees it (torchrun's TORCHELASTIC_RUN_ID; 'local' outside a launcher)."""
    return E.worker_context().run_id or "local"


def owner_pid() -> int:
    """The process whose life bounds this run on this node (see the module doc)."""
    ctx = E.worker_context()
    if ctx.agent_pid is not None:
        return ctx.agent_pid
    if ctx.run_id:
        return os.getppid()
    return os.getpid()


def run_dir_name(run: Optional[str] = None, owner: Optional[int] = None) -> str:
    return f"{safe_name(run_id() if run is None else run)}.{owner_pid() if owner is None else owner}"


def start_time(pid: int) -> Optional[int]:
    """The start time of `pid` in clock ticks since boot (None when there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    try:
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def check_base(path: str) -> None:
    """Refuse a base directory whose entries another user could rename or replace (owned by someone else,
    or writable by others without the sticky bit, as /dev/shm and /tmp have)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}: another user could replace what hyperpodrun keeps "
                              "there. Use a directory of your own (or a sticky one such as /dev/shm)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(f"{path} is writable by other users and not sticky (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}): they could replace what hyperpodrun keeps there. "
                              f"Fix: chmod o-w,g-w {path} (or chmod +t), or use another directory")


def _read_owner(path: str) -> Optional[dict]:
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = json.loads(os.read(fd, _OWNER_MAX))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return info if isinstance(info, dict) else None


def _owner_alive(info: dict) -> bool:
    pid, started = info.get("pid"), info.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def _held_by_someone(lock_path: str) -> bool:
    """True when some process holds a lock on `lock_path` (we take none: the probe is released)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)   # closing releases our probe lock
    return False


def remove_stale(base: str, keep: str, what: str = "run") -> list[str]:
    """Remove run directories under `base` whose owner is gone and that no process uses; returns them."""
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        if name == keep:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        info = _read_owner(path)
        if info is None:
            continue   # not ours, or being created right now
        if _owner_alive(info) or _held_by_someone(os.path.join(path, ALIVE_LOCK)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log.info("removed stale %s %s (run %s, owner pid %s gone)", what, path, info.get("run_id"), info.get("pid"))
    return removed


@dataclass
class RunDir:
    """This process's use of one run directory (one per directory per process: see open_run)."""

    path: str
    lock_fd: int

    def release(self, remove: Callable[[str], bool] = lambda _path: True) -> bool:
        """Drop our claim; when no other process uses the directory and `remove(path)` says so, remove it
        (and its base when that is then empty). Returns whether it was removed."""
        removed = False
        try:
            # drop our shared lock first, then try for the exclusive one: of several processes releasing at
            # once, the last to try always gets it (an upgrade in place could fail for all of them)
            fcntl.lockf(self.lock_fd, fcntl.LOCK_UN)
            fcntl.lockf(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # fails while another process uses it
        except OSError:
            pass
        else:
            if remove(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
                removed = True
                try:
                    os.rmdir(os.path.dirname(self.path))
                except OSError:
                    pass
        os.close(self.lock_fd)
        _forget(self.path)
        return removed


_RUNS: dict[str, RunDir] = {}
_LOCK = threading.Lock()
_PID = os.getpid()


def open_runs() -> dict[str, RunDir]:
    """The run directories this process holds (path -> RunDir)."""
    with _LOCK:
        return dict(_RUNS) if _PID == os.getpid() else {}


def _forget(path: str) -> None:
    with _LOCK:
        _RUNS.pop(path, None)


def _make_base(base: str) -> None:
    parent = os.path.dirname(base.rstrip(os.sep)) or os.sep
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    check_base(parent)
    private_dir(base)


def open_run(base: str, cleanup_stale: bool = True, what: str = "run") -> RunDir:
    """Create (or join) this run's directory under `base` and hold its alive lock; removes stale runs the
    first time. Raises UnsafePathError when a directory is not ours alone, OSError when it cannot be made."""
    global _PID
    path = os.path.join(base, run_dir_name())
    with _LOCK:
        if _PID != os.getpid():    # a forked child: the parent's claims (locks) are not its own
            _RUNS.clear()
            _PID = os.getpid()
        run = _RUNS.get(path)
    if run is not None and os.path.isdir(path):
        return run
    for attempt in (1, 2):
        _make_base(base)
        if cleanup_stale and attempt == 1:
            remove_stale(base, keep=os.path.basename(path), what=what)
        try:
            private_dir(path)
            break
        except FileNotFoundError:   # the last run of another job removed the (empty) base just now
            if attempt == 2:
                raise
    lock_fd = open_private(os.path.join(path, ALIVE_LOCK), os.O_RDWR | os.O_CREAT)
    fcntl.lockf(lock_fd, fcntl.LOCK_SH)
    if _read_owner(path) is None:
        pid = owner_pid()
        tmp = os.path.join(path, f".{OWNER_FILE}.{os.getpid()}.tmp")
        fd = open_private(tmp)
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": pid, "start_time": start_time(pid), "host": socket.gethostname(), "run_id": run_id()},
                      fh)
        os.replace(tmp, os.path.join(path, OWNER_FILE))
    run = RunDir(path, lock_fd)
    with _LOCK:
        _RUNS[path] = run
    return run


def remove_finished(base: str, run: str, owner: int) -> bool:
    """Remove the run directory `<base>/<run>.<owner>` of a job that ended successfully (the agent calls
    this once every local worker has exited 0); its base too when that is then empty. Only a directory of
    ours (safe_fs rules) is touched. Returns whether something was removed."""
    path = os.path.join(base, run_dir_name(run, owner))
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(base)
    except OSError:
        pass
    return not os.path.exists(path)


def slot_dir(local_rank: int, run: Optional[str] = None, owner: Optional[int] = None,
             shm_dir: Optional[str] = None) -> str:
    """Where the process running local rank `local_rank` on this node keeps its snapshot slots: named by its
    local rank, which - unlike its global rank, which an elastic job renumbers - stays the same for every
    process that runs this rank on this node (CheckpointManager; the agent tells its standbys)."""
    return os.path.join(checkpoint_base(shm_dir), run_dir_name(run, owner), f"local{local_rank}")


def checkpoint_base(shm_dir: Optional[str] = None) -> str:
    """Where CheckpointManager keeps its run directories: `<shm>/hyperpodrun-<uid>`."""
    shm = shm_dir or settings.current().shm_dir
    return os.path.join(shm, f"hyperpodrun-{os.getuid()}")


__all__ = ["slot_dir", "open_run", "open_runs", "remove_stale", "remove_finished", "checkpoint_base", "run_id", "owner_pid", "start_time",
           "RunDir", "check_base", "run_dir_name"]
