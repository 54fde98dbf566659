"""What a process group really is - gloo, nccl-legacy or nccl2 - read from its backend objects, never from the
name the user typed.

Why: from torch 2.15 on, `init_process_group("nccl")` builds nccl2 (ProcessGroupNCCL2, the in-tree backend on
the torchcomms engine) unless TORCH_DIST_USE_NCCL2=0 was set when torch.distributed was imported, and
`"nccl-legacy"` / `"nccl2"` / `"nccl-lazy"` / `"cpu:gloo,cuda:nccl"` name backends explicitly. The name that
`dist.get_backend()` returns therefore says neither which engine runs nor how to abort it. The abort, the
park/release of ended groups and the standby's NCCL warm-up ask this module instead (hyperpodrun/runtime/abort.py,
agent/workers/zygote.py). What differs between the kinds, from torch's own source:

- nccl-legacy (ProcessGroupNCCL, torch <= 2.14's "nccl"): several communicators' aborts run inside one NCCL group
  (`_group_start`/`_group_end` on the backend, as torch 2.13's `_abort_process_group`), because ncclCommAbort
  was a collective call in some NCCL versions (pytorch issue 119797).
- nccl2 (ProcessGroupNCCL2 and its lazy variant ProcessGroupNCCLLazy, torch 2.15): the backend has no
  `_group_start`/`_group_end`; its `abort()` tears the communicator down itself (revoking a reconfigurable one,
  draining its work, then aborting) and never ends the process. Its groups also get a FlightRecorder hook
  that torch keeps in `_world.pg_flight_recorder_hooks`, one more registry that holds the group alive.
- gloo: `abort()` does not unblock a collective in flight; only its peers' sockets going down do.
"""
from __future__ import annotations

from typing import Any, Iterable

GLOO, NCCL_LEGACY, NCCL2, OTHER = "gloo", "nccl-legacy", "nccl2", "other"
NCCL_KINDS = frozenset({NCCL_LEGACY, NCCL2})

#: torch's backend classes (in torch.distributed.distributed_c10d) -> kind; a class missing from this torch is skipped
_CLASSES = (("ProcessGroupNCCL2", NCCL2), ("ProcessGroupNCCLLazy", NCCL2), ("ProcessGroupNCCL", NCCL_LEGACY),
            ("ProcessGroupGloo", GLOO))
#: what a backend says it is (c10d::Backend::getBackendName) -> kind, for backends of no class above
_NAMES = {"nccl2": NCCL2, "nccl-lazy": NCCL2, "nccl": NCCL_LEGACY, "gloo": GLOO}


def backend_kind(backend: Any) -> str:
    """The kind of one c10d backend object (what `ProcessGroup._get_backend(device)` returns): by its class where
    this torch has that class, else by the name the backend reports of itself; OTHER for anything else (ucc,
    mpi, a torchcomms wrapper, a plugin)."""
    if backend is None:
        return OTHER
    c10d: Any = None
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        pass
    for attr, kind in _CLASSES:
        cls = getattr(c10d, attr, None)
        if isinstance(cls, type) and isinstance(backend, cls):
            return kind
    for method in ("name", "_get_backend_name"):
        fn = getattr(backend, method, None)
        if callable(fn):
            try:
                reported = str(fn()).lower()
            except Exception:
                continue
            if reported in _NAMES:
                return _NAMES[reported]
    return OTHER


def backends_of(pg: Any) -> list[Any]:
    """The distinct backend objects of one process group, one per device type it serves (a 2.15 gloo group
    serves 'cpu' and 'cuda' with one object; a 'cpu:gloo,cuda:nccl' group has two)."""
    out: list[Any] = []
    for dev in list(getattr(pg, "_device_types", None) or []):
        try:
            backend = pg._get_backend(dev)
        except Exception:
            continue
        if not any(backend is b for b in out):
            out.append(backend)
    return out


def group_kinds(pg: Any) -> set[str]:
    """Every kind among one process group's backends."""
    return {backend_kind(b) for b in backends_of(pg)}


def registered_groups() -> list[Any]:
    """Every process group in torch's registry, newest first (the order torch aborts and shuts them down in); []
    without torch.distributed or where this torch keeps no such registry."""
    try:
        import torch.distributed as dist
        world = getattr(dist.distributed_c10d, "_world", None)
        names = dict(getattr(world, "pg_names", None) or {})
    except Exception:
        return []
    return sorted(names, key=lambda pg: names[pg], reverse=True)


def kinds_of(groups: Iterable[Any]) -> set[str]:
    """Every kind among the backends of `groups`."""
    out: set[str] = set()
    for pg in groups:
        out |= group_kinds(pg)
    return out


def current_kinds() -> set[str]:
    """Every kind among the backends of the process groups this process has now."""
    return kinds_of(registered_groups())


def uses_nccl(kinds: Iterable[str]) -> bool:
    """True when any of `kinds` is an NCCL engine (legacy or nccl2): its communicators must be aborted."""
    return any(k in NCCL_KINDS for k in kinds)


def group_bracket(groups: Iterable[Any]) -> tuple[Any, Any]:
    """(start, end) to put around several communicators' aborts, or (None, None).

    nccl-legacy: the first legacy backend's `_group_start`/`_group_end` (one NCCL group, as torch 2.13's
    `_abort_process_group`). nccl2 has none and needs none: each backend's abort() revokes, drains and aborts
    its own communicator without waiting for peers; torch 2.15's `_abort_process_group` brackets them only
    through its coalescing manager, which would touch the registry our abort has already emptied. A job with
    both kinds brackets its legacy communicators, which is all the bracket was ever for."""
    for pg in groups:
        for backend in backends_of(pg):
            if backend_kind(backend) == NCCL_LEGACY:
                start, end = getattr(backend, "_group_start", None), getattr(backend, "_group_end", None)
                if callable(start) and callable(end):
                    return start, end
    return None, None
