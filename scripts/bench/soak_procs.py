"""The chaos soak's view of the processes of a namespaced node (scripts/bench/soak.py): which host process runs
a rank, what the agents and the ranks hold (threads, descriptors, RSS) and how much of each node's private
/dev/shm is used, sampled over the run, and whether those series stayed flat.

Why here and not from the workers' own reports: a leak in the agent, or in a worker that is stuck, is exactly
what a worker cannot report; /proc of the host sees every process of every node's pid namespace.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Iterable, Optional


def _ppids() -> dict[int, int]:
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                out[int(name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return out


def descendants(root: int) -> list[int]:
    """Every living process below `root` (not `root` itself)."""
    ppids = _ppids()
    kids: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for kid in kids.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
    except OSError:
        pass
    return kids


def ns_pid(pid: int) -> Optional[int]:
    """The pid of host process `pid` in its own (innermost) pid namespace."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def host_pid(root: int, inner: int) -> Optional[int]:
    """The host pid of the process below `root` that is `inner` in its node's pid namespace."""
    for pid in descendants(root):
        if ns_pid(pid) == inner:
            return pid
    return None


def usage(pid: int) -> Optional[dict[str, int]]:
    """Threads, open descriptors and resident set size (bytes) of a process; None once it is gone."""
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return {"threads": threads, "fds": fds, "rss": rss}


def shm_used(root_pid: Optional[int] = None) -> Optional[int]:
    """Bytes used on /dev/shm as the process `root_pid` sees it (its node's private tmpfs), or the host's."""
    path = f"/proc/{root_pid}/root/dev/shm" if root_pid else "/dev/shm"
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, value)."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


#: how much a series may grow over the run before it counts as a leak: (absolute, relative to its first window).
#: A survivor's descriptors move by a few with the phase it is sampled in (connections to the other node's
#: processes come and go with them); a leak of one per fault shows over a run's tens of faults.
TOLERANCE = {"threads": (3, 0.0), "fds": (8, 0.0), "rss": (24 << 20, 0.10), "shm": (8 << 20, 0.10)}
#: threads and descriptors: the floor of a window (a leak raises the floor; a fault's round only adds for a
#: while); RSS and /dev/shm: its median
FLOOR = ("threads", "fds")


def flatness(samples: Iterable[dict[str, Any]], run_s: float, warmup_s: float) -> list[dict[str, Any]]:
    """Each series (a process of a role, or a node's /dev/shm) that lived through most of the run, checked flat:
    its last fifth of samples against its first fifth (after its own first `warmup_s`: a new process, or a
    replacement node, is still starting), and its fitted slope times its length, both within TOLERANCE.
    Series that lived < 40 % of the run (a replaced rank, a node's replacement) are listed but not judged."""
    series: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for s in samples:
        for metric in ("threads", "fds", "rss", "shm"):
            if metric in s and s[metric] is not None:
                series.setdefault((s["role"], metric, s["pid"]), []).append((s["t"], float(s[metric])))
    out = []
    for (role, metric, pid), pts in sorted(series.items()):
        pts = [p for p in pts if p[0] >= pts[0][0] + warmup_s] or pts[-1:]
        span = pts[-1][0] - pts[0][0]
        judged = span >= 0.4 * max(1.0, run_s - warmup_s) and len(pts) >= 10
        k = max(2, len(pts) // 5)
        pick = min if metric in FLOOR else statistics.median
        first, last = pick(v for _, v in pts[:k]), pick(v for _, v in pts[-k:])
        grown, fitted = last - first, (_slope(pts) * span if len(pts) > 1 else 0.0)
        absolute, relative = TOLERANCE[metric]
        allowed = absolute + relative * first
        out.append({"role": role, "metric": metric, "pid": pid, "samples": len(pts), "span_s": round(span, 1),
                    "first": first, "last": last, "fitted_growth": round(fitted, 1), "allowed": allowed,
                    "judged": judged, "flat": (not judged) or (grown <= allowed and fitted <= allowed)})
    return out
