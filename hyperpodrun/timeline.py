"""A recovery timeline from a run's event log: what every rank did, when (`hyperpodrun logs RUN --timeline F`).

Why: the event log says in text what happened; a picture says where the time of a recovery went. Time runs
along x, one lane per global rank; each recovery round is cut into the phases the agents recorded:

    training     the rank trains (from its start, or from GO, to the next fault)
    detection    the fault happened on another rank / node; this rank has not been told yet
    abort        tearing its process groups down (READY's abort_s)
    finalize     clean-up after the abort (READY's finalize_s) and the health check (health_s)
    respawn      the rank's process died: a new one starts (fork or cold start) until it is READY
    barrier      READY, waiting for every rank of the job (GO)
    restore      GO until the rank's state was restored from memory (state_restored)
    restart      a process-level restart: every worker stopped and started again

`segments()` is pure (events in, segments out) and what the tests check; `draw()` needs matplotlib (the
`timeline` extra) and only renders them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from hyperpodrun.errors import ApiValueError, MissingDependencyError

#: phase -> colour (colour-blind-safe palette)
COLOURS = {"training": "#4daf4a", "detection": "#999999", "abort": "#e41a1c", "finalize": "#ff7f00",
           "respawn": "#984ea3", "barrier": "#ffd92f", "restore": "#377eb8", "restart": "#a65628"}


@dataclass(frozen=True)
class Segment:
    rank: int
    phase: str
    start: float    # wall-clock seconds (the event log's ts)
    end: float


def read_events(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every record of the given event logs, in time order (JSON only; unreadable lines are skipped)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("ts"), (int, float)):
                    out.append(rec)
    return sorted(out, key=lambda r: r["ts"])


def segments(events: list[dict[str, Any]]) -> list[Segment]:
    """The phases of every rank, from the records of all the job's event logs (read_events)."""
    ranks = sorted({e["rank"] for e in events if e.get("event") == "worker_start" and isinstance(e.get("rank"), int)})
    if not ranks:
        return []
    end = max(e["ts"] for e in events)
    started = {r: min(e["ts"] for e in events if e.get("event") == "worker_start" and e.get("rank") == r)
               for r in ranks}
    out: list[Segment] = []
    busy_from = dict(started)   # rank -> when its current training stretch began
    faults = [e for e in events if e.get("event") == "fault"]
    gos = [e for e in events if e.get("event") == "go"]
    restarts = [e for e in events if e.get("event") == "restart_done"]
    done_rounds: set[int] = set()
    for fault in faults:
        gen = int(fault.get("generation", 0)) + 1
        if gen in done_rounds:
            continue            # several nodes report the same round
        done_rounds.add(gen)
        t0 = fault["ts"]
        go = next((g for g in gos if g.get("generation") == gen), None)
        restart = next((r for r in restarts if r.get("generation") == gen), None)
        if go is None and restart is None:
            continue            # the job ended in this round
        if go is None:          # process level: everything stopped and started again
            for r in ranks:
                out.append(Segment(r, "training", busy_from[r], t0))
                out.append(Segment(r, "restart", t0, restart["ts"]))   # type: ignore[index]
                busy_from[r] = restart["ts"]   # type: ignore[index]
            continue
        t_go = go["ts"]
        # a new process for the round (respawned, or on the node that replaced a lost one)
        respawned = {e["rank"] for e in events if e.get("event") in ("respawn", "worker_start")
                     and e.get("generation") == gen}
        restored = [e["ts"] for e in events if e.get("event") == "state_restored" and e.get("generation") == gen]
        t_restored = max(restored) if restored and max(restored) >= t_go else None
        for r in ranks:
            ready = next((e for e in events if e.get("event") == "rank_ready" and e.get("rank") == r
                          and e.get("generation") == gen), None)
            out.append(Segment(r, "training", busy_from[r], t0))
            if r in respawned or ready is None:
                t = ready["ts"] if ready is not None else t_go
                out.append(Segment(r, "respawn", t0, t))
            else:   # READY came right after abort, finalize and the health check: they end there
                t = ready["ts"]
                fin = max(0.0, float(ready.get("finalize_s") or 0.0) + float(ready.get("health_s") or 0.0))
                t_fin = max(t0, t - fin)
                t_abort = max(t0, t_fin - max(0.0, float(ready.get("abort_s") or 0.0)))
                out += [Segment(r, "detection", t0, t_abort), Segment(r, "abort", t_abort, t_fin),
                        Segment(r, "finalize", t_fin, t)]
            out.append(Segment(r, "barrier", t, t_go))
            if t_restored is not None:
                out.append(Segment(r, "restore", t_go, t_restored))
                busy_from[r] = t_restored
            else:
                busy_from[r] = t_go
    for r in ranks:
        out.append(Segment(r, "training", busy_from[r], end))
    return [s for s in out if s.end > s.start]


def draw(segs: list[Segment], path: str, title: str = "") -> None:
    """Render `segs` as a PNG at `path` (one lane per rank; time in seconds from the first event)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingDependencyError("the timeline needs matplotlib: pip install 'hyperpodrun[timeline]' "
                                     "(or pip install matplotlib)") from None
    if not segs:
        raise ApiValueError("nothing to draw: no worker started in this run's event log")
    t0 = min(s.start for s in segs)
    ranks = sorted({s.rank for s in segs})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(ranks) + 1.6))
    for s in segs:
        ax.barh(ranks.index(s.rank), s.end - s.start, left=s.start - t0, color=COLOURS[s.phase], height=0.8,
                linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first worker started")
    used = [p for p in COLOURS if any(s.phase == p for s in segs)]
    ax.legend(handles=[Patch(color=COLOURS[p], label=p) for p in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(ranks) < 4 else -0.12), ncol=len(used), frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(segs: list[Segment]) -> str:
    """One line: ranks, and seconds per phase summed over ranks (what the picture shows)."""
    ranks = {s.rank for s in segs}
    totals: dict[str, float] = {}
    for s in segs:
        totals[s.phase] = totals.get(s.phase, 0.0) + s.end - s.start
    parts = ", ".join(f"{p} {totals[p]:.2f}s" for p in COLOURS if p in totals)
    return f"{len(ranks)} rank(s); rank-seconds per phase: {parts}"


def phases_of(segs: list[Segment], rank: int) -> list[str]:
    """The phases of `rank` in time order, repeats collapsed (for tests and diagnostics)."""
    seq: list[str] = []
    for s in sorted((s for s in segs if s.rank == rank), key=lambda s: s.start):
        if not seq or seq[-1] != s.phase:
            seq.append(s.phase)
    return seq

