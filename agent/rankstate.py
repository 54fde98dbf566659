"""The agent's view of each local rank and of a restart round under --inprocess-restart, and what it reports
from them (a round that does not finish, a job that stops progressing, a step that keeps failing);
agent/inprocess.py drives them."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from hyperpodrun import protocol as P
from hyperpodrun.agent.coordination.store_schema import FailureInfo, Layout


#: a SIGABRT exit, as Popen and as a shell report it
ABORTED = (-signal.SIGABRT, 128 + signal.SIGABRT)


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
    release_lost: bool = False    # its SHUTDOWN could not be delivered after it reported DONE: it was killed
    voices: frozenset[bytes] = frozenset()   # the control identities of its HELLO (agent/control/voices.py)

    def spawned(self, pid: int, now: float) -> None:
        """A new process runs this rank: nothing it said before counts."""
        self.pid, self.ident, self.hello, self.state, self.killed = pid, None, False, "starting", False
        self.step, self.stack, self.release_lost = None, None, False
        self.voices = frozenset()
        self.last_beat = self.progress_t = now

    def heard(self, beat: P.Heartbeat, now: float) -> None:
        """A heartbeat: progress is a new (step, collective sequence), state or generation."""
        moved = (beat.step, beat.seq) != (self.step, self.seq)
        if moved or beat.state != self.state or beat.generation != self.beat_gen:
            self.progress_t = now
        self.step, self.seq, self.state, self.beat_gen = beat.step, beat.seq, beat.state, beat.generation
        self.stack = beat.stack

    def exit_is_success(self, code: int, generation: int) -> bool:
        """Once the job completed: exit code 0, or SIGABRT of a rank that had reported completion - torch's gloo
        can abort the process in interpreter teardown ("terminate called without an active exception", a
        worker thread dropping a tensor while Python finalizes), and the training result is in by then; or
        the kill of a rank that reported completion but could not be released."""
        return code == 0 or (self.done_gen >= generation and (code in ABORTED or self.release_lost))

    def failure(self, host: str, **fields: Any) -> FailureInfo:
        """A failure of this rank: who and where it is, plus `fields`."""
        return FailureInfo.model_validate({"host": host, "rank": self.rank, "local_rank": self.local_rank,
                                           "pid": self.pid, "step": self.step, **fields})


@dataclass
class Round:
    """One in-process restart round towards generation `target`."""

    target: int
    t_detect: float
    root: FailureInfo
    deadline: float
    grace_at: float
    signalled: bool = False
    culprits: set[int] = field(default_factory=set)
    kill_stage: int = 0
    node_ready_marked: bool = False
    ready_logged: set[int] = field(default_factory=set)
    folded: int = 0
    #: lost nodes whose replacement the round waits for: node rank -> the lost incarnation
    awaiting: dict[int, str] = field(default_factory=dict)
    #: the elastic layout the round moves to, when the job's nodes change in it (agent/coordination/layout.py)
    layout: Optional[Layout] = None
    #: not the store host: a lost node was not replaced in time, and the store host decides whether to shrink
    shrink_wait: bool = False


def not_ready(ranks: Mapping[int, RankState], workers: Mapping[int, Any], target: int,
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


def stuck_ranks(ranks: Mapping[int, RankState], live: Mapping[int, Any], target: int,
                generation: int) -> list[RankState]:
    """Live ranks still in the failed generation's function after RESTART: no READY, no heartbeat of the new
    generation, and no FAULT report (a rank that reported one left the function: it is recovering)."""
    return [st for lr, st in ranks.items() if lr in live and st.hello and not st.killed and st.ready_gen < target
            and st.state in ("running", "done") and st.beat_gen < target and st.fault_gen < generation]


def first_to_kill(stuck: list[RankState], culprits: set[int]) -> list[RankState]:
    """Of the stuck ranks, the ones killed first: the progress culprits, else the one whose collective
    sequence lags most (the others most likely wait for it)."""
    return [st for st in stuck if st.local_rank in culprits] or (
        [min(stuck, key=lambda s: (s.seq if s.seq is not None else -1))] if stuck else [])


def progress_culprits(ranks: Mapping[int, RankState], live: Mapping[int, Any], now: float,
                      timeout: float) -> tuple[list[RankState], list[Optional[int]], Optional[int]]:
    """Ranks that made no progress for `timeout` -> (culprits, their collective sequences, the highest one).
    The culprit is the rank whose collective sequence lags, not the ranks blocked waiting for it; no culprit
    when nobody stalled."""
    running = [st for lr, st in ranks.items() if lr in live and st.hello and st.state == "running"]
    if not [st for st in running if now - st.progress_t > timeout]:
        return [], [], None
    seqs = [st.seq for st in running if st.seq is not None]
    top = max(seqs) if seqs else None
    lagging = [st for st in running if st.seq is not None and top is not None and st.seq < top]
    culprits = lagging or [st for st in running if now - st.progress_t > timeout]
    return culprits, [st.seq for st in culprits], top


class StepGuard:
    """Ends the job when the same step fails `limit` times in a row (--max-step-failures): each round's root
    cause is counted once; a round whose cause is at another step starts the count again."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.last: Optional[tuple[Optional[int]]] = None
        self.failures = 0

    def count(self, info: FailureInfo) -> Optional[str]:
        """Count a round's root cause; the message that ends the job when the limit is reached, else None."""
        key = (info.step,)
        if key == self.last:
            self.failures += 1
        else:
            self.last, self.failures = key, 1
        if self.failures < self.limit:
            return None
        where = f"step {info.step}" if info.step is not None else "the same point (no progress reported in between)"
        return (f"{where} failed {self.failures} times in a row (--max-step-failures {self.limit}); last: "
                f"{info.summary}. Fix the cause or raise --max-step-failures")
