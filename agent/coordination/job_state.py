"""Job-wide state in the coordination store: restart generation, restart budget, failure, completion.

The generation moves only forward and only through the store: the first agent to claim the restart into
g+1 owns it (its claim holds the cause); an agent that asks later joins the same generation. A
process-level restart spends one unit of the job-wide budget, counted once per generation whichever agent
counts it, so every agent that asks for the same generation gets the same verdict. A watcher thread per
agent (its own connection) turns changes made by other nodes into loop events. The keys and records are
those of agent/coordination/store_schema.py.

Every record that changes the job's fate is signed with a key derived from the job secret
(hyperpodrun/auth.py) and bound to the run id and the record's name: the generation, the restart claims
and the budget spent, the failure record, the workers' store port, and the per-node completion and
barrier marks. The store itself authenticates nobody (as torchrun's), so a record someone else wrote is
ignored - reported once as `forged_record` - and a counter is only a hint whose count is confirmed
through signed per-node marks. What a store writer can still do is listed in the docs/security.md.
"""
from __future__ import annotations

import logging
import secrets
import threading
from typing import Callable, Optional, Sequence

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.ports import KVStore, Posted, RestartGrant
from hyperpodrun.agent.coordination.store_schema import FailureInfo, Layout, NodeJoin, NodeLoss, RestartBudget, RestartClaim
from hyperpodrun.agent.coordination.signed_records import Forgeries, SignedRecords  # noqa: F401 (re-exported)
from hyperpodrun.agent.coordination.layout import LayoutRecords
from hyperpodrun.agent.coordination.membership import MemberRecords
from hyperpodrun.errors import FencedError

log = logging.getLogger("hyperpodrun.agent")



