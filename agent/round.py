"""The in-process round of one node: its ranks, and a round's mechanics - begun, advanced, escalated,
ended with GO (agent/inprocess.py drives it from the messages, exits and periodic checks).

Why apart: what starts and finishes a round is read on its own; inprocess.py decides when.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional

from hyperpodrun import protocol as P
from hyperpodrun.launch import settings
from hyperpodrun.agent.coordination.elastic import Elastic
from hyperpodrun.agent.security.intruders import is_roll_call_failure
from hyperpodrun.agent.ports import Clock, ControlSender, Coordination, Events, NodeOps, RendezvousInfo
from hyperpodrun.agent.rankstate import RankState, Round, StepGuard, first_to_kill, not_ready, stuck_ranks
from hyperpodrun.agent.state import NodeState
from hyperpodrun.agent.control.voices import Voices
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.agent.workers.supervisor import WorkerProcess
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


class RoundBase:
    """A node's ranks under --inprocess-restart and the mechanics of a restart round."""


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
        # after GO: (generation, when its fault was detected, each local rank's step at GO) until a rank reports a
        # step of its own in the new generation (the `first_step` record, agent/inprocess.py)
        self.resume_watch: Optional[tuple[int, float, dict[int, Optional[int]]]] = None

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

    def fault(self, info: FailureInfo, failed: tuple[int, ...]) -> None:
        """A fault on this node: what InProcess (agent/inprocess.py) does about it."""
        raise NotImplementedError

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
        addr = self.coord.worker_store_addr(r.target) or self.rdzv.master_addr   # the agent that hosts it
        for st in self.ranks.values():
            go = P.Go(generation=r.target, master_addr=addr, master_port=port)
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
        self.resume_watch = (r.target, r.t_detect, {lr: st.step for lr, st in self.ranks.items()})
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
