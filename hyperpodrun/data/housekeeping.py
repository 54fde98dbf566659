"""Where a run's cache files live, who owns them, and when they are removed.

    <cache_dir>/<run id>.<owner pid>/            one per job and node ("run directory", mode 0700)
        owner.json                               the owner process (pid, start time, host), run id
        alive.lock                               every process using the run holds a shared POSIX lock
        <loader name>.rank<r>/ or <name>.share-<key>/   one group per producer (see group.py)

Ownership, staleness and the alive lock are those of every hyperpodrun run directory in shared memory
(hyperpodrun.state.slots.shm_runs): the owner is the process whose life bounds the run on this node (the
hyperpodrun agent, torchrun's agent, or the process itself); a run directory is stale when its owner is
gone and no process holds its alive.lock, and stale directories are removed when a run first opens the
cache. `cache_dir` and everything below it are created 0700 and must be this user's alone: a cache_dir
that another user created (or a symlink, or one open to others) raises UnsafePathError instead of being
read, and the loader then reads the wrapped loader directly, with one warning (loader.py).

At interpreter exit a process removes the groups whose consumers all finished their stream, and the
run directory when it is the last process using it and no group is left (see loader.py for when a
stream counts as finished). A job that fails keeps its files for its own restart; the next job removes
them as stale.
"""
from __future__ import annotations

import logging
import os

from hyperpodrun.state.slots import shm_runs
from hyperpodrun.state.slots.shm_runs import RunDir, owner_pid, run_dir_name, run_id, start_time

log = logging.getLogger("hyperpodrun.data")

OWNER_FILE = shm_runs.OWNER_FILE
ALIVE_LOCK = shm_runs.ALIVE_LOCK


def remove_stale(cache_dir: str, keep: str) -> list[str]:
    """Remove run directories under `cache_dir` whose owner is gone and that no process uses; returns them."""
    return shm_runs.remove_stale(cache_dir, keep, what="MMAP cache")


_OPENED: dict[str, RunDir] = {}


def open_run(cache_dir: str, cleanup_stale: bool = True) -> RunDir:
    """Create (or join) this run's directory and hold its alive lock; removes stale runs the first time.

    Raises UnsafePathError when a directory is not this user's alone, OSError when cache_dir cannot be
    used (missing parent, read-only, full)."""
    run = shm_runs.open_run(cache_dir, cleanup_stale, what="MMAP cache")
    _OPENED[run.path] = run
    return run


def _no_group_left(path: str) -> bool:
    return not any(os.path.isdir(os.path.join(path, n)) for n in os.listdir(path))


def release_runs() -> None:
    """At exit (after the groups were closed): release every run directory this process opened; the last
    process using one removes it when no group is left (and cache_dir when that is then empty)."""
    for path, run in list(_OPENED.items()):
        try:
            run.release(remove=_no_group_left)
        except OSError as exc:
            log.debug("releasing %s: %s", path, exc)
        _OPENED.pop(path, None)


__all__ = ["open_run", "remove_stale", "release_runs", "run_id", "owner_pid", "start_time", "RunDir",
           "run_dir_name"]
