"""In-process restart on this node: detect, signal, abort, respawn only what died, barrier, GO.

Driven by the agent's loop thread (docs/ARCHITECTURE.md, "Restart protocol"). A *round* moves the job from
generation g to G: every live wrapped rank gets RESTART(G) and reports READY(G) once it has aborted,
finalized and passed its health check; ranks that died, hang, cannot be interrupted or cannot be reached
are killed and respawned with generation G; when every rank of every node is READY(G), GO(G) carries
generation G's store. A round not done within --inprocess-timeout escalates to a process-level restart.
It holds no handle on the agent: it moves the phase through NodeState (RUNNING <-> RESTARTING) and asks for
the rest through its ports (NodeOps, ControlSender, Coordination, Events, Clock).
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional

from hyperpodrun import protocol as P
from hyperpodrun.launch import settings
from hyperpodrun.agent.coordination.elastic import Elastic
from hyperpodrun.agent.security.intruders import is_roll_call_failure
from hyperpodrun.agent.ports import Clock, ControlSender, Coordination, Events, NodeOps, RendezvousInfo
from hyperpodrun.agent.rankstate import (ABORTED, RankState, Round, StepGuard, first_to_kill, not_ready,
                                         progress_culprits, stuck_ranks)
from hyperpodrun.agent.state import NodeState, Phase
from hyperpodrun.agent.control.voices import Voices
from hyperpodrun.agent.coordination.store_schema import FailureInfo, NodeJoin
from hyperpodrun.agent.workers.supervisor import WorkerProcess, describe_exit, shell_code
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import EXIT_FENCED, EXIT_NODE_NOT_REPLACED, EXIT_STEP_KEEPS_FAILING

log = logging.getLogger("hyperpodrun.agent")


def restart_grace(cfg: LaunchConfig) -> float:
    """Seconds a rank may take to leave the failed generation after RESTART before it is killed (a rank in a C
    call that never returns cannot be interrupted). HYPERPODRUN_RESTART_GRACE_S overrides the default: gloo
    can leave a send waiting until the group's timeout when a peer dies while it sends (the waiting buffer is
    never told), and only a grace above that timeout keeps such a rank's process."""
    given = settings.current().restart_grace_s
    if given is not None:
        return given
    return max(2 * cfg.heartbeat_interval, min(cfg.heartbeat_timeout, cfg.inprocess_timeout / 4))

