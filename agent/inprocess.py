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
from hyperpodrun.agent.security.intruders import is_roll_call_failure
from hyperpodrun.agent.round import RoundBase, restart_grace  # noqa: F401 (restart_grace re-exported)
from hyperpodrun.agent.rankstate import ABORTED, RankState, progress_culprits
from hyperpodrun.agent.state import Phase
from hyperpodrun.agent.coordination.store_schema import FailureInfo, NodeJoin
from hyperpodrun.agent.workers.supervisor import WorkerProcess, describe_exit, shell_code

log = logging.getLogger("hyperpodrun.agent")


class InProcess(RoundBase):
    """The in-process restart state machine of one node: messages, exits and faults, periodic checks
    (the round itself: agent/round.py)."""

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
            self._first_step(st, msg, now)
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
            if msg.location:
                where += f" ({msg.location})"
            seen = self.fault_step
            lost = max(msg.lost_steps, seen - msg.step) if seen is not None else msg.lost_steps
            self.events.emit("state_restored", f"state restored at step {msg.step} {where} "
                             f"({lost} step(s) to train again)", generation=msg.generation,
                             step=msg.step, lost_steps=lost, source=msg.source, location=msg.location or None)
        elif isinstance(msg, P.Checkpointed):
            # the durable tier of a rank (hyperpodrun/state/durable/tier.py): a checkpoint completed, or one
            # skipped or failed while the training went on
            self.events.emit("durable_checkpoint", f"rank {st.rank}: durable checkpoint of step {msg.step} "
                             f"{msg.outcome}: {msg.detail}", rank=st.rank, step=msg.step, outcome=msg.outcome,
                             detail=msg.detail, level=logging.INFO if msg.outcome == "written" else logging.WARNING)
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
        # the step the job was at (this node's ranks'): node losses with training between them are not the same
        # step failing again (--max-step-failures); a node lost again and again at one step still is
        steps = [st.step for st in self.ranks.values() if st.step is not None]
        info = FailureInfo(host=f"node {node}", node=node, cause="node lost", generation=self.state.generation,
                           step=max(steps) if steps else None,
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

    def _first_step(self, st: RankState, msg: P.Heartbeat, now: float) -> None:
        """After GO, the first heartbeat of the new generation whose step differs from the rank's step at GO: the
        training loop has called `progress()` again - where the user sees the recovery end. Known to within
        --heartbeat-interval (heartbeats carry the step)."""
        watch = self.resume_watch
        if watch is None or msg.generation != watch[0] or msg.step is None or msg.state != "running":
            return
        gen, t_detect, at_go = watch
        if msg.step == at_go.get(st.local_rank):
            return
        self.resume_watch = None
        took = now - t_detect
        self.events.emit("first_step", f"generation {gen}: rank {st.rank} reported step {msg.step}, {took:.3f}s "
                         "after the fault", generation=gen, rank=st.rank, step=msg.step, downtime_s=took)

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
