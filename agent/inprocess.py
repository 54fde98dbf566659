"""In-process restart on this node (DESIGN §4): detect, signal, abort, respawn only what died, barrier, GO.

Owned and driven by the agent's loop thread. A *round* moves the job from generation g to G: every live
wrapped rank gets RESTART(G) and reports READY(G) once it has aborted, finalized and passed its health
check; ranks that died, hang holding the GIL, or cannot be interrupted are killed and respawned with
generation G; when every rank of every node is READY(G), GO(G) carries generation G's store. A round not
done within --inprocess-timeout escalates to a process-level restart of this node.
"""
from __future__ import annotations

import json
import logging
import signal
import time
from typing import TYPE_CHECKING, Any, Optional

from hyperpodrun import protocol as P
from hyperpodrun.agent.rankstate import RankState, Round, not_ready
from hyperpodrun.errors import EXIT_STEP_KEEPS_FAILING

if TYPE_CHECKING:
    from hyperpodrun.agent.agent import Agent

log = logging.getLogger("hyperpodrun.agent")


class InProcess:
    """The in-process restart state machine of one node."""

    def __init__(self, agent: "Agent") -> None:
        self.a = agent
        self.cfg = agent.cfg
        n = self.cfg.nproc_per_node
        off = agent.rdzv.rank_offset  # type: ignore[union-attr]
        self.ranks = {lr: RankState(lr, off + lr) for lr in range(n)}
        self.round: Optional[Round] = None
        self.ever_hello = False
        self.warm_started = False
        self.completing = False
        self.node_done_marked = -1
        self.last_fault_step: Optional[tuple] = None
        self.step_failures = 0
        self.excused: set[int] = set()   # local ranks whose SIGABRT after completion was not counted
        self.grace = max(2 * self.cfg.heartbeat_interval, min(self.cfg.heartbeat_timeout, self.cfg.inprocess_timeout / 4))

    # ------------------------------------------------------------------ helpers
    @property
    def any_hello(self) -> bool:
        return any(r.hello for r in self.ranks.values())

    def by_rank(self, rank: int) -> Optional[RankState]:
        lr = rank - self.a.rdzv.rank_offset  # type: ignore[union-attr]
        return self.ranks.get(lr)

    def on_spawn(self, local_rank: int, pid: int) -> None:
        st = self.ranks[local_rank]
        st.pid, st.ident, st.hello, st.state, st.killed = pid, None, False, "starting", False
        st.step, st.stack = None, None
        st.last_beat = time.monotonic()
        st.progress_t = time.monotonic()

    def _send(self, st: RankState, msg: P._Msg) -> None:
        self.a.control.send(st.ident, msg)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ messages
    def on_message(self, ident: bytes, msg: P._Msg) -> None:
        rank = getattr(msg, "rank", None)
        st = self.by_rank(rank) if rank is not None else None
        if st is None or (getattr(msg, "pid", None) not in (None, st.pid)):
            log.debug("ignored %s from rank %s pid %s (not a current worker)", msg.type, rank,
                      getattr(msg, "pid", None))
            return
        now = time.monotonic()
        st.last_beat = now
        if isinstance(msg, P.Hello):
            st.hello, st.ident = True, ident
            self.ever_hello = True
            if not self.warm_started and all(s.hello for s in self.ranks.values()):
                self.warm_started = True   # every worker has started: the zygote's imports no longer compete
                self.a.start_warm_spawner()
            r = self.round
            if r is not None and msg.generation < r.target:
                self._send(st, P.Restart(generation=r.target, reason=r.root.get("summary", "")))
            elif r is None and msg.generation < self.a.generation:
                self._send(st, P.Restart(generation=self.a.generation, reason="catching up"))
        elif isinstance(msg, P.Heartbeat):
            key = (msg.step, msg.seq)
            if key != (st.step, st.seq) or msg.state != st.state or msg.generation != st.beat_gen:
                st.progress_t = now
            st.step, st.seq, st.state, st.beat_gen = msg.step, msg.seq, msg.state, msg.generation
            st.stack = msg.stack
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
                self.a.events.emit("rank_ready", f"rank {st.rank} ready for generation {r.target} (abort "
                                   f"{msg.abort_s:.3f}s, finalize {msg.finalize_s:.3f}s, health {msg.health_s:.3f}s)",
                                   rank=st.rank, generation=r.target, duration_s=now - r.t_detect,
                                   abort_s=msg.abort_s, finalize_s=msg.finalize_s, health_s=msg.health_s,
                                   level=logging.DEBUG)
        elif isinstance(msg, P.Restored):
            self.a.events.emit("state_restored", f"state restored at step {msg.step} from {msg.source} "
                               f"({msg.lost_steps} step(s) lost to the fault)", generation=msg.generation,
                               step=msg.step, lost_steps=msg.lost_steps, source=msg.source)
        elif isinstance(msg, P.Done):
            st.done_gen = max(st.done_gen, msg.generation)
            st.state = "done"
            self.a.events.emit("rank_done", f"rank {st.rank} finished generation {msg.generation}", rank=st.rank,
                               generation=msg.generation, level=logging.DEBUG)

    def _on_fault(self, st: RankState, msg: P.Fault) -> None:
        info = {"host": self.a.host, "rank": st.rank, "local_rank": st.local_rank, "pid": st.pid,
                "exc_type": msg.exc_type, "summary": f"rank {st.rank}: {msg.exc_type}: {msg.summary}",
                "step": msg.step, "secondary": msg.secondary, "generation": msg.generation,
                "exit_code": 1, "cause": f"{msg.exc_type}: {msg.summary}"}
        if not msg.retryable:
            info["exit_code"] = msg.exit_code
            self.a.events.emit("fault_fatal", f"rank {st.rank} raised {msg.exc_type}: {msg.summary} - not retried; "
                               f"ending the job (exit code {msg.exit_code})", rank=st.rank, level=logging.ERROR)
            self.a.fail_job(info, msg.exit_code)
            return
        if msg.generation < self.a.generation and self.round is None:
            return  # a late report from an older generation
        self.fault(info, failed=())

    # ------------------------------------------------------------------ faults
    def exit_ok(self, local_rank: int, code: int) -> bool:
        """Whether a worker's exit, once the job completed, counts as success: exit code 0, or SIGABRT of a
        rank that had reported completion - torch's gloo can abort the process in interpreter teardown
        ("terminate called without an active exception", a worker thread dropping a tensor while Python
        finalizes); the training result is in by then, so it does not fail the job."""
        if not self.completing:
            return False
        if code == 0:
            return True
        st = self.ranks[local_rank]
        return code in (-signal.SIGABRT, 128 + signal.SIGABRT) and st.done_gen >= self.a.generation

    def excuse_teardown_abort(self, local_rank: int, code: int) -> None:
        """Say once per rank, as a warning, that an abort after completion was not counted as a failure."""
        st = self.ranks[local_rank]
        if code != 0 and local_rank not in self.excused:
            self.excused.add(local_rank)
            self.a.events.emit("teardown_abort", f"rank {st.rank} (pid {st.pid}) aborted (SIGABRT) in interpreter "
                               "teardown after it reported completion; not counted as a failure (torch's gloo "
                               "teardown race: release DDP, works and tensors before destroy_process_group())",
                               rank=st.rank, pid=st.pid, level=logging.WARNING)

    def on_exit(self, local_rank: int, code: int, signalled: bool) -> None:
        """A worker process ended (already reaped)."""
        st = self.ranks[local_rank]
        st.hello = False
        st.ident = None
        if self.exit_ok(local_rank, code):
            self.excuse_teardown_abort(local_rank, code)
            return
        from hyperpodrun.agent.supervisor import describe_exit, shell_code
        cause = describe_exit(code)
        info = {"host": self.a.host, "rank": st.rank, "local_rank": local_rank, "pid": st.pid, "cause": cause,
                "summary": f"rank {st.rank} (pid {st.pid}) died: {cause}" if not (code == 0) else
                f"rank {st.rank} exited before the job completed", "step": st.step,
                "secondary": st.killed, "exit_code": shell_code(code), "generation": self.a.generation}
        self.fault(info, failed=(local_rank,))

    def fault(self, info: dict[str, Any], failed: tuple[int, ...]) -> None:
        """A fault on this node: start a round or fold it into the current one; respawn the failed ranks."""
        now = time.monotonic()
        r = self.round
        if r is None:
            target, _, _ = self.a.coord.request_restart(self.a.generation, info, count_budget=False)  # type: ignore
            self._begin_round(target, info, now)
            r = self.round
        else:
            r.folded += 1
            if r.root.get("secondary") and not info.get("secondary"):
                r.root = info  # a real cause arrived after a secondary symptom: it is the root cause
                self._publish_root(r)
            self.a.events.emit("fault_folded", f"folded into generation {r.target}: {info['summary']}",
                               generation=r.target, rank=info.get("rank"), level=logging.INFO)
        if failed and r is not None and r.node_ready_marked and not self.a.rdzv.single_node:  # type: ignore
            # this node counted itself ready, then lost a rank: take the mark back so GO waits for it
            self.a.coord.mark_node(f"ipready/{r.target}", on=False)  # type: ignore[union-attr]
            r.node_ready_marked = False
        for lr in failed:
            self._respawn(lr)

    def _step_guard(self, info: dict[str, Any]) -> bool:
        """Called once per round with its root cause: True when the same step keeps failing (job ended)."""
        key = (info.get("step"),)
        if key == self.last_fault_step:
            self.step_failures += 1
        else:
            self.last_fault_step, self.step_failures = key, 1
        if self.step_failures >= self.cfg.max_step_failures:
            step = info.get("step")
            where = f"step {step}" if step is not None else "the same point (no progress reported in between)"
            msg = (f"{where} failed {self.step_failures} times in a row (--max-step-failures "
                   f"{self.cfg.max_step_failures}); last: {info.get('summary')}. Fix the cause or raise "
                   "--max-step-failures")
            self.a.events.emit("step_keeps_failing", msg, level=logging.ERROR, step=step)
            info = dict(info, summary=msg, cause=msg)
            self.a.fail_job(info, EXIT_STEP_KEEPS_FAILING)
            return True
        return False

    def remote_generation(self, gen: int) -> None:
        """Another node moved the generation."""
        r = self.round
        if (r is not None and gen <= r.target) or (r is None and gen <= self.a.generation):
            return
        info = {"host": "?", "summary": f"another node started generation {gen}", "secondary": True, "remote": True}
        self._begin_round(gen, info, time.monotonic())

    def _begin_round(self, target: int, info: dict[str, Any], now: float) -> None:
        a = self.a
        self.completing = False
        self.round = r = Round(target=target, t_detect=now, root=info, deadline=now + self.cfg.inprocess_timeout,
                               grace_at=now + self.grace)
        a.phase = "restarting"
        a.events.emit("fault", f"fault detected: {info.get('summary')}", generation=a.generation,
                      rank=info.get("rank"), step=info.get("step"), root_cause=info.get("summary"),
                      level=logging.WARNING)
        a.open_worker_store(target)
        sent = 0
        for st in self.ranks.values():
            if st.hello and st.pid is not None:
                self._send(st, P.Restart(generation=target, reason=info.get("summary", "")))
                sent += 1
        r.signalled = True
        self._publish_root(r)
        a.events.emit("restart_signal", f"in-process restart: generation {a.generation} -> {target}, RESTART sent "
                      f"to {sent} rank(s)", generation=target, duration_s=time.monotonic() - now)

    def _publish_root(self, r: Round) -> None:
        """Several nodes: the first node that knows a real (not secondary) cause of round r names it job-wide,
        so a node that only saw "connection reset by peer" reports the same root cause at GO."""
        if self.a.rdzv.single_node or r.root.get("secondary"):  # type: ignore[union-attr]
            return
        self.a.coord.records.claim(f"rootcause/{r.target}",  # type: ignore[union-attr]
                                   json.dumps(dict(r.root, node=self.a.rdzv.node_rank), default=str))

    def _job_root(self, r: Round) -> dict[str, Any]:
        """The root cause of round r as reported at GO: ours, or another node's when we only saw a symptom."""
        if self.a.rdzv.single_node or not r.root.get("secondary"):  # type: ignore[union-attr]
            return r.root
        try:
            value = self.a.coord.records.read(f"rootcause/{r.target}")  # type: ignore[union-attr]
            if value is not None:
                root = json.loads(value)
                return dict(root, summary=f"{root.get('summary')} (node {root.get('node')})")
        except Exception as exc:  # the store is only asked for a better message: never fatal here
            log.debug("root cause of generation %d not readable: %s", r.target, exc)
        return r.root

    def _respawn(self, local_rank: int) -> None:
        st = self.ranks[local_rank]
        proc = self.a.sup.workers.get(local_rank)  # type: ignore[union-attr]
        if proc is not None and proc.alive:
            st.killed = True
            self.a.sup.kill(proc)  # type: ignore[union-attr]
            return  # respawned when its exit is observed
        r = self.round
        assert r is not None
        t0 = time.monotonic()
        new = self.a.spawn_worker(local_rank, r.target, warm=True)
        warm = type(new.popen).__name__ == "AdoptedProcess"
        self.a.events.emit("respawn", f"rank {st.rank} respawned as pid {new.pid} for generation {r.target}"
                           f"{' (forked warm)' if warm else ''}", rank=st.rank, pid=new.pid, generation=r.target,
                           duration_s=time.monotonic() - r.t_detect, spawn_s=time.monotonic() - t0, warm=warm)

    def kill_rank(self, st: RankState, why: str) -> None:
        proc = self.a.sup.workers.get(st.local_rank)  # type: ignore[union-attr]
        if proc is None or not proc.alive:
            return
        self.a.events.emit("kill", f"rank {st.rank} (pid {proc.pid}) {why}: killing it", rank=st.rank,
                           pid=proc.pid, level=logging.WARNING)
        st.killed = True
        self.a.sup.kill(proc)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ periodic checks
    def tick(self, now: float) -> None:
        live = {lr: p for lr, p in self.a.sup.workers.items() if p.alive}  # type: ignore[union-attr]
        # heartbeat loss: a rank that said HELLO and went silent (dead or holding the GIL)
        for lr, st in self.ranks.items():
            if self.completing:
                break   # released workers close their connection while they exit
            if lr in live and st.hello and not st.killed and now - st.last_beat > self.cfg.heartbeat_timeout:
                info = {"host": self.a.host, "rank": st.rank, "local_rank": lr, "pid": st.pid, "step": st.step,
                        "summary": f"rank {st.rank} (pid {st.pid}) sent no heartbeat for "
                                   f"{now - st.last_beat:.1f}s (hung holding the GIL, or stopped)",
                        "cause": "heartbeat lost", "exit_code": 1, "secondary": False}
                self.kill_rank(st, "lost its heartbeat")
                self.fault(info, failed=())
        if self.round is None and not self.completing:
            self._check_progress(now, live)
            self._check_done()
        if self.round is not None:
            self._advance_round(now, live)

    def _check_progress(self, now: float, live: dict) -> None:
        pt = self.cfg.progress_timeout
        if pt is None or self.a.phase != "running":
            return
        stalled = [st for lr, st in self.ranks.items() if lr in live and st.hello and st.state == "running"
                   and now - st.progress_t > pt]
        if not stalled:
            return
        # the culprit is the rank whose collective sequence lags, not the ranks blocked waiting for it
        running = [st for lr, st in self.ranks.items() if lr in live and st.hello and st.state == "running"]
        seqs = [st.seq for st in running if st.seq is not None]
        lagging = [st for st in running if st.seq is not None and st.seq < max(seqs)] if seqs else []
        culprits = lagging or stalled
        names = ", ".join(str(st.rank) for st in culprits)
        info = {"host": self.a.host, "rank": culprits[0].rank, "local_rank": culprits[0].local_rank,
                "pid": culprits[0].pid, "step": culprits[0].step, "exit_code": 1, "secondary": False,
                "cause": "no progress", "summary": f"no progress for {pt:g}s; culprit rank(s) {names} "
                f"(collective sequence {[st.seq for st in culprits]} vs max {max(seqs) if seqs else None})"}
        self.fault(info, failed=())
        if self.round is not None:
            self.round.culprits = {st.local_rank for st in culprits}

    def _check_done(self) -> None:
        g = self.a.generation
        if not self.ranks or not all(st.done_gen >= g for st in self.ranks.values()):
            return
        if not self.a.rdzv.single_node:  # type: ignore[union-attr]
            if self.node_done_marked != g:
                self.a.coord.mark_node(f"ipdone/{g}")  # type: ignore[union-attr]
                self.node_done_marked = g
            if self.a.coord.nodes_marked(f"ipdone/{g}") < self.a.rdzv.nnodes:  # type: ignore
                return
        self.completing = True
        self.a.events.emit("complete", f"every rank finished generation {g}: releasing the workers", generation=g)
        for st in self.ranks.values():
            self._send(st, P.Shutdown(reason="complete"))
        self.a.end_warm_spawner()   # nothing left to respawn: it must not compete with the workers' exit

    def _advance_round(self, now: float, live: dict) -> None:
        r = self.round
        assert r is not None
        a = self.a
        # ranks that have not left the failed generation after RESTART + grace cannot be interrupted; but
        # while a rank that reported the FAULT is still tearing its groups down, the peers blocked on it
        # are waiting for that, not stuck (its own abort_timeout and --inprocess-timeout bound it)
        if now >= r.grace_at and r.kill_stage < 2 and any(
                lr in live and st.fault_gen >= a.generation and st.ready_gen < r.target
                for lr, st in self.ranks.items()):
            r.grace_at = now + self.grace
        if now >= r.grace_at and r.kill_stage < 2:
            stuck = [st for lr, st in self.ranks.items() if lr in live and st.hello and not st.killed
                     and st.ready_gen < r.target and st.state in ("running", "done") and st.beat_gen < r.target
                     and st.fault_gen < a.generation]   # a rank that reported FAULT left fn: it is recovering
            if r.kill_stage == 0:
                stuck_c = [st for st in stuck if st.local_rank in r.culprits] or (
                    [min(stuck, key=lambda s: (s.seq if s.seq is not None else -1))] if stuck else [])
                for st in stuck_c:
                    self.kill_rank(st, f"did not respond to RESTART within {self.grace:g}s (stuck in a C call?)")
                r.kill_stage, r.grace_at = 1, now + self.grace
            else:
                for st in stuck:
                    self.kill_rank(st, f"did not respond to RESTART within {2 * self.grace:g}s")
                r.kill_stage = 2
        # barrier
        all_ready = len(live) == len(self.ranks) and all(
            st.ready_gen >= r.target and st.hello for st in self.ranks.values())
        if all_ready:
            if not a.rdzv.single_node:  # type: ignore[union-attr]
                if not r.node_ready_marked:
                    a.coord.mark_node(f"ipready/{r.target}")  # type: ignore[union-attr]
                    r.node_ready_marked = True
                if a.coord.nodes_marked(f"ipready/{r.target}") < a.rdzv.nnodes:  # type: ignore
                    all_ready = False
        if all_ready:
            port = a.coord.worker_store_port(r.target)  # type: ignore[union-attr]
            if port is not None:
                self._go(r, port, now)
                return
        if now >= r.deadline:
            missing = self.not_ready(r.target, now)
            what = "; ".join(m for _, m in missing) or "every rank of this node is ready; other nodes are not"
            a.events.emit("inprocess_timeout", f"in-process restart to generation {r.target} not done within "
                          f"--inprocess-timeout {self.cfg.inprocess_timeout:g}s: {what}; escalating to a "
                          "process-level restart", generation=r.target, not_ready=[m for _, m in missing],
                          level=logging.ERROR)
            self.round = None
            root = dict(r.root, summary=f"{what} (the restart began with: {r.root.get('summary')})")
            if missing:   # the report names the first rank that never got READY, not the fault's rank
                st = missing[0][0]
                root.update(rank=st.rank, local_rank=st.local_rank, pid=st.pid)
            a.escalate(r.target, root)

    def not_ready(self, target: int, now: float) -> list[tuple[RankState, str]]:
        """The local ranks that have not reported READY for `target`, each with what it was doing."""
        return not_ready(self.ranks, self.a.sup.workers, target, now)  # type: ignore[union-attr]

    def _go(self, r: Round, port: int, now: float) -> None:
        a = self.a
        if not r.root.get("remote") and self._step_guard(r.root):
            self.round = None
            return
        a.events.emit("barrier_complete", f"every rank ready for generation {r.target}", generation=r.target,
                      duration_s=now - r.t_detect)
        go = P.Go(generation=r.target, master_addr=a.rdzv.master_addr, master_port=port)  # type: ignore
        for st in self.ranks.values():
            self._send(st, go)
            st.progress_t = now
        a.generation = r.target
        a.phase = "running"
        self.round = None
        downtime = time.monotonic() - r.t_detect
        root = self._job_root(r)
        a.events.emit("go", f"GO generation {r.target}: recovered in {downtime:.3f}s (root cause: "
                      f"{root.get('summary')}{f'; {r.folded} secondary fault(s) folded' if r.folded else ''})",
                      generation=r.target, downtime_s=downtime, root_cause=root.get("summary"))

    def reset_after_process_restart(self, gen: int) -> None:
        """All local workers were respawned for `gen` (escalation): wait for their READY(gen)."""
        now = time.monotonic()
        self.round = Round(target=gen, t_detect=now, root={"summary": "process-level restart"},
                           deadline=now + max(self.cfg.inprocess_timeout, self.a.cfg.join_timeout),
                           grace_at=now + 10 ** 9)
        self.a.phase = "restarting"