class Coordinator:
    """Main-thread view of the job-wide records (the Coordination port). `store` is already prefixed to the run."""

    def __init__(self, store: KVStore, nnodes: int, max_restarts: int, *, key: bytes, run_id: str, node_rank: int,
                 on_forged: Callable[[str], None], incarnation: str = "",
                 nodes: Optional[Callable[[], Sequence[int]]] = None) -> None:
        self.store = store
        self.incarnation = incarnation      # this agent's hold on its node rank (agent/coordination/membership.py)
        self.nnodes = nnodes
        self._nodes = nodes or (lambda: range(nnodes))   # the node ranks of the job now (they change: elastic)
        self.max_restarts = max_restarts
        self.node_rank = node_rank
        self._key = key
        self._run = run_id
        self.forgeries = Forgeries(on_forged)
        self.records = SignedRecords(store, key, run_id, self.forgeries)
        self._me = f"node{node_rank}:{secrets.token_hex(8)}"   # tells our claims from another agent's
        self._counted: dict[str, int] = {}   # per mark name: the count this agent's own mark made

    def view(self, store: KVStore) -> "Coordinator":
        """The same job's records over another connection to the same store (the watcher's)."""
        other = Coordinator(store, self.nnodes, self.max_restarts, key=self._key, run_id=self._run,
                            node_rank=self.node_rank, on_forged=lambda name: None, incarnation=self.incarnation,
                            nodes=self._nodes)
        other.forgeries = self.forgeries    # each forged name is still reported once, whichever view saw it
        other.records = SignedRecords(store, self._key, self._run, self.forgeries)
        return other

    # ------------------------------------------------------------ generations and the budget
    def generation(self) -> int:
        return int(self.records.read(K.GENERATION) or 0)

    def check_holder(self) -> None:
        """FencedError once another incarnation holds this node's rank: this agent was declared lost and
        replaced, and whatever it would write now (a restart claim, a READY mark) would disturb the job."""
        if not self.incarnation:
            return
        holder = self.records.read(K.node_holder(self.node_rank))
        if holder is not None and holder != self.incarnation:
            raise FencedError(f"node {self.node_rank} was declared lost (no lease renewal for --node-timeout) and "
                              "another agent has taken its place; this agent leaves without touching the job")

    def request_restart(self, current: int, reason: FailureInfo, count_budget: bool = True) -> RestartGrant:
        """Ask for generation current+1.

        In-process restarts move the generation without spending the --max-restarts budget
        (count_budget=False); process-level restarts spend one unit. The budget is counted once per
        generation by whichever agent asks first, and read by every agent that asks, so an agent that lost
        the race to claim the restart learns that the budget is spent as the winner does (and the winner's
        cause with it)."""
        self.check_holder()
        latest = self.generation()
        if latest > current:   # someone already moved it: fold our failure into theirs
            return RestartGrant(latest, started=False, budget_ok=True, cause=reason)
        target = current + 1
        mine = RestartClaim(owner=self._me, reason=reason).model_dump_json()
        won = self.records.claim(K.restart_claim(target), mine)
        claim = RestartClaim.model_validate_json(won) if won is not None else None
        started = claim is not None and claim.owner == self._me
        cause = claim.reason if claim is not None else reason
        if count_budget:
            budget = RestartBudget.model_validate_json(self.records.update(K.RESTARTS_USED, _count_for(target)))
            if budget.used > self.max_restarts:
                return RestartGrant(target, started=started, budget_ok=False, cause=cause)
        if started:   # the generation never moves backwards
            self.records.update(K.GENERATION, lambda g: str(max(int(g or 0), target)))
        return RestartGrant(target, started=started, budget_ok=True, cause=cause)

    def restarts_used(self) -> int:
        value = self.records.read(K.RESTARTS_USED)
        return RestartBudget.model_validate_json(value).used if value is not None else 0

    # ------------------------------------------------------------ the job's failure
    def report_failure(self, info: FailureInfo) -> FailureInfo:
        """The job failed for good: tell every agent. The first report wins; returns the winning one."""
        self.check_holder()
        won = self.records.claim(K.FAILED, info.to_json())
        return FailureInfo.from_json(won) if won is not None else info

    def failure(self) -> Optional[FailureInfo]:
        """The failure that ended the job, once an agent has reported one."""
        value = self.records.read(K.FAILED)
        return FailureInfo.from_json(value) if value is not None else None

    # ------------------------------------------------------------ worker stores
    def publish_worker_store(self, generation: int, port: int, addr: Optional[str] = None) -> None:
        """Generation `generation`'s workers' store listens on `port` (of the store host, or of `addr`)."""
        self.records.write(K.worker_store(generation), f"{addr}:{port}" if addr else str(port))

    def claim_worker_store(self, generation: int) -> bool:
        """With a standalone coordinator: True when this agent is the one to host `generation`'s workers' store
        (the first agent that needs it - a live one, by definition - wins)."""
        self.check_holder()
        return self.records.claim(K.worker_store_host(generation), self._me) == self._me

    def _worker_store(self, generation: int) -> Optional[tuple[Optional[str], int]]:
        value = self.records.read(K.worker_store(generation))
        if value is None:
            return None
        addr, _, port = value.rpartition(":")
        return (addr or None), int(port)

    def worker_store_port(self, generation: int) -> Optional[int]:
        found = self._worker_store(generation)
        return found[1] if found is not None else None

    def worker_store_addr(self, generation: int) -> Optional[str]:
        """The address of `generation`'s workers' store when an agent other than the store host serves it
        (a standalone coordinator's job); None: the rendezvous' master address."""
        found = self._worker_store(generation)
        return found[0] if found is not None else None

    # ------------------------------------------------------------ in-process rounds
    def claim_root_cause(self, generation: int, info: FailureInfo) -> None:
        """Name the real cause of `generation`'s round job-wide (the first node that knows one wins)."""
        self.check_holder()
        self.records.claim(K.root_cause(generation), info.with_(node=self.node_rank).to_json())

    def root_cause(self, generation: int) -> Optional[FailureInfo]:
        value = self.records.read(K.root_cause(generation))
        return FailureInfo.from_json(value) if value is not None else None

    def mark_ready(self, generation: int, on: bool = True) -> None:
        """Every rank of this node is READY for `generation`; on=False takes it back (a rank died since)."""
        self.check_holder()
        self._mark(K.inprocess_ready(generation), on)

    def ready_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int:
        return self._count(K.inprocess_ready(generation), nodes)

    def mark_inprocess_done(self, generation: int) -> None:
        self.check_holder()
        self._mark(K.inprocess_done(generation))

    def inprocess_done_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int:
        return self._count(K.inprocess_done(generation), nodes)

    # ------------------------------------------------------------ the exit barrier
    def mark_done(self, generation: int) -> None:
        self.check_holder()
        self._mark(K.done(generation))

    def done_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int:
        return self._count(K.done(generation), nodes)

    def mark_left(self) -> None:
        self.check_holder()
        self._mark(K.LEFT)

    def left_count(self, nodes: Optional[Sequence[int]] = None) -> int:
        """Read by the store host alone (node.py), which may be neither the lowest node nor the last to leave:
        it reads the marks itself - N reads per pass, for one agent."""
        return self.records.count(K.LEFT, list(nodes or self._nodes()))

    def _mark(self, name: str, on: bool = True) -> None:
        counted = self.records.mark(name, self.node_rank, on)
        self._counted[name] = counted if on else -1

    def _count(self, name: str, given: Optional[Sequence[int]]) -> int:
        """A barrier's count over the job's nodes now (or `given`). The signed marks are read - and sealed -
        by two agents only: the one whose mark completed the counter, and the lowest node of the job (should
        the first be gone); the others wait for the seal (signed_records.count): O(N) reads per barrier."""
        nodes = list(given or self._nodes())
        verify = not nodes or self.node_rank == min(nodes) or self._counted.get(name, -1) >= len(nodes)
        return self.records.count(name, nodes, verify=verify)

    # ------------------------------------------------------------ membership (agent/coordination/membership.py)
    def declare_lost(self, loss: NodeLoss) -> NodeLoss:
        """Record that incarnation `loss.incarnation` of node `loss.node` is lost: its rank may be taken over
        from now on, and that incarnation is fenced should it come back. The first declaration wins and is
        returned (agent/coordination/membership.py)."""
        return MemberRecords(self.records).declare_lost(loss)

    def drop_lost(self, node: int, incarnation: str) -> bool:
        """Elastic shrink: no replacement takes node `node` (lost as `incarnation`) any more; False when one
        already has (agent/coordination/layout.py)."""
        self.check_holder()
        return MemberRecords(self.records).drop(node, incarnation)

    def set_layout(self, layout: Layout) -> Layout:
        """The job runs on `layout`'s nodes from its generation on (first claim wins; the agreed one)."""
        self.check_holder()
        return LayoutRecords(self.records).claim(layout)

    def layout_for_round(self, target: int) -> Optional[Layout]:
        """The layout the round into `target` moves to, when the job's nodes change there or before."""
        return LayoutRecords(self.records).for_round(target)

    def join_request(self, node: int) -> Optional[NodeJoin]:
        return LayoutRecords(self.records).join_request(node)


