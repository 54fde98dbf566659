"""The node's state: one owner, one phase enum, every phase change in one place.

Why: the agent's behaviour is a state machine (start, run, in-process round, stop, wait for a store, exit
barrier, done) that the next capabilities (node loss, spares, elastic membership, standby workers) extend.
Keeping the phase and the fields that belong to it in one object, changed only through the methods below,
makes each transition checkable (an illegal one raises at once, in tests and in production) and lets the
policies (in-process round, process-level restart, GPU health) read the state without holding the agent
(docs/ARCHITECTURE.md, "Node phases").

Only the agent's loop thread reads or changes a NodeState. Its methods change state only; what follows
from a change (signalling workers, spawning, the event log) is done by agent/node.py.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Optional

from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.errors import HyperpodrunError


class Phase(str, enum.Enum):
    """Where this node is in the job."""

    STARTING = "starting"              # rendezvous done, no worker started yet
    RUNNING = "running"                # the workers of `generation` are up
    RESTARTING = "restarting"          # an in-process round towards a new generation is under way
    STOPPING = "stopping"              # every worker was signalled; then restart or exit (`stop`)
    AWAITING_STORE = "awaiting_store"  # stopped for a restart: waiting for the new generation's worker store
    FINISHING = "finishing"            # every local worker succeeded: waiting for the other nodes (exit barrier)
    DONE = "done"                      # `exit_code` is final


#: the transitions a node may make; anything else is a bug and raises IllegalTransition
ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.AWAITING_STORE, Phase.STOPPING}),
    Phase.RUNNING: frozenset({Phase.RESTARTING, Phase.STOPPING, Phase.FINISHING, Phase.DONE}),
    Phase.RESTARTING: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING, Phase.FINISHING, Phase.DONE}),
    Phase.STOPPING: frozenset({Phase.AWAITING_STORE, Phase.DONE}),
    Phase.AWAITING_STORE: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.FINISHING: frozenset({Phase.STOPPING, Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(HyperpodrunError):
    """A phase change the state machine does not allow: a bug in hyperpodrun, never a user error."""


@dataclass(frozen=True)
class StopPlan:
    """What follows once every worker has stopped: a restart into generation `value`, or exit with code `value`."""

    action: Literal["restart", "exit"]
    value: int

    @staticmethod
    def restart(generation: int) -> "StopPlan":
        return StopPlan("restart", generation)

    @staticmethod
    def exit(code: int) -> "StopPlan":
        return StopPlan("exit", code)


@dataclass
class NodeState:
    """The phase of this node and the fields that belong to it. Changed only through the methods below."""

    phase: Phase = Phase.STARTING
    generation: int = 0
    stop: Optional[StopPlan] = None          # set while STOPPING
    stop_started: float = 0.0
    stop_deadline: Optional[float] = None    # SIGKILL of what is still alive after it
    killed_all: bool = False
    pending_generation: Optional[int] = None  # set while AWAITING_STORE
    detect_t: Optional[float] = None         # when the fault being recovered from was detected
    finish_deadline: Optional[float] = None  # set while FINISHING: the other nodes must be done by then
    left_deadline: Optional[float] = None    # FINISHING, every node is done: how long the store host stays
    first_failure: Optional[FailureInfo] = None
    exit_code: Optional[int] = None
    stopped_by_signal: Optional[int] = None

    # ---------------------------------------------------------------- queries (the guards, named once)
    @property
    def active(self) -> bool:
        """Workers of the current generation are up or recovering in-process."""
        return self.phase in (Phase.RUNNING, Phase.RESTARTING)

    @property
    def exiting(self) -> bool:
        """The node has decided to exit (stopping towards an exit, or done)."""
        return self.phase is Phase.DONE or (self.stop is not None and self.stop.action == "exit")

    @property
    def ending(self) -> bool:
        """Nothing is to be restarted any more: the local workers succeeded, or the node is exiting."""
        return self.phase is Phase.FINISHING or self.exiting

    @property
    def restarting_to(self) -> Optional[int]:
        """The generation a process-level restart in progress goes to (stopping for it, or waiting for its
        store), else None."""
        if self.stop is not None and self.stop.action == "restart":
            return self.stop.value
        return self.pending_generation if self.phase is Phase.AWAITING_STORE else None

    @property
    def job_known_complete(self) -> bool:
        """FINISHING and every node has reported success: the job's outcome is known."""
        return self.phase is Phase.FINISHING and self.left_deadline is not None

    # ---------------------------------------------------------------- transitions
    def _to(self, phase: Phase) -> None:
        if phase not in ALLOWED[self.phase]:
            raise IllegalTransition(f"node phase {self.phase.value} -> {phase.value} is not allowed")
        self.phase = phase

    def record_failure(self, info: FailureInfo) -> None:
        """Keep the first failure that ends the job (later ones are consequences)."""
        if self.first_failure is None:
            self.first_failure = info

    def note_fault(self, now: float) -> None:
        """A fault that a process-level restart recovers from was detected now (for the downtime report)."""
        self.detect_t = now

    def take_detect_time(self) -> Optional[float]:
        """When the fault just recovered from was detected (once; None when there was none)."""
        t, self.detect_t = self.detect_t, None
        return t

    def note_signal(self, signum: int) -> None:
        """The node was told to stop by `signum` (the post-train hook is then skipped)."""
        self.stopped_by_signal = signum

    def mark_killed_all(self) -> None:
        """STOPPING: what was still alive at the deadline got SIGKILL."""
        self.killed_all = True

    def begin_stop(self, plan: StopPlan, now: float, shutdown_timeout: float) -> None:
        """Every live worker is about to be signalled; SIGKILL after `shutdown_timeout`. While STOPPING already,
        the new plan replaces the old one (a signal during a restart, the job failing during one)."""
        if self.phase is not Phase.STOPPING:
            self._to(Phase.STOPPING)
        self.stop = plan
        self.stop_started = now
        self.stop_deadline = now + shutdown_timeout
        self.killed_all = False

    def stop_complete(self) -> StopPlan:
        """Every worker has stopped: returns the plan; a restart moves to AWAITING_STORE (an exit is followed
        by `finish`)."""
        if self.phase is not Phase.STOPPING or self.stop is None:
            raise IllegalTransition(f"stop completed in phase {self.phase.value}")
        plan, self.stop, self.stop_deadline = self.stop, None, None
        if plan.action == "restart":
            self._to(Phase.AWAITING_STORE)
            self.pending_generation = plan.value
        return plan

    def await_store(self, generation: int) -> None:
        """Generation `generation`'s worker store is not published yet."""
        if self.phase is not Phase.AWAITING_STORE:
            self._to(Phase.AWAITING_STORE)
        self.pending_generation = generation

    def workers_started(self, generation: int) -> None:
        """Every local worker of `generation` was spawned."""
        self._to(Phase.RUNNING)
        self.generation = generation
        self.pending_generation = None

    def begin_round(self) -> None:
        """An in-process round started (or a process-level restart waits for READY of its new workers)."""
        self._to(Phase.RESTARTING)

    def round_done(self, generation: int) -> None:
        """GO(generation) went out: the survivors and the respawned ranks train on."""
        if self.phase is not Phase.RESTARTING:
            raise IllegalTransition(f"GO in phase {self.phase.value}: no round is under way")
        self._to(Phase.RUNNING)
        self.generation = generation

    def begin_finish(self, now: float, timeout: float) -> None:
        """Every local worker succeeded on a multi-node job: wait for the other nodes up to `timeout`."""
        self._to(Phase.FINISHING)
        self.finish_deadline = now + timeout

    def all_nodes_done(self, now: float, linger: float) -> None:
        """FINISHING: every node has succeeded (the job's outcome is known); the store host serves the store
        up to `linger` seconds more, until every agent has read that."""
        if self.phase is not Phase.FINISHING:
            raise IllegalTransition(f"all nodes done in phase {self.phase.value}")
        self.left_deadline = now + linger

    def finish(self, code: int) -> None:
        """The node's exit code is final."""
        self._to(Phase.DONE)
        self.exit_code = code
        self.stop = None
        self.stop_deadline = self.finish_deadline = None