class InProcess:
    """The in-process restart state machine of one node."""

    def __init__(self, cfg: LaunchConfig, rdzv: RendezvousInfo, host: str, state: NodeState, ops: NodeOps,
                 coord: Coordination, control: ControlSender, events: Events, clock: Clock) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.host = host
        self.state = state
        self.ops = ops
        self.coord = coord
        self.control = control
        self.events = events
        self.clock = clock
        self.ranks = {lr: RankState(lr, rdzv.rank_offset + lr) for lr in range(cfg.nproc_per_node)}
        self.fault_step: Optional[int] = None   # the latest step this node saw in progress when a round began
        self.round: Optional[Round] = None
        self.ever_hello = False
        self.voices = Voices(events)
        self.warm_started = False
        self.completing = False
        self.node_done_marked = -1
        self.steps = StepGuard(cfg.max_step_failures)
        self.excused: set[int] = set()   # local ranks whose SIGABRT after completion was not counted
        self.grace = restart_grace(cfg)
        self.elastic = Elastic(cfg, rdzv, coord, events, clock)

    # ------------------------------------------------------------------ helpers
    def by_rank(self, rank: int) -> Optional[RankState]:
        return self.ranks.get(rank - self.rdzv.rank_offset)

    def last_step(self, local_rank: int) -> Optional[int]:
        st = self.ranks.get(local_rank)
        return st.step if st is not None else None

    def on_spawn(self, local_rank: int, pid: int) -> None:
        self.ranks[local_rank].spawned(pid, self.clock.monotonic())

    def _send(self, st: RankState, msg: P._Msg) -> None:
        """Send `msg` to a rank; one that cannot be reached is handled as such (`_unreachable`)."""
        if not self.control.send(st.ident, msg):
            self._unreachable(st, msg)

    def _unreachable(self, st: RankState, msg: P._Msg) -> None:
        """A message was not delivered (the rank's connection is gone, or it does not read it): a fault of that
        rank, killed and respawned (in the round under way, or a new one); after DONE, killed: not a failure."""
        what = getattr(msg, "type", type(msg).__name__).upper()
        self.events.emit("rank_unreachable", f"rank {st.rank} (pid {st.pid}) cannot be reached on the control "
                         f"socket ({what} not delivered)", rank=st.rank, pid=st.pid, kind=what,
                         level=logging.WARNING)
        if isinstance(msg, P.Shutdown):
            st.release_lost = True
            self.kill_rank(st, "could not be released")
            return
        self.fault(st.failure(self.host, generation=self.state.generation, cause="control connection lost",
                              summary=f"rank {st.rank} (pid {st.pid}) cannot be reached on the control socket",
                              secondary=self.round is not None), failed=(st.local_rank,))

    # ------------------------------------------------------------------ messages
    def _sender(self, msg: P._Msg) -> Optional[RankState]:
        """The rank a worker message speaks for (None: no current worker)."""
        rank, pid = getattr(msg, "rank", None), getattr(msg, "pid", None)
        # by pid first: an elastic job renumbers the ranks, and a message sent before GO has the old rank
        st = next((s for s in self.ranks.values() if s.pid == pid), None) if pid is not None else None
        if st is None and pid is None and isinstance(rank, int):
            st = self.by_rank(rank)
        return st

    def admits(self, ident: bytes, msg: P._Msg) -> bool:
        """Whether a message in a rank's name comes from that rank's process (agent/control/voices.py); the node drops
        one that does not before anything reads it."""
        st = self._sender(msg)
        return st is None or self.voices.admit(st, ident, msg)

    def on_message(self, ident: bytes, msg: P._Msg) -> None:
        rank = getattr(msg, "rank", None)
        st = self._sender(msg)
        if st is None:
            log.debug("ignored %s from rank %s pid %s (not a current worker)", getattr(msg, "type", "?"), rank,
                      getattr(msg, "pid", None))
            return
        now = self.clock.monotonic()
        st.last_beat = now
        if isinstance(msg, P.Hello):
            st.hello, st.ident = True, ident
            self.ever_hello = True
            if not self.warm_started and all(s.hello for s in self.ranks.values()):
                self.warm_started = True   # every worker has started: the zygote's imports no longer compete
                self.ops.start_warm_spawner()
            r = self.round
            if r is not None and msg.generation < r.target:
                self._send(st, P.Restart(generation=r.target, reason=r.root.summary))
            elif r is None and msg.generation < self.state.generation and self.state.active:
                self._send(st, P.Restart(generation=self.state.generation, reason="catching up"))
        elif isinstance(msg, P.Heartbeat):
            st.heard(msg, now)
        elif isinstance(msg, P.Fault):
            st.step = msg.step if msg.step is not None else st.step
            st.fault_gen = max(st.fault_gen, msg.generation)
            self._on_fault(st, msg)
        elif isinstance(msg, P.Ready):
            st.ready_gen = max(st.ready_gen, msg.generation)
            st.state = "waiting"
            r = self.round
            if r is not None and msg.generation == r.target and st.local_rank not in r.ready_logged:
                r.ready_logged.add(st.local_rank)
                self.events.emit("rank_ready", f"rank {st.rank} ready for generation {r.target} (abort "
                                 f"{msg.abort_s:.3f}s, finalize {msg.finalize_s:.3f}s, health {msg.health_s:.3f}s)",
                                 rank=st.rank, generation=r.target, duration_s=now - r.t_detect,
                                 abort_s=msg.abort_s, finalize_s=msg.finalize_s, health_s=msg.health_s,
                                 level=logging.DEBUG)
        elif isinstance(msg, P.Restored):
            where = "at the new world size" if msg.source == "resized" else f"from {msg.source}"
            seen = self.fault_step
            lost = max(msg.lost_steps, seen - msg.step) if seen is not None else msg.lost_steps
            self.events.emit("state_restored", f"state restored at step {msg.step} {where} "
                             f"({lost} step(s) to train again)", generation=msg.generation,
                             step=msg.step, lost_steps=lost, source=msg.source)
        elif isinstance(msg, P.Done):
            st.done_gen = max(st.done_gen, msg.generation)
            st.state = "done"
            self.events.emit("rank_done", f"rank {st.rank} finished generation {msg.generation}", rank=st.rank,
                             generation=msg.generation, level=logging.DEBUG)

    def _on_fault(self, st: RankState, msg: P.Fault) -> None:
        info = st.failure(self.host, exc_type=msg.exc_type, summary=f"rank {st.rank}: {msg.exc_type}: {msg.summary}",
                          step=msg.step, secondary=msg.secondary, generation=msg.generation,
                          cause=f"{msg.exc_type}: {msg.summary}")
        if not msg.retryable:
            self.events.emit("fault_fatal", f"rank {st.rank} raised {msg.exc_type}: {msg.summary} - not retried; "
                             f"ending the job (exit code {msg.exit_code})", rank=st.rank, level=logging.ERROR)
            self.ops.fail_job(info.with_(exit_code=msg.exit_code), msg.exit_code)
            return
        if msg.generation < self.state.generation and self.round is None:
            return  # a late report from an older generation
        if is_roll_call_failure(info) and self.round is None and not self.ops.outsider(info):
            return   # a process outside the job took a rank's place again: the job ends (agent/security/intruders.py)
        self.fault(info, failed=())

    # ------------------------------------------------------------------ faults
    def exit_ok(self, local_rank: int, code: int) -> bool:
        """Whether a worker's exit counts as success: only once the job completed (RankState.exit_is_success)."""
        return self.completing and self.ranks[local_rank].exit_is_success(code, self.state.generation)

    def excuse_teardown_abort(self, local_rank: int, code: int) -> None:
        """Say once per rank, as a warning, that an abort after completion was not counted as a failure."""
        st = self.ranks[local_rank]
        if code in ABORTED and local_rank not in self.excused:
            self.excused.add(local_rank)
            self.events.emit("teardown_abort", f"rank {st.rank} (pid {st.pid}) aborted (SIGABRT) in interpreter "
                             "teardown after it reported completion; not counted as a failure (torch's gloo "
                             "teardown race: release DDP, works and tensors before destroy_process_group())",
                             rank=st.rank, pid=st.pid, level=logging.WARNING)

    def on_exit(self, local_rank: int, code: int) -> None:
        """A worker process ended (already reaped)."""
        st = self.ranks[local_rank]
        st.hello = False
        st.ident = None
        if self.exit_ok(local_rank, code):
            self.excuse_teardown_abort(local_rank, code)
            return
        cause = describe_exit(code)
        summary = (f"rank {st.rank} (pid {st.pid}) died: {cause}" if code != 0 else
                   f"rank {st.rank} exited before the job completed")
        self.fault(st.failure(self.host, cause=cause, summary=summary, secondary=st.killed, exit_code=shell_code(code),
                              generation=self.state.generation), failed=(local_rank,))

    def fault(self, info: FailureInfo, failed: tuple[int, ...]) -> None:
        """A fault on this node: start a round or fold it into the current one; respawn the failed ranks.
        Outside RUNNING/RESTARTING (the node is stopping, finishing or done) it is no matter for a round."""
        if not self.state.active:
            log.debug("fault while %s, not acted on in-process: %s", self.state.phase.value, info.summary)
            return
        r = self.round
        if r is None:
            grant = self.coord.request_restart(self.state.generation, info, count_budget=False)
            r = self._begin_round(grant.generation, info, self.clock.monotonic())
        else:
            r.folded += 1
            if r.root.secondary and not info.secondary:
                r.root = info  # a real cause arrived after a secondary symptom: it is the root cause
                self._publish_root(r)
            self.events.emit("fault_folded", f"folded into generation {r.target}: {info.summary}",
                             generation=r.target, rank=info.rank, level=logging.INFO)
        if failed and r.node_ready_marked and not self.rdzv.single_node:
            # this node counted itself ready, then lost a rank: take the mark back so GO waits for it
            self.coord.mark_ready(r.target, on=False)
            r.node_ready_marked = False
        for lr in failed:
            self._respawn(lr)

    def node_lost(self, node: int, incarnation: str, why: str) -> Optional[int]:
        """Node `node` is lost (its lease stopped moving): a fault of the job whose root cause it is; the round
        waits up to --replace-timeout for a replacement. Returns the round's target (None: not acted on)."""
        if not self.state.active or self.completing:
            return None
        info = FailureInfo(host=f"node {node}", node=node, cause="node lost", generation=self.state.generation,
                           summary=f"node {node} lost: {why} (--node-timeout {self.cfg.node_timeout:g}s)")
        self.fault(info, failed=())
        r = self.round
        if r is None:
            return None
        r.awaiting[node] = incarnation
        r.deadline = self.clock.monotonic() + self.cfg.replace_timeout   # the survivors wait this long for it
        return r.target

    def node_joined(self, node: int) -> bool:
        """Another agent took over node `node`'s rank: the round now waits for its ranks as for respawned ones
        (a fresh --inprocess-timeout from now: they start, import and restore)."""
        r = self.round
        if r is None or r.awaiting.pop(node, None) is None:
            return False
        r.deadline = max(r.deadline, self.clock.monotonic() + self.cfg.inprocess_timeout)
        return True

    def want_join(self, node: int, join: NodeJoin) -> None:
        """An elastic newcomer asks to be admitted: at the next generation, once no round is under way."""
        self.elastic.want_join(node, join)

    def remote_generation(self, gen: int) -> None:
        """Another node moved the generation."""
        r = self.round
        if (r is not None and gen <= r.target) or (r is None and gen <= self.state.generation):
            return
        self._begin_round(gen, FailureInfo(host="?", summary=f"another node started generation {gen}",
                                           secondary=True, remote=True), self.clock.monotonic())

    def _begin_round(self, target: int, info: FailureInfo, now: float) -> Round:
        self.completing = False
        self.round = r = Round(target=target, t_detect=now, root=info, deadline=now + self.cfg.inprocess_timeout,
                               grace_at=now + self.grace)
        self.state.begin_round()
        # the step the fault interrupted, as far as this node saw it (heartbeats, the fault's own report): a
        # replacement process cannot say where its predecessor was, so the lost steps are checked against it
        reached = [st.step for st in self.ranks.values() if st.step is not None]
        if info.step is not None:
            reached.append(info.step)
        self.fault_step = max(reached) if reached else None
        if info.cause == "node joins":   # an elastic job grows: a round, but no fault
            self.events.emit("grow", f"elastic: {info.summary}", generation=self.state.generation, node=info.node)
        else:
            self.events.emit("fault", f"fault detected: {info.summary}", generation=self.state.generation,
                             rank=info.rank, step=info.step, root_cause=info.summary, level=logging.WARNING)
        self.ops.open_worker_store(target)
        restart = P.Restart(generation=target, reason=info.summary)
        sent, unreachable = 0, []
        for st in self.ranks.values():
            if st.hello and st.pid is not None:
                if self.control.send(st.ident, restart):
                    sent += 1
                else:
                    unreachable.append(st)
        r.signalled = True
        self._publish_root(r)
        self.events.emit("restart_signal", f"in-process restart: generation {self.state.generation} -> {target}, "
                         f"RESTART sent to {sent} rank(s)", generation=target, duration_s=self.clock.monotonic() - now)
        for st in unreachable:
            self._unreachable(st, restart)
        return r

    def _publish_root(self, r: Round) -> None:
        """Several nodes: the first node that knows a real (not secondary) cause of round r names it job-wide,
        so a node that only saw "connection reset by peer" reports the same root cause at GO."""
        if not self.rdzv.single_node and not r.root.secondary:
            self.coord.claim_root_cause(r.target, r.root)

    def _job_root(self, r: Round) -> FailureInfo:
        """The root cause of round r as reported at GO: ours, or another node's when we only saw a symptom."""
        if self.rdzv.single_node or not r.root.secondary:
            return r.root
        try:
            root = self.coord.root_cause(r.target)
            if root is not None:
                return root.with_(summary=f"{root.summary} (node {root.node})")
        except Exception as exc:  # the store is only asked for a better message: never fatal here
            log.debug("root cause of generation %d not readable: %s", r.target, exc)
        return r.root

    def _respawn(self, local_rank: int) -> None:
        st = self.ranks[local_rank]
        if self.ops.kill(local_rank):
            st.killed = True
            return  # respawned when its exit is observed
        r = self.round
        if r is None:   # the round ended meanwhile (escalated, or the job is ending): nothing to rejoin
            return
        t0 = self.clock.monotonic()
        new = self.ops.spawn(local_rank, r.target, warm=True)
        warm = new.source != "cold"
        now = self.clock.monotonic()
        self.events.emit("respawn", f"rank {st.rank} respawned as pid {new.pid} for generation {r.target}"
                         f"{' (forked warm)' if warm else ''}", rank=st.rank, pid=new.pid, generation=r.target,
                         duration_s=now - r.t_detect, spawn_s=now - t0, warm=warm)

    def kill_rank(self, st: RankState, why: str) -> None:
        proc = self.ops.workers.get(st.local_rank)
        if proc is None or not proc.alive:
            return
        where = f" (main thread in {st.stack})" if st.stack else ""
        self.events.emit("kill", f"rank {st.rank} (pid {proc.pid}) {why}: killing it{where}", rank=st.rank,
                         pid=proc.pid, level=logging.WARNING)
        st.killed = True
        self.ops.kill(st.local_rank)

    # ------------------------------------------------------------------ periodic checks
    def tick(self, now: float) -> None:
        live = {lr: p for lr, p in self.ops.workers.items() if p.alive}
        # heartbeat loss: a rank that said HELLO and went silent (dead or holding the GIL)
        for lr, st in self.ranks.items():
            if self.completing:
                break   # released workers close their connection while they exit
            if lr in live and st.hello and not st.killed and now - st.last_beat > self.cfg.heartbeat_timeout:
                info = st.failure(self.host, summary=f"rank {st.rank} (pid {st.pid}) sent no heartbeat for "
                                  f"{now - st.last_beat:.1f}s (hung holding the GIL, or stopped)",
                                  cause="heartbeat lost")
                self.kill_rank(st, "lost its heartbeat")
                self.fault(info, failed=())
        if self.round is None and not self.completing:
            self._check_progress(now, live)
            self._check_done()
        if self.round is None and not self.completing and self.ever_hello and self.state.phase is Phase.RUNNING:
            joins = self.elastic.admission(self.state.generation)
            if joins is not None:
                self.fault(joins, failed=())
        if self.round is not None:
            self._advance_round(now, live)

    def _check_progress(self, now: float, live: Mapping[int, WorkerProcess]) -> None:
        pt = self.cfg.progress_timeout
        if pt is None or self.state.phase is not Phase.RUNNING:
            return
        culprits, seqs, top = progress_culprits(self.ranks, live, now, pt)
        if not culprits:
            return
        names = ", ".join(str(st.rank) for st in culprits)
        self.fault(culprits[0].failure(self.host, cause="no progress", summary=f"no progress for {pt:g}s; culprit "
                              f"rank(s) {names} (collective sequence {seqs} vs max {top})"), failed=())
        if self.round is not None:
            self.round.culprits = {st.local_rank for st in culprits}

    def _check_done(self) -> None:
        g = self.state.generation
        if not self.ranks or not all(st.done_gen >= g for st in self.ranks.values()):
            return
        if not self.rdzv.single_node:
            if self.node_done_marked != g:
                self.coord.mark_inprocess_done(g)
                self.node_done_marked = g
            if self.coord.inprocess_done_count(g) < self.rdzv.nnodes:
                return
        self.completing = True
        self.events.emit("complete", f"every rank finished generation {g}: releasing the workers", generation=g)
        for st in self.ranks.values():
            self._send(st, P.Shutdown(reason="complete"))
        self.ops.end_warm_spawner()   # nothing left to respawn: it must not compete with the workers' exit

    def _advance_round(self, now: float, live: Mapping[int, WorkerProcess]) -> None:
        r = self.round
        assert r is not None
        gen = self.state.generation
        self.elastic.follow(r)
        if self.elastic.excluded(r):
            self.round = None
            self.ops.leave(EXIT_FENCED, f"the job went on without node {self.rdzv.node_rank} from generation "
                           f"{r.target} (it was not replaced in time, and the elastic job shrank); this agent "
                           "leaves - start it again to join the job as a new node")
            return
        # ranks that have not left the failed generation after RESTART + grace cannot be interrupted; but
        # while a rank that reported the FAULT is still tearing its groups down, the peers blocked on it
        # are waiting for that, not stuck (its own abort_timeout and --inprocess-timeout bound it)
        if now >= r.grace_at and r.kill_stage < 2 and any(
                lr in live and st.fault_gen >= gen and st.ready_gen < r.target for lr, st in self.ranks.items()):
            r.grace_at = now + self.grace
        if now >= r.grace_at and r.kill_stage < 2:
            stuck = stuck_ranks(self.ranks, live, r.target, gen)
            if r.kill_stage == 0:
                for st in first_to_kill(stuck, r.culprits):
                    self.kill_rank(st, f"did not respond to RESTART within {self.grace:g}s (stuck in a C call?)")
                r.kill_stage, r.grace_at = 1, now + self.grace
            else:
                for st in stuck:
                    self.kill_rank(st, f"did not respond to RESTART within {2 * self.grace:g}s")
                r.kill_stage = 2
        # barrier
        all_ready = len(live) == len(self.ranks) and all(
            st.ready_gen >= r.target and st.hello for st in self.ranks.values())
        if all_ready and not self.rdzv.single_node:
            if not r.node_ready_marked:
                self.coord.mark_ready(r.target)
                r.node_ready_marked = True
            nodes = self.elastic.nodes(r)
            all_ready = self.coord.ready_count(r.target, nodes) >= len(nodes)
        if all_ready:
            port = self.coord.worker_store_port(r.target)
            if port is not None:
                self._go(r, port, now)
                return
        if now >= r.deadline:
            if r.awaiting:
                if not self.elastic.shrink(r, now):
                    self._not_replaced(r)
            else:
                self._escalate(r, now)

    def _not_replaced(self, r: Round) -> None:
        """A lost node was not replaced within --replace-timeout: the job cannot go on at its size."""
        nodes = ", ".join(str(n) for n in sorted(r.awaiting))
        fewer = (f" and fewer than --nnodes {self.cfg.min_nnodes}:{self.cfg.nnodes} minimum would remain"
                 if self.cfg.elastic else "")
        msg = (f"node(s) {nodes} lost and not replaced within --replace-timeout {self.cfg.replace_timeout:g}s"
               f"{fewer}: start the lost node's command again (or a hot spare with the c10d backend) sooner, or "
               "raise --replace-timeout")
        self.events.emit("not_replaced", msg, generation=r.target, level=logging.ERROR)
        self.round = None
        self.ops.fail_job(r.root.with_(summary=f"{msg} (the restart began with: {r.root.summary})", cause=msg,
                                       exit_code=EXIT_NODE_NOT_REPLACED), EXIT_NODE_NOT_REPLACED)

    def _escalate(self, r: Round, now: float) -> None:
        missing = not_ready(self.ranks, self.ops.workers, r.target, now)
        what = "; ".join(m for _, m in missing) or "every rank of this node is ready; other nodes are not"
        self.events.emit("inprocess_timeout", f"in-process restart to generation {r.target} not done within "
                         f"--inprocess-timeout {self.cfg.inprocess_timeout:g}s: {what}; escalating to a "
                         "process-level restart", generation=r.target, not_ready=[m for _, m in missing],
                         level=logging.ERROR)
        self.round = None
        root = r.root.with_(summary=f"{what} (the restart began with: {r.root.summary})")
        if missing:   # the report names the first rank that never got READY, not the fault's rank
            st = missing[0][0]
            root = root.with_(rank=st.rank, local_rank=st.local_rank, pid=st.pid)
        self.ops.escalate(r.target, root)

    def _go(self, r: Round, port: int, now: float) -> None:
        if not r.root.remote and not is_roll_call_failure(r.root) and self._step_guard(r.root):
            self.round = None
            return
        self.events.emit("barrier_complete", f"every rank ready for generation {r.target}", generation=r.target,
                         duration_s=now - r.t_detect)
        lay = self.elastic.adopt(r)
        unreachable = []
        for st in self.ranks.values():
            go = P.Go(generation=r.target, master_addr=self.rdzv.master_addr, master_port=port)
            if lay is not None:   # an elastic job shrank or grew: every rank's new place
                st.rank = self.rdzv.rank_offset + st.local_rank
                go = go.model_copy(update=dict(rank=st.rank, world_size=self.rdzv.world_size,
                                               group_rank=self.rdzv.group_rank, group_world_size=self.rdzv.nnodes,
                                               previous_world_size=lay.previous_world_size))
            if not self.control.send(st.ident, go):
                unreachable.append(st)
            st.progress_t = now
        self.state.round_done(r.target)
        self.round = None
        downtime = self.clock.monotonic() - r.t_detect
        root = self._job_root(r)
        self.events.emit("go", f"GO generation {r.target}: recovered in {downtime:.3f}s (root cause: "
                         f"{root.summary}{f'; {r.folded} secondary fault(s) folded' if r.folded else ''})",
                         generation=r.target, downtime_s=downtime, root_cause=root.summary)
        for st in unreachable:   # it would wait for GO forever: a new round replaces it
            self._unreachable(st, go)

    def _step_guard(self, info: FailureInfo) -> bool:
        """Called once per round with its root cause: True when the same step keeps failing (job ended)."""
        msg = self.steps.count(info)
        if msg is None:
            return False
        self.events.emit("step_keeps_failing", msg, level=logging.ERROR, step=info.step)
        self.ops.fail_job(info.with_(summary=msg, cause=msg), EXIT_STEP_KEEPS_FAILING)
        return True

    def reset_after_process_restart(self, gen: int, root: Optional[FailureInfo] = None) -> None:
        """All local workers were (re)spawned for `gen` (escalation, or this agent replaces a lost node): wait
        for their READY(gen)."""
        now = self.clock.monotonic()
        self.round = Round(target=gen, t_detect=now, root=root or FailureInfo(summary="process-level restart"),
                           deadline=now + max(self.cfg.inprocess_timeout, self.cfg.join_timeout),
                           grace_at=now + 10 ** 9)
        self.state.begin_round()
