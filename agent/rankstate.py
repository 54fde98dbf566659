"""The agent's view of each local rank and of a restart round under --inprocess-restart, and what it reports
from them when a round does not finish (agent/inprocess.py drives them)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class RankState:
    local_rank: int
    rank: int
    pid: Optional[int] = None
    ident: Optional[bytes] = None
    hello: bool = False
    last_beat: float = 0.0
    state: str = "starting"
    step: Optional[int] = None
    seq: Optional[int] = None
    progress_t: float = field(default_factory=time.monotonic)
    ready_gen: int = -1
    done_gen: int = -1
    beat_gen: int = -1
    killed: bool = False
    fault_gen: int = -1       # newest generation this process reported a FAULT in (it is recovering from it)
    stack: Optional[str] = None   # where its main thread was at its last heartbeat during a restart


@dataclass
class Round:
    target: int
    t_detect: float
    root: dict[str, Any]
    deadline: float
    grace_at: float
    signalled: bool = False
    culprits: set[int] = field(default_factory=set)
    kill_stage: int = 0
    node_ready_marked: bool = False
    ready_logged: set[int] = field(default_factory=set)
    folded: int = 0


def not_ready(ranks: dict[int, RankState], workers: dict[int, Any], target: int,
              now: float) -> list[tuple[RankState, str]]:
    """(rank, one line) for each local rank that has not reported READY for `target`: who it is and what it was
    doing (from its last heartbeat: state, step, where its main thread was). `workers`: local rank -> its
    supervised process."""
    out: list[tuple[RankState, str]] = []
    for lr, st in ranks.items():
        if st.ready_gen >= target and st.hello:
            continue
        proc = workers.get(lr)
        who = f"rank {st.rank} (pid {st.pid})"
        if proc is None or not proc.alive:
            out.append((st, f"{who} never reported READY: its process has exited"))
        elif not st.hello:
            out.append((st, f"{who} never reported READY: started {now - proc.started:.0f}s ago, it never "
                            "reached HPWrapper (still importing, or blocked before the wrapped function - e.g. in "
                            "a process group created at import time)"))
        else:
            step = f" at step {st.step}" if st.step is not None else ""
            where = f"; main thread in {st.stack}" if st.stack else ""
            out.append((st, f"{who} never reported READY: {st.state}{step}, last heartbeat "
                            f"{now - st.last_beat:.1f}s ago{where}"))
    return out
