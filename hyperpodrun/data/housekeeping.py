"""Where a run's cache files live, who owns them, and when they are removed.

    <cache_dir>/<run id>.<owner pid>/            one per job and node ("run directory", mode 0700)
        owner.json                               the owner process (pid, start time, host), run id
        alive.lock                               every process using the run holds a shared POSIX lock
        <loader name>.rank<r>/ or <name>.share-<key>/   one group per producer (see group.py)

The owner is the process whose life bounds the run on this node: the hyperpodrun agent
(HYPERPODRUN_AGENT_PID), torchrun's agent (the worker's parent) or, in a plain `python train.py`, the
process itself. Workers come and go (respawned ranks, process-level restarts) under the same owner and
find their files again; a new job (a new agent) gets a new directory.

A run directory is stale when its owner is gone (no such process, or a process with another start time:
a reused pid) *and* no process holds its alive.lock. Stale directories are removed when a run first
opens the cache. Only directories that carry our owner.json are ever touched. In another pid namespace
(a container sharing /dev/shm) the owner is not visible; the lock alone then protects a run, which is
enough except in the moment of a process-level restart when no worker is alive.

At interpreter exit a process removes the groups whose consumers all finished their stream, and the
run directory when it is the last process using it and no group is left (see loader.py for when a
stream counts as finished). A job that fails keeps its files for its own restart; the next job removes
them as stale.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("hyperpodrun.data")

OWNER_FILE = "owner.json"
ALIVE_LOCK = "alive.lock"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80] or "_"


def run_id() -> str:
    """The job's id as the worker sees it (torchrun's TORCHELASTIC_RUN_ID; 'local' outside a launcher)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or "local"


def owner_pid() -> int:
    """The process whose life bounds this run's cache on this node (see the module doc)."""
    agent = os.environ.get("HYPERPODRUN_AGENT_PID")
    if agent and agent.isdigit():
        return int(agent)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.getppid()
    return os.getpid()


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


def run_dir_name() -> str:
    return f"{_safe(run_id())}.{owner_pid()}"


def _owner_alive(info: dict) -> bool:
    pid, started = info.get("pid"), info.get("start_time")
    if not isinstance(pid, int):
        return False
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def _held_by_someone(lock_path: str) -> bool:
    """True when some process holds a lock on `lock_path` (we take none: the probe is released)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)   # closing releases our probe lock
    return False


def remove_stale(cache_dir: str, keep: str) -> list[str]:
    """Remove run directories under `cache_dir` whose owner is gone and that no process uses; returns them."""
    removed = []
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(cache_dir, name)
        if name == keep or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            continue   # not ours, or being created right now
        if _owner_alive(info) or _held_by_someone(os.path.join(path, ALIVE_LOCK)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log.info("removed stale MMAP cache %s (run %s, owner pid %s gone)", path, info.get("run_id"), info.get("pid"))
    return removed


@dataclass
class RunDir:
    """This process's use of one run directory (opened once per process, see open_run)."""

    path: str
    lock_fd: int

    def release(self) -> bool:
        """At exit: drop our claim; remove the directory when nobody else uses it and no group is left."""
        removed = False
        try:
            fcntl.lockf(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # upgrade: fails while others hold it
        except OSError:
            pass
        else:
            groups = [n for n in os.listdir(self.path) if os.path.isdir(os.path.join(self.path, n))]
            if not groups:
                shutil.rmtree(self.path, ignore_errors=True)
                removed = True
                try:
                    os.rmdir(os.path.dirname(self.path))   # the cache dir itself, when nothing else is in it
                except OSError:
                    pass
        os.close(self.lock_fd)
        return removed


_RUNS: dict[str, RunDir] = {}


def open_run(cache_dir: str, cleanup_stale: bool = True) -> RunDir:
    """Create (or join) this run's directory and hold its alive lock; removes stale runs the first time.

    Raises OSError when cache_dir cannot be used (missing parent, read-only, full)."""
    path = os.path.join(cache_dir, run_dir_name())
    run = _RUNS.get(path)
    if run is not None and os.path.isdir(path):
        return run
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    if cleanup_stale:
        remove_stale(cache_dir, keep=os.path.basename(path))
    os.makedirs(path, mode=0o700, exist_ok=True)
    lock_fd = os.open(os.path.join(path, ALIVE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.lockf(lock_fd, fcntl.LOCK_SH)
    owner = os.path.join(path, OWNER_FILE)
    if not os.path.exists(owner):
        pid = owner_pid()
        tmp = f"{owner}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"pid": pid, "start_time": start_time(pid), "host": socket.gethostname(),
                       "run_id": run_id()}, fh)
        os.replace(tmp, owner)
    run = RunDir(path, lock_fd)
    _RUNS[path] = run
    return run


def release_runs() -> None:
    """At exit (after the groups were closed): release every run directory this process opened."""
    for path, run in list(_RUNS.items()):
        try:
            run.release()
        except OSError as exc:
            log.debug("releasing %s: %s", path, exc)
        _RUNS.pop(path, None)


__all__ = ["open_run", "remove_stale", "release_runs", "run_id", "owner_pid", "start_time", "RunDir"]
