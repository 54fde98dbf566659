"""Process-level restarts: which rank failed, whether the job-wide budget allows a restart, and what another
node's restart or failure means here (docs/ARCHITECTURE.md, "Restart protocol").

A failed worker exit goes through a CauseWindow (agent/observe/report.py) so the restart names the rank that really
failed, not one that saw its peer go. Then every worker of the job restarts while --max-restarts lasts
(counted job-wide, agent/coordination/job_state.py), else the job ends with the cause's exit code. It holds no handle
on the agent: it reads NodeState and asks the node (the Stopper port) to stop its workers.
"""
from __future__ import annotations

import logging
import signal
from typing import Optional, Protocol

from hyperpodrun.agent.security.intruders import RollCallFailures, is_roll_call_failure
from hyperpodrun.agent.ports import Clock, Coordination, Events
from hyperpodrun.agent.observe.report import CauseWindow, exit_is_symptom, exit_text, failure_summary
from hyperpodrun.agent.state import NodeState, Phase, StopPlan
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.agent.workers.supervisor import WorkerProcess, describe_exit, shell_code
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import EXIT_AGENT_ERROR, EXIT_INTRUDER, EXIT_NO_USABLE_GPU, EXIT_RESTARTS_EXHAUSTED


class Stopper(Protocol):
    """What the policy asks of the node (agent/node.py carries it out on the loop thread)."""

    def begin_stop(self, plan: StopPlan, sig: int) -> None: ...

    def kill(self, local_rank: int) -> bool: ...


