"""The node's state machine: what each loop event does to the NodeState, and the effects that follow.

The agent's loop (agent/agent.py) gathers events - signals, helper-thread posts, worker exits, control
messages, time - and hands each to a `Node` handler; the handler moves the phase through NodeState
(agent/state.py) and carries out the effects (signal, spawn, publish, finish) at once, on the loop thread.
The policies decide, the Node acts: the in-process round (agent/inprocess.py), process-level restarts
(agent/restart_policy.py) and GPU health (agent/health/gpu_health.py) reach the node only through the NodeOps /
GpuOps ports it implements. Phases and transitions: docs/ARCHITECTURE.md, "Node phases".
"""
from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from hyperpodrun import protocol as P
from hyperpodrun.agent.ports import (Clock, Coordination, Events, Launcher, Posted, ProcessTable, RendezvousInfo,
                                     WorkerStoreHost)
from hyperpodrun.agent.coordination import stores
from hyperpodrun.agent.security.intruders import IntruderWatch
from hyperpodrun.agent.observe.report import failure_summary
from hyperpodrun.agent.restart_policy import ProcessRestart
from hyperpodrun.agent.state import NodeState, Phase, StopPlan
from hyperpodrun.agent.coordination.store_schema import FailureInfo, NodeLoss
from hyperpodrun.agent.workers.supervisor import WorkerProcess, describe_exit
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import EXIT_AGENT_ERROR, EXIT_FENCED, EXIT_INTRUDER, EXIT_NODE_NOT_REPLACED

if TYPE_CHECKING:
    from hyperpodrun.agent.health.gpu_health import GpuHealth
    from hyperpodrun.agent.control.inject import Injector
    from hyperpodrun.agent.inprocess import InProcess

log = logging.getLogger("hyperpodrun.agent")

#: how long the store host keeps serving once every node is done, for the agents still reading that
LINGER_S = 10.0
#: the shortest exit barrier (the other nodes' last steps and teardown)
MIN_FINISH_S = 300.0


