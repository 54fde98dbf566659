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


#: how much a total may grow over the run before it counts as a leak: (absolute, relative to its first window)
TOLERANCE = {"threads": (3, 0.0), "fds": (8, 0.0), "rss": (48 << 20, 0.10), "shm": (8 << 20, 0.10)}
#: a sample counts towards a total only when every process in it has been running this long (a process that is
#: starting has not opened what it keeps open yet)
SETTLE_S = 15.0
#: the totals judged, and how many processes (or nodes) a sample must have to count
GROUPS = {"agents": ("agent", 2), "ranks": ("rank", 4), "nodes": ("shm", 2)}


def _window(metric: str, values: list[float]) -> float:
    """A window's level: its median (a fault's round adds threads and connections for a moment)."""
    return statistics.median(values)


def flatness(samples: Iterable[dict[str, Any]], run_s: float, warmup_s: float) -> list[dict[str, Any]]:
    """The totals over the agents, over the ranks' processes and over the nodes' /dev/shm, sampled together,
    checked flat after the first `warmup_s` of the run: the median of the last fifth of the samples against
    that of the first fifth, and the fitted slope times the length, both within TOLERANCE (samples in which a
    process has run less than SETTLE_S are left out).

    Why totals and not each process: a replaced rank or node starts afresh, and an agent's descriptors depend
    on its part in the current generation (the agent that hosts the workers' store holds their connections and
    its server's; after a node loss that part may move to the other agent) - a step between two agents, not a
    leak. A leak in any one process still raises the total. Each process's own first and last values are
    listed beside (not judged)."""
    ticks: dict[float, list[dict[str, Any]]] = {}
    for s in samples:
        ticks.setdefault(s["t"], []).append(s)
    if not ticks:
        return []
    t_first = min(ticks)
    born: dict[int, float] = {}
    for t, group in sorted(ticks.items()):
        for s in group:
            born.setdefault(s["pid"], t)
    totals: dict[tuple[str, str], list[tuple[float, float]]] = {}
    per_process: dict[tuple[str, str, int], list[float]] = {}
    for t, group in sorted(ticks.items()):
        for name, (prefix, count) in GROUPS.items():
            members = [s for s in group if s["role"].startswith(prefix)]
            for metric in ("threads", "fds", "rss", "shm"):
                values = [s[metric] for s in members if s.get(metric) is not None]
                settled = all(t - born[s["pid"]] >= SETTLE_S for s in members)
                if values and len(values) == count and settled and t >= t_first + warmup_s:
                    totals.setdefault((name, metric), []).append((t, float(sum(values))))
                for s in members:
                    if s.get(metric) is not None:
                        per_process.setdefault((s["role"], metric, s["pid"]), []).append(float(s[metric]))
    out = []
    for (name, metric), pts in sorted(totals.items()):
        span = pts[-1][0] - pts[0][0]
        judged = len(pts) >= 10
        k = max(2, len(pts) // 5)
        first, last = _window(metric, [v for _, v in pts[:k]]), _window(metric, [v for _, v in pts[-k:]])
        fitted = _slope(pts) * span if len(pts) > 1 else 0.0
        absolute, relative = TOLERANCE[metric]
        allowed = absolute + relative * first
        out.append({"role": name, "metric": metric, "pid": None, "samples": len(pts), "span_s": round(span, 1),
                    "first": first, "last": last, "fitted_growth": round(fitted, 1), "allowed": allowed,
                    "judged": judged, "flat": (not judged) or (last - first <= allowed and fitted <= allowed)})
    for (role, metric, pid), values in sorted(per_process.items()):
        out.append({"role": role, "metric": metric, "pid": pid, "samples": len(values), "first": values[0],
                    "last": values[-1], "judged": False, "flat": True})
    return out