class ProcessRestart:
    """The process-level restart policy of one node."""

    def __init__(self, cfg: LaunchConfig, host: str, state: NodeState, coord: Coordination, events: Events,
                 clock: Clock, stopper: Stopper, exit_grace_s: float) -> None:
        self.cfg = cfg
        self.host = host
        self.state = state
        self.coord = coord
        self.events = events
        self.clock = clock
        self.stopper = stopper
        self.causes = CauseWindow(exit_grace_s)   # which rank failed first
        self.roll_calls = RollCallFailures(events)   # outsiders in a worker group (agent/security/intruders.py)

    # ------------------------------------------------------------------ local failures
    def worker_failed(self, proc: WorkerProcess, code: int, error_file: Optional[str],
                      stderr_log: Optional[str]) -> None:
        """A worker failed: act on it now, or, when it looks like a consequence of another rank's failure,
        wait a moment for that rank's exit, so that the restart names the rank that really failed."""
        info = FailureInfo(host=self.host, rank=proc.rank, local_rank=proc.local_rank, pid=proc.pid,
                           exit_code=shell_code(code), cause=describe_exit(code), generation=self.state.generation,
                           error_file=error_file, stderr_log=stderr_log,
                           symptom=exit_is_symptom(code, exit_text(stderr_log, error_file)))
        cause = self.causes.add(info.with_(summary=failure_summary(info)), self.clock.monotonic())
        if cause is not None:
            self._act_on_cause(cause)

    def tick(self, now: float) -> None:
        """A cause whose window has closed is acted on; one that is overtaken (stopping for another reason:
        a signal, another node's restart) is dropped."""
        if not self.causes.open:
            return
        if self.state.phase is not Phase.RUNNING:
            self.causes.clear()
        elif (cause := self.causes.due(now)) is not None:
            self._act_on_cause(cause)

    def rank_fault(self, local_rank: int, info: FailureInfo) -> None:
        """A rank is faulty for a reason other than its exit (its GPU): kill it and restart every worker."""
        if self.state.phase is not Phase.RUNNING:
            return   # already stopping: the respawn uses the new GPU assignment
        self.stopper.kill(local_rank)
        self.state.note_fault(self.clock.monotonic())
        self.restart_or_fail(info, f"rank {info.rank} failed: {info.cause}")

    def _act_on_cause(self, cause: FailureInfo) -> None:
        also = f" (also failed, most likely as a consequence: {', '.join(cause.folded)})" if cause.folded else ""
        self.restart_or_fail(cause, f"rank {cause.rank} failed: {cause.cause}{also}")

    def restart_or_fail(self, info: FailureInfo, message: str) -> None:
        """Restart every worker of the job while the budget lasts, else end the job."""
        if is_roll_call_failure(info):
            self._outsider(info)
            return
        self.events.emit("fault", message, rank=info.rank, exit_code=info.exit_code,
                         generation=self.state.generation, level=logging.ERROR)
        grant = self.coord.request_restart(self.state.generation, info, count_budget=True)
        if grant.budget_ok:
            used = self.coord.restarts_used()
            self.events.emit("restart_begin", f"process-level restart {min(used, self.cfg.max_restarts)}/"
                             f"{self.cfg.max_restarts}: generation {self.state.generation} -> {grant.generation}",
                             generation=grant.generation, root_cause=info.summary)
            self.stopper.begin_stop(StopPlan.restart(grant.generation), self.cfg.shutdown_signal)
            return
        if not grant.started and grant.cause != info:
            # another agent claimed this restart first and found the budget spent: the job ends with its cause
            self.remote_failure(self.coord.report_failure(grant.cause))
            return
        self.state.record_failure(info)
        self.coord.report_failure(info)
        self.stopper.begin_stop(StopPlan.exit(info.exit_code), self.cfg.shutdown_signal)

    def _outsider(self, info: FailureInfo) -> None:
        """A worker's roll call failed: a process outside the job took a rank's place. Retried once on a fresh
        store, outside the --max-restarts budget; the second time the job ends with the roll call's message."""
        if not self.roll_calls.retry(info):
            self.fail(self.roll_calls.final(info), EXIT_INTRUDER)
            return
        grant = self.coord.request_restart(self.state.generation, info, count_budget=False)
        self.events.emit("restart_begin", f"restart after a failed roll call (not counted): generation "
                         f"{self.state.generation} -> {grant.generation}", generation=grant.generation,
                         root_cause=info.summary)
        self.stopper.begin_stop(StopPlan.restart(grant.generation), self.cfg.shutdown_signal)

    def escalate(self, target: int, root: FailureInfo) -> None:
        """An in-process round did not finish in time: process-level restart of this node (budget allowing)."""
        grant = self.coord.request_restart(target, root, count_budget=True)
        if not grant.budget_ok:
            why = (f"in-process restart timed out and the restart budget (--max-restarts {self.cfg.max_restarts}) "
                   f"is spent; {root.summary}")
            self.fail(root.with_(summary=why, cause=why), EXIT_RESTARTS_EXHAUSTED)
            return
        self.state.note_fault(self.clock.monotonic())
        self.events.emit("restart_begin", f"process-level restart of this node's workers: generation "
                         f"{grant.generation} ({signal.Signals(self.cfg.shutdown_signal).name}, SIGKILL after "
                         f"{self.cfg.shutdown_timeout:g}s)", generation=grant.generation)
        self.stopper.begin_stop(StopPlan.restart(grant.generation), self.cfg.shutdown_signal)

    def fail(self, info: FailureInfo, code: int) -> None:
        """End the job: record the cause, tell the other nodes, stop every worker (once)."""
        if self.state.exiting:
            return
        info = info.with_(exit_code=code)
        self.state.record_failure(info)
        self.coord.report_failure(info)
        self.stopper.begin_stop(StopPlan.exit(code), self.cfg.shutdown_signal)

    # ------------------------------------------------------------------ other nodes
    def remote_generation(self, gen: int) -> None:
        """Another node started generation `gen` (process level): restart this node's workers into it."""
        going_to = self.state.restarting_to
        if gen <= self.state.generation or (going_to is not None and going_to >= gen) or self.state.exiting:
            return
        self.state.note_fault(self.clock.monotonic())
        self.events.emit("restart_remote", f"another node started generation {gen}: restarting this node's workers",
                         generation=gen)
        self.stopper.begin_stop(StopPlan.restart(gen), self.cfg.shutdown_signal)

    def remote_failure(self, info: FailureInfo) -> None:
        """The job failed (on another node, or another agent decided it): stop and exit with its code."""
        if self.state.exiting:
            return
        self.state.record_failure(info)
        self.events.emit("job_failed_remote", f"job failed on {info.host}: {info.summary}", level=logging.ERROR)
        code = info.exit_code
        if code == EXIT_NO_USABLE_GPU:   # only the node without a usable GPU asks to be replaced
            code = EXIT_AGENT_ERROR
        self.stopper.begin_stop(StopPlan.exit(code), self.cfg.shutdown_signal)