class Node:
    """This node's part of the job: the NodeState, the policies, and the effects they ask for."""

    def __init__(self, cfg: LaunchConfig, rdzv: RendezvousInfo, host: str, *, procs: ProcessTable,
                 launcher: Launcher, coord: Coordination, wstores: Optional[WorkerStoreHost], events: Events,
                 clock: Clock, exit_grace_s: float, on_success: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.host = host
        self.procs = procs
        self.launcher = launcher
        self.coord = coord
        self.wstores = wstores
        self.events = events
        self.clock = clock
        self.on_success = on_success        # every local worker exited 0 and the job is done
        self.state = NodeState()
        self.restarts = ProcessRestart(cfg, host, self.state, coord, events, clock, self, exit_grace_s)
        self.inproc: Optional[InProcess] = None
        self.gpu: Optional[GpuHealth] = None
        self.injector: Optional[Injector] = None
        self._warned_unwrapped = False
        self.intruders = IntruderWatch(events, self._store_ports, lambda: [p.pid for p in procs.workers.values()])
        self.restarts.roll_calls.known_uids = self.intruders.uids

    def attach(self, *, inproc: Optional["InProcess"] = None, gpu: Optional["GpuHealth"] = None,
               injector: Optional["Injector"] = None) -> None:
        """The optional parts: the in-process round, GPU health, fault injection (built on this node's ports)."""
        self.inproc = inproc or self.inproc
        self.gpu = gpu or self.gpu
        self.injector = injector or self.injector

    # ------------------------------------------------------------------ queries
    @property
    def done(self) -> bool:
        return self.state.phase is Phase.DONE

    def deadlines(self) -> list[float]:
        """The times the loop must wake up at, whatever else happens."""
        return [t for t in (self.state.stop_deadline, self.state.finish_deadline, self.restarts.causes.deadline)
                if t is not None]

    # ------------------------------------------------------------------ events from the loop
    def start(self) -> None:
        """Spawn the workers of the job's current generation (or wait for its store). A replacement of a lost
        node joins the generation the survivors moved to."""
        gen = self.coord.generation()
        loss, admitted = self.rdzv.replacing, self.rdzv.admitted
        if loss is not None:
            gen = max(gen, loss.generation)
            self.events.emit("replacing", f"this agent takes over node {loss.node} (declared lost by node "
                             f"{loss.by_node}: {loss.why}) and joins generation {gen}", node=loss.node, generation=gen)
        elif admitted is not None:
            gen = max(gen, admitted.generation)
            self.events.emit("admitted", f"this agent joins the job as node {self.rdzv.node_rank} in generation "
                             f"{gen}: ranks {self.rdzv.rank_offset}..{self.rdzv.rank_offset + self.cfg.nproc_per_node - 1}"
                             f" of {self.rdzv.world_size} (was {admitted.previous_world_size})",
                             node=self.rdzv.node_rank, generation=gen, world_size=self.rdzv.world_size)
        self.enter_generation(gen)

    def on_signal(self, signum: int) -> None:
        if self.done:
            return
        name = signal.Signals(signum).name
        self.events.emit("signal", f"received {name}: forwarding it to every worker, SIGKILL after "
                         f"{self.cfg.shutdown_timeout:g}s", signal=name)
        if self.state.exiting and self.state.phase is Phase.STOPPING:
            self.procs.signal_all(signum)   # a second signal: forward it too, keep the first deadline
            return
        self.state.note_signal(signum)
        self.begin_stop(StopPlan.exit(128 + signum), signum)

    def on_posted(self, event: Posted) -> None:
        kind, value = event
        if kind == "output_dropped":     # the tee could not write a log file or the console (once per kind)
            self.events.emit("output_dropped", value, level=logging.WARNING)
        elif kind == "generation":
            if self.inproc is not None and self.inproc.ever_hello and self.state.active:
                self.inproc.remote_generation(int(value))
            else:
                self.restarts.remote_generation(int(value))
        elif kind == "failed":
            self.restarts.remote_failure(value)
        elif kind == "forged":
            self.events.emit("forged_record", value, level=logging.WARNING)
        elif kind == "gpu" and self.gpu is not None:
            self.gpu.on_event(value)
        elif kind == "store_lost":
            self._on_store_lost(str(value))
        elif kind in ("coordinator_lost", "coordinator_back"):   # an outage is news, not a failure
            self.events.emit(kind, str(value), level=logging.WARNING if kind == "coordinator_lost" else logging.INFO)
        elif kind == "node_lost":
            self._on_node_lost(*value)
        elif kind == "node_joined":
            self._on_node_joined(*value)
        elif kind == "fenced":
            self._on_fenced(str(value))
        elif kind == "node_joining":
            if self.inproc is not None and self.cfg.elastic:
                self.inproc.want_join(*value)
        elif kind == "owner":   # elected through the coordination store (agent/coordination/owner.py)
            self.events.emit("owner", f"node {value} now watches every node's lease and declares the losses", node=value)
        elif kind == "spare":
            self.events.emit("spare_waiting", f"hot spare {value[0]} on {value[1]} is waiting (not in the world "
                             "size); it takes over the next node that is lost", incarnation=value[0], spare_host=value[1])

    # ------------------------------------------------------------------ membership (agent/coordination/membership.py)
    def _on_node_lost(self, node: int, incarnation: str, why: str) -> None:
        """Another node's lease stopped moving. In-process: the survivors' round goes on without it and waits
        for its replacement (--replace-timeout). Without an in-process round the job cannot take one: it ends."""
        if not self.state.active or self.rdzv.single_node:
            return
        inproc = self.inproc
        # in-process when a round can take it: wrapped workers said HELLO, or this agent replaces a lost node
        # and its ranks are on their way into the survivors' round
        can = inproc is not None and (inproc.ever_hello or inproc.round is not None)
        target = inproc.node_lost(node, incarnation, why) if inproc is not None and can else None
        if target is None:
            if inproc is not None and (inproc.completing or can):
                return   # the job is complete (a node that leaves now is not lost), or nothing to act on
            msg = (f"node {node} lost: {why} (--node-timeout {self.cfg.node_timeout:g}s); only "
                   "--inprocess-restart with wrapped workers goes on without it")
            self.events.emit("node_lost", msg, node=node, level=logging.ERROR)
            self.fail_job(FailureInfo(host=f"node {node}", node=node, cause="node lost", summary=msg,
                                      exit_code=EXIT_NODE_NOT_REPLACED), EXIT_NODE_NOT_REPLACED)
            return
        loss = self.coord.declare_lost(NodeLoss(node=node, incarnation=incarnation, generation=target,
                                                by_node=self.rdzv.node_rank, wall_time=self.clock.time(),
                                                why=why))
        when = time.strftime("%H:%M:%S", time.localtime(loss.wall_time))
        self.events.emit("node_lost", f"node {node} declared lost at {when} (by node {loss.by_node}: {loss.why}); "
                         f"the other nodes go on in generation {target} and wait up to --replace-timeout "
                         f"{self.cfg.replace_timeout:g}s for its replacement", node=node, generation=target,
                         declared_at=loss.wall_time, level=logging.WARNING)

    def _on_node_joined(self, node: int, incarnation: str) -> None:
        if self.inproc is not None and self.inproc.node_joined(node):
            self.events.emit("node_replaced", f"node {node} taken over by agent {incarnation}: waiting for its ranks", node=node)

    def _on_fenced(self, holder: str) -> None:
        """This agent was declared lost and another holds its node rank: stop everything, change nothing."""
        if self.state.exiting:   # DONE, or already stopping to exit (a stop for a restart is overridden)
            return
        self.events.emit("fenced", f"node {self.rdzv.node_rank} was declared lost (no lease renewal for "
                         f"--node-timeout {self.cfg.node_timeout:g}s: this agent was stopped or cut off) and "
                         f"another agent (incarnation {holder}) has taken its place; stopping this node's workers "
                         f"and exiting with code {EXIT_FENCED}", level=logging.ERROR, exit_code=EXIT_FENCED)
        self.begin_stop(StopPlan.exit(EXIT_FENCED), signal.SIGKILL)

    def leave(self, code: int, message: str) -> None:
        """This node is no longer part of the job (an elastic job went on without it): stop its workers, exit."""
        if self.state.exiting:
            return
        self.events.emit("left_job", message, level=logging.ERROR, exit_code=code)
        self.begin_stop(StopPlan.exit(code), signal.SIGKILL)

    def _on_store_lost(self, why: str) -> None:
        """The coordination store cannot be reached (its host is gone). Every local worker may have succeeded,
        but until every node has, the job's outcome is unknown: only then is it no failure."""
        phase = self.state.phase
        if phase is Phase.DONE or self.state.job_known_complete:
            return
        if phase is Phase.FINISHING:
            self.events.emit("store_lost", f"lost the coordination store ({why}) before every node finished: the "
                             "job's outcome is unknown; exiting with an error", level=logging.ERROR)
            self.begin_stop(StopPlan.exit(EXIT_AGENT_ERROR), self.cfg.shutdown_signal)
        elif phase is not Phase.STOPPING:
            self.events.emit("store_lost", f"lost the coordination store ({why}): its host (a node, a standalone "
                             "coordinator, or etcd) is gone or unreachable; stopping this node", level=logging.ERROR)
            self.begin_stop(StopPlan.exit(EXIT_AGENT_ERROR), self.cfg.shutdown_signal)

    def on_exit(self, proc: WorkerProcess) -> None:
        """A worker process ended (reaped by the supervisor)."""
        code = proc.returncode
        assert code is not None
        self.launcher.on_exit(proc)
        self.events.emit("worker_exit", f"rank {proc.rank} (pid {proc.pid}) exited: {describe_exit(code)}",
                         rank=proc.rank, pid=proc.pid, exit_code=code, generation=proc.generation,
                         level=logging.INFO if code == 0 or proc.signalled else logging.WARNING)
        inproc = self.inproc
        if inproc is not None and self.state.active:
            if inproc.ever_hello:
                if inproc.exit_ok(proc.local_rank, code):   # 0, or SIGABRT in teardown after DONE
                    inproc.excuse_teardown_abort(proc.local_rank, code)
                    if all(p.returncode is not None and inproc.exit_ok(p.local_rank, p.returncode)
                           for p in self.procs.workers.values()):
                        self.on_local_success()
                    return
                inproc.on_exit(proc.local_rank, code)
                return
            if code != 0 and not self._warned_unwrapped:
                self._warned_unwrapped = True
                self.events.emit("not_wrapped", "no worker has said HELLO (the script does not use HPWrapper?): "
                                 "falling back to a process-level restart", level=logging.WARNING)
        if self.state.phase is not Phase.RUNNING:
            return
        if code == 0:
            if all(p.returncode == 0 for p in self.procs.workers.values()):
                self.on_local_success()
            return
        if not self.restarts.causes.open:
            self.state.note_fault(self.clock.monotonic())
        self.restarts.worker_failed(proc, code, self.launcher.error_file(proc), self.launcher.stderr_log(proc))

    def on_message(self, ident: bytes, msg: P._Msg) -> None:
        """A control message from a worker or a tool."""
        if isinstance(msg, P.InjectRequest):
            if self.injector is not None:
                self.injector.handle(ident, msg)
            return
        if self.inproc is not None and not self.inproc.admits(ident, msg):
            return   # in a rank's name from another process (agent/control/voices.py): dropped, with an event
        if self.gpu is not None and isinstance(msg, (P.Hello, P.Heartbeat)) and (msg.device_uuid or msg.pci_bus_id):
            self.gpu.on_report(msg.rank, msg.pid, msg.device_uuid, msg.pci_bus_id)
        if self.inproc is not None:
            self.inproc.on_message(ident, msg)

    def _store_ports(self) -> list[int]:
        """The ports of the workers' stores this agent serves now (the current generation's and a round's)."""
        if self.wstores is None:
            return []
        gen = self.state.generation
        stores = [self.wstores.get(g) for g in (gen, gen + 1, self.state.restarting_to or gen)]
        return [int(getattr(s, "port")) for s in stores if s is not None and hasattr(s, "port")]

    def tick(self) -> None:
        """Time-driven progress: overdue causes, the in-process round, stopping, waiting for a store, finishing."""
        now = self.clock.monotonic()
        self.intruders.poll(now)   # foreign_connection events (agent/security/intruders.py)
        self.restarts.tick(now)
        if self.inproc is not None and self.state.active:
            self.inproc.tick(now)
        phase = self.state.phase
        if phase is Phase.STOPPING:
            self.advance_stop(now)
        elif phase is Phase.AWAITING_STORE:
            self.try_spawn_pending()
        elif phase is Phase.FINISHING:
            self.advance_finish(now)

    # ------------------------------------------------------------------ NodeOps / GpuOps
    @property
    def workers(self) -> Mapping[int, WorkerProcess]:
        return self.procs.workers

    def spawn(self, local_rank: int, generation: int, warm: bool = False) -> WorkerProcess:
        port = self.coord.worker_store_port(generation) or 0
        return self.launcher.spawn(local_rank, generation, port, warm=warm)

    def kill(self, local_rank: int) -> bool:
        proc = self.procs.workers.get(local_rank)
        if proc is None or not proc.alive:
            return False
        self.procs.kill(proc)
        return True

    def fail_job(self, info: FailureInfo, code: int) -> None:
        """End the job: record the cause, tell the other nodes, stop every worker."""
        self.restarts.fail(info, code)

    def outsider(self, info: FailureInfo) -> bool:
        """A rank's roll call failed in-process: True to retry the round (not counted), False when it recurred
        and the job is ending with its message (agent/security/intruders.py)."""
        if self.restarts.roll_calls.retry(info):
            return True
        self.restarts.fail(self.restarts.roll_calls.final(info), EXIT_INTRUDER)
        return False

    def escalate(self, target: int, root: FailureInfo) -> None:
        self.restarts.escalate(target, root)

    def rank_fault(self, local_rank: int, info: FailureInfo) -> None:
        """The rank is faulty (its GPU failed): in-process, only it is replaced; otherwise it is killed and
        every worker restarts (process level)."""
        if self.inproc is not None and self.inproc.ever_hello and self.state.active:
            self.inproc.fault(info, failed=(local_rank,))
            return
        self.restarts.rank_fault(local_rank, info)

    def last_step(self, local_rank: int) -> Optional[int]:
        return self.inproc.last_step(local_rank) if self.inproc is not None else None

    def open_worker_store(self, generation: int) -> None:
        """Start generation `generation`'s worker store here and publish it, when this agent is to host it."""
        if self.wstores is not None:
            stores.open_worker_store(generation, self.wstores, self.coord, self.rdzv)

    def start_warm_spawner(self) -> None:
        self.launcher.start_warm_spawner()

    def end_warm_spawner(self) -> None:
        self.launcher.end_warm_spawner()

    # ------------------------------------------------------------------ stopping and generations
    def begin_stop(self, plan: StopPlan, sig: int) -> None:
        """Signal every live worker's process group; SIGKILL after --shutdown-timeout; then `plan`."""
        now = self.clock.monotonic()
        self.state.begin_stop(plan, now, self.cfg.shutdown_timeout)
        live = self.procs.live()
        if live:
            self.procs.signal_all(sig, live)
        self.advance_stop(now)

    def advance_stop(self, now: float) -> None:
        live = self.procs.live()
        deadline = self.state.stop_deadline
        if live and deadline is not None and now >= deadline and not self.state.killed_all:
            self.events.emit("shutdown_timeout", f"{len(live)} worker(s) still alive after "
                             f"{self.cfg.shutdown_timeout:g}s: SIGKILL", level=logging.WARNING)
            self.procs.signal_all(signal.SIGKILL, live)
            self.state.mark_killed_all()
        if live:
            return
        stopped_in = now - self.state.stop_started
        plan = self.state.stop_complete()
        self.events.emit("workers_stopped", f"all workers stopped in {stopped_in:.3f}s", duration_s=stopped_in,
                         level=logging.INFO if plan.action == "restart" else logging.DEBUG)
        if plan.action == "restart":
            self.try_spawn_pending()
        else:
            self.finish(plan.value)

    def try_spawn_pending(self) -> None:
        gen = self.state.pending_generation
        assert gen is not None
        if self.enter_generation(gen):
            detected = self.state.take_detect_time()
            if detected is not None:
                took = self.clock.monotonic() - detected
                self.events.emit("restart_done", f"generation {gen}: all {self.cfg.nproc_per_node} workers "
                                 f"respawned {took:.3f}s after the fault", generation=gen, downtime_s=took)

    def enter_generation(self, gen: int) -> bool:
        """Spawn every local worker for generation `gen` once its store is known; False: not yet."""
        self.open_worker_store(gen)
        port = self.coord.worker_store_port(gen)
        if port is None:
            self.state.await_store(gen)
            return False
        joining = self.rdzv.replacing is not None or self.rdzv.admitted is not None
        self.launcher.spawn_all(gen, port, warm=joining)   # a spare's warm spawner has imported torch
        self.state.workers_started(gen)
        if self.inproc is not None and gen > 0 and self.inproc.ever_hello:
            self.inproc.reset_after_process_restart(gen)
        elif self.inproc is not None and gen > 0 and self.rdzv.replacing is not None:
            loss = self.rdzv.replacing
            self.inproc.reset_after_process_restart(gen, FailureInfo(
                host=f"node {loss.node}", node=loss.node, cause="node lost", remote=True, secondary=True,
                summary=f"node {loss.node} lost ({loss.why}); this agent replaces it"))
        elif self.inproc is not None and gen > 0 and self.rdzv.admitted is not None:
            self.inproc.reset_after_process_restart(gen, FailureInfo(
                host=self.host, node=self.rdzv.node_rank, cause="node joins", remote=True,
                summary=f"node {self.rdzv.node_rank} joins the job"))
        return True

    # ------------------------------------------------------------------ the end
    def on_local_success(self) -> None:
        self.events.emit("workers_done", f"all {self.cfg.nproc_per_node} local workers finished successfully",
                         generation=self.state.generation)
        if self.rdzv.single_node:
            self.finish(0)
            return
        self.coord.mark_done(self.state.generation)
        self.state.begin_finish(self.clock.monotonic(), max(MIN_FINISH_S, self.cfg.join_timeout))

    def advance_finish(self, now: float) -> None:
        """The exit barrier: every node must be done before any reports success; the store host then serves
        the store until every agent has read that (or LINGER_S)."""
        try:
            if not self.state.job_known_complete and self.coord.done_count(self.state.generation) >= self.rdzv.nnodes:
                self.state.all_nodes_done(now, LINGER_S)
                self.coord.mark_left()
            if self.state.job_known_complete:
                left_deadline = self.state.left_deadline
                assert left_deadline is not None
                if not self.rdzv.store_host or self.coord.left_count() >= self.rdzv.nnodes or now > left_deadline:
                    self.finish(0)
                return
        except Exception as exc:  # torch's store errors (DistError) have no narrower common class
            if self.state.job_known_complete:   # the host finished and went away: our part is done
                self.events.emit("store_gone", f"coordination store closed after completion ({exc})")
                self.finish(0)
            else:
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                self.events.emit("store_lost", f"lost the coordination store ({first}) before "
                                 "every node finished: the job's outcome is unknown; exiting with an error",
                                 level=logging.ERROR)
                self.finish(EXIT_AGENT_ERROR)
            return
        deadline = self.state.finish_deadline
        if deadline is not None and now > deadline:
            self.events.emit("exit_barrier_timeout", "other nodes did not finish in time", level=logging.ERROR)
            self.finish(EXIT_AGENT_ERROR)

    def finish(self, code: int) -> None:
        """The node's exit code is final: say how the job ended."""
        self.state.finish(code)
        if self.gpu is not None:
            self.gpu.report()
        first = self.state.first_failure
        if code != 0 and first is not None:
            self.events.emit("job_failed", failure_summary(first, with_traceback=True), level=logging.ERROR,
                             exit_code=code)
        elif code == 0:
            self.events.emit("job_done", "job finished successfully", exit_code=0)
            self.on_success()
        else:
            self.events.emit("agent_exit", f"agent exiting with code {code}", exit_code=code)
