"""Abort and finalize: what a live rank does between a fault and READY (docs/ARCHITECTURE.md, "Restart protocol", step 3).

Each is a callable object users can replace or compose: `abort()` tears down the process groups so
nothing stays blocked on the failed generation; `finalize()` ends the worker's own child processes and
drops references to the failed frames.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional

from hyperpodrun.launch import settings
from hyperpodrun.runtime import pg_kind

log = logging.getLogger("hyperpodrun.runtime")


class Abort:
    """Base class: called once per restart, in the worker's main thread."""

    def __call__(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


_PARKED: list = []            # process groups of ended generations (see park_process_groups)
_ENTRY_SOCKETS: set[str] = set()
_RELEASER: Optional[threading.Thread] = None
_RELEASE_JOIN_S = 10.0        # how long the end of the job waits for groups still being destructed
_EXIT_JOIN_S = 5.0            # the same at interpreter exit on any other path


def park_process_groups() -> None:
    """Keep a reference to every current process group so none is destructed in the main thread.

    ~ProcessGroupGloo waits for its worker threads; a thread still inside a collective of a failed generation
    keeps it waiting (up to the collective's timeout), and a destructor run by the main thread while a gloo
    thread finishes a work that holds a Python object can deadlock on the GIL (seen with DDP). Parked groups
    are released by `release_parked()`, off the main thread.
    """
    try:
        import torch.distributed as dist
        world = getattr(dist.distributed_c10d, "_world", None)
        if world is not None:
            for pg in list(getattr(world, "pg_map", {}).keys()):
                if not any(pg is p for p in _PARKED):
                    _PARKED.append(pg)
    except Exception:
        pass


def parked_count() -> int:
    """Process groups parked and not yet handed to the releaser (for tests and diagnostics)."""
    return len(_PARKED)


def release_parked(wait: bool = False, timeout: float = _RELEASE_JOIN_S) -> None:
    """Destruct the parked process groups (their threads, sockets, pipes and epoll descriptors) in a
    background thread; with `wait`, also wait (up to `timeout` s) until every group handed over so far is gone.

    HPWrapper calls it at the start of each generation after the first: by then every rank of the job has
    aborted the failed generation (GO waits for every READY), so each connection of the parked groups has
    been shut down at both ends and no collective of theirs can still wait for a peer; their worker threads
    are idle and the destructors return at once. The thread is there for the exception - a group whose
    sockets were not shut down (one created before the wrapped function) with a collective still pending:
    its destructor then waits for that collective's timeout, and nobody waits for it but the releaser. The
    destructors run without the GIL (torch releases it), so the main thread is never held up. Destruction is
    the only release: torch 2.13's ProcessGroup.abort() and shutdown() do nothing for gloo (the group keeps
    its threads and still runs collectives after them).

    At the end of the job (`wait=True`, before the wrapped function's result is returned) no gloo thread
    may outlive the interpreter: one that drops its last reference to a tensor while Python finalizes
    aborts the process ("terminate called without an active exception").
    """
    global _RELEASER
    groups = list(_PARKED)
    _PARKED.clear()
    previous = _RELEASER
    if groups:
        def run() -> None:
            if previous is not None:
                previous.join()        # one group at a time, in the order they were parked
            nonlocal groups
            shared = False
            while groups:
                shared |= sys.getrefcount(groups[0]) > 2   # also held elsewhere (a cycle): collect below
                groups.pop(0)          # the last reference: ~ProcessGroup runs here, without the GIL
            if shared:
                gc.collect()
        _RELEASER = threading.Thread(target=run, name="hyperpodrun-pg-release", daemon=True)
        _RELEASER.start()
    if wait:
        join_releaser(timeout)


def join_releaser(timeout: float) -> bool:
    """Wait until every parked group handed to the releaser is destructed; False when still busy."""
    t = _RELEASER
    if t is None:
        return True
    t.join(timeout)
    if t.is_alive():
        log.warning("process groups of earlier generations still being destructed after %gs (a collective "
                    "pending in a group created before the wrapped function?)", timeout)
        return False
    return True


def _release_at_exit() -> None:
    """Any exit (a stopped job too): the parked groups go while the interpreter can still run their threads'
    last release of a tensor (after this, such a release aborts the process)."""
    release_parked(wait=True, timeout=_EXIT_JOIN_S)


atexit.register(_release_at_exit)


def _inet_sockets() -> dict[int, str]:
    """fd -> inode of this process's open sockets."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def mark_generation_start() -> None:
    """Remember the sockets that exist before the wrapped function runs (HPWrapper calls this)."""
    _ENTRY_SOCKETS.clear()
    _ENTRY_SOCKETS.update(_inet_sockets().values())


def shutdown_generation_sockets() -> int:
    """Half-close (shutdown(SHUT_WR)) the connected TCP sockets opened during the failed generation's call
    (gloo's pairs, the generation's store client): every peer still inside a collective with us reads
    end-of-stream and fails at once. Listening sockets are left alone (gloo aborts the process when its
    accept() fails), and so is every socket that existed before the wrapped function started, and every
    non-TCP socket (the control plane's).

    Only the write side: after SHUT_RDWR the kernel answers a peer's next write with a reset, and a gloo
    peer whose device thread is just then sending a payload for a receive we had posted gets EPIPE in a
    path that never fails the waiting send - its collective then hangs until the group's timeout instead of
    failing (seen with 4 ranks in a ring all-reduce). With SHUT_WR the peer's writes still succeed and its
    read of end-of-stream fails every operation pending on the pair. The sockets close for good when the
    parked group is destructed."""
    import socket
    n = 0
    for fd, inode in _inet_sockets().items():
        if inode in _ENTRY_SOCKETS:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                try:
                    sock.getpeername()
                except OSError:
                    continue   # listening or unconnected
                sock.shutdown(socket.SHUT_WR)
                n += 1
        except OSError:
            pass
        finally:
            sock.close()   # our dup only
    return n


class AbortProcessGroups(Abort):
    """Tear down the failed generation's process groups without blocking and without destructing them.

    NCCL (nccl-legacy or nccl2, told apart by pg_kind from the groups' backends): abort the communicators
    (unblocks kernels and collectives in flight). gloo: an abort does not
    unblock a collective in flight (verified); what does is the peer's connections going down - so the
    connected TCP sockets the generation opened are shut down (peers blocked in a collective with us fail
    within milliseconds). The groups are removed from torch's registry, so `init_process_group()` works
    again, but parked rather than destructed here (see park_process_groups, release_parked).
    """

    def __call__(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if not dist.is_available() or not dist.is_initialized():
            return
        nccl = pg_kind.uses_nccl(pg_kind.current_kinds())   # what the groups are, not the name typed
        park_process_groups()
        if nccl and abort_nccl_in_background():
            shutdown_generation_sockets()
            return
        if nccl:
            abort_pg = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort_pg is not None:
                try:
                    abort_pg()
                except Exception as exc:
                    log.warning("NCCL abort failed (%s); destroying the process group instead", exc)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            log.warning("destroy_process_group failed (%s); dropping the group", exc)
            try:
                dist.distributed_c10d._world.pg_map.clear()
                dist.distributed_c10d.GroupMember.WORLD = None
            except Exception:
                pass
        shutdown_generation_sockets()


_REGISTRY = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
             "pg_coalesce_state")
#: registry parts that only some torch versions have: torch 2.15 keeps each nccl2 group's FlightRecorder hook
#: in a dict keyed by the group (left there, it would hold every ended group alive)
_REGISTRY_SINCE = ("pg_flight_recorder_hooks",)


def _detach_registry(c10d: Any) -> bool:
    """Empty torch's registry of process groups, aborting and destructing none of them (what
    _abort_process_group does after its aborts), so that init_process_group works again at once; False
    where this torch lacks one of the pieces, or holds torchcomms communicators (`_world.comms`, which only
    torch's destroy_process_group finalizes) - then nothing was changed."""
    world = getattr(c10d, "_world", None)
    update = getattr(c10d, "_update_default_pg", None)
    if world is None or update is None or not all(isinstance(getattr(world, n, None), dict) for n in _REGISTRY):
        return False
    if getattr(world, "comms", None):
        return False
    update(None)
    for name in _REGISTRY + tuple(n for n in _REGISTRY_SINCE if isinstance(getattr(world, n, None), dict)):
        getattr(world, name).clear()
    getattr(c10d, "_unregister_all_process_groups", lambda: None)()
    world.group_count = 0
    return True


def abort_nccl_in_background() -> bool:
    """Abort every NCCL communicator of the current groups in a thread of its own; the caller goes on at once.

    Why: ProcessGroupNCCL's abort takes 0.5-1.0 s per restart on an H200 with NCCL 2.28 (mostly waiting for
    its own threads), while the next generation's group is ready 0.02 s after init begins, and the abort's
    effect that matters - kernels and collectives in flight on the failed generation return - comes at its
    start. So the groups are parked (park_process_groups), torch's registry is emptied so init_process_group
    works again, and a thread runs their aborts - nccl-legacy's inside one NCCL group (as _abort_process_group
    does, so the communicators' aborts cannot deadlock each other), nccl2's each on its own (pg_kind). The
    releaser of parked groups waits for that thread before it destructs any (release_parked), and so does the
    end of the job. Returns False (nothing done)
    with HYPERPODRUN_NCCL_ABORT_BACKGROUND=0 or where this torch lacks what it needs; the caller then aborts
    in its own thread."""
    global _RELEASER
    if not settings.current().nccl_abort_background:
        return False
    try:
        import torch.distributed as dist
        c10d = dist.distributed_c10d
        groups = pg_kind.registered_groups()
        if not groups or not all(hasattr(pg, "abort") for pg in groups):
            return False
    except (ImportError, AttributeError):
        return False
    start, end = pg_kind.group_bracket(groups)   # nccl-legacy: one NCCL group; nccl2: none (see pg_kind)
    park_process_groups()
    if not _detach_registry(c10d):
        return False
    previous = _RELEASER
    started = time.monotonic()

    def run() -> None:
        if previous is not None:
            previous.join()
        try:
            if start is not None and end is not None:
                start()
            for pg in groups:
                pg.abort()
            if start is not None and end is not None:
                end()
        except Exception as exc:   # the groups are parked: their destructors still end them
            log.warning("NCCL abort in the background failed: %s", exc)
        log.debug("NCCL communicators of the failed generation aborted in %.3fs", time.monotonic() - started)
    _RELEASER = threading.Thread(target=run, name="hyperpodrun-nccl-abort", daemon=True)
    _RELEASER.start()
    return True


class ComposeAbort(Abort):
    """Run several aborts in order; one failing does not skip the others."""

    def __init__(self, *aborts: Callable[[], None]) -> None:
        self.aborts = list(aborts)

    def __call__(self) -> None:
        for abort in self.aborts:
            try:
                abort()
            except Exception:
                log.exception("abort step %r failed", abort)


class CheckpointlessAbortManager:
    """Factory of the default abort (name from the product note)."""

    @staticmethod
    def get_default_checkpointless_abort() -> Abort:
        return ComposeAbort(AbortProcessGroups())


def _children() -> list[int]:
    pids = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as fh:
                pids += [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        pass
    return pids


class CheckpointlessFinalizeCleanup:
    """End this worker's child processes (DataLoader workers, ...), drop failed frames, collect garbage,
    empty the CUDA cache. `timeout`: seconds between SIGTERM and SIGKILL for the children."""

    def __init__(self, timeout: float = 5.0, extra: Optional[Iterable[Callable[[], None]]] = None) -> None:
        self.timeout = timeout
        self.extra = list(extra or [])

    def __call__(self) -> None:
        self.end_children()
        sys.last_traceback = sys.last_value = sys.last_type = None
        for fn in self.extra:
            fn()
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception:
            pass

    def end_children(self) -> None:
        kids = _children()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        end = time.monotonic() + self.timeout
        while kids and time.monotonic() < end:
            kids = [p for p in kids if _reap(p)]
            if kids:
                time.sleep(0.01)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass


def _reap(pid: int) -> bool:
    """True while `pid` is still running."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return False