def _count_for(target: int) -> Callable[[Optional[str]], str]:
    """The budget update for a process-level restart into `target`: one more unit, unless counted already."""
    def count(value: Optional[str]) -> str:
        budget = RestartBudget.model_validate_json(value) if value is not None else RestartBudget()
        if budget.counted < target:
            budget = RestartBudget(used=budget.used + 1, counted=target)
        return budget.model_dump_json()
    return count


#: the Watcher reads the generation and the failure record in full every this many passes (1 s by default)
FULL_READ_EVERY = 10


class Watcher(threading.Thread):
    """Polls the job-wide records over its own connection; posts ("generation", g) / ("failed", FailureInfo),
    and ("store_lost", why) once the store cannot be read.

    Every agent polls every --monitor-interval, so what one pass costs the store is multiplied by the job's
    size: a pass makes one check - does the claim of the next generation exist? (`restart/<g+1>` is written
    before the generation moves to g+1) - and reads the generation only then; the generation (should it have
    moved otherwise: written back after a coordinator restart) and the failure record are read in full every
    FULL_READ_EVERY passes. About 1.2 operations per pass instead of 3 (BENCHMARKS.md, "Control plane at
    scale")."""

    def __init__(self, open_store: Callable[[], KVStore], post: Callable[[Posted], None], interval: float,
                 view: Callable[[KVStore], Coordinator]) -> None:
        super().__init__(name="hyperpodrun-watch", daemon=True)
        self._open_store = open_store
        self._post = post
        self._interval = interval
        self._view = view
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            coord = self._view(self._open_store())
        except Exception as exc:  # the loop learns of a lost store through this event
            self._post(("store_lost", str(exc)))
            return
        seen_gen = -1
        failed_sent = False
        passes = 0
        while not self._halt.wait(self._interval):
            try:
                full = passes % FULL_READ_EVERY == 0
                passes += 1
                if full or coord.store.check([K.restart_claim(max(seen_gen, 0) + 1)]):
                    gen = coord.generation()
                    if gen != seen_gen:
                        seen_gen = gen
                        self._post(("generation", gen))
                if full and not failed_sent:
                    failed = coord.failure()
                    if failed is not None:
                        failed_sent = True
                        self._post(("failed", failed))
            except Exception as exc:
                if not self._halt.is_set():
                    self._post(("store_lost", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                return

    def stop(self) -> None:
        self._halt.set()
