"""Node membership (agent/coordination/membership.py) on fakes: which leases LeaseWatch reports lost or replaced; the
holder / lease / loss records over torch's in-memory HashStore (take a free rank once, take over only from a
declared-lost incarnation, first declaration wins, the list of losses); fencing in the Coordinator; the
Membership loop run on this thread (the store host's LeaseWatch, the other agents' LossNews); and the node's
side: a lost node starts a round that waits --replace-timeout for a replacement, a replacement joins the
survivors' generation, a fenced agent stops with EXIT_FENCED.
Nothing here starts a process or a thread, opens a socket or sleeps."""
from __future__ import annotations

import signal
from typing import Callable, Optional, cast

import pytest
import torch.distributed as dist
from fakes import KEY, RUN, FakeClock, FlakyStore, Harness, config, shared_store

from hyperpodrun import protocol as P
from hyperpodrun.agent.coordination import membership
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.job_state import Coordinator, SignedRecords
from hyperpodrun.agent.coordination.membership import LeaseWatch, LossNews, MemberRecords, Membership
from hyperpodrun.agent.ports import KVStore, Posted
from hyperpodrun.agent.state import Phase
from hyperpodrun.agent.coordination.store_schema import FailureInfo, NodeLease, NodeLoss
from hyperpodrun.errors import EXIT_FENCED, EXIT_NODE_NOT_REPLACED, FencedError

NODE_TIMEOUT = 3.0
REPLACE_TIMEOUT = 120.0      # above --inprocess-timeout (60 s): the round's deadline is the replace timeout


# ------------------------------------------------------------------ helpers
def lease(incarnation: str, count: int) -> NodeLease:
    return NodeLease(incarnation=incarnation, count=count)


def prefixed(raw: KVStore) -> KVStore:
    """A connection to the run's keys, as the agents (and fakes.Harness) see the store."""
    return dist.PrefixStore(K.run_prefix(RUN), raw)


def records_on(raw: KVStore, forged: Optional[list[str]] = None) -> MemberRecords:
    """One agent's membership records over `raw` (its own SignedRecords, as each store connection has)."""
    sink = forged if forged is not None else []
    return MemberRecords(SignedRecords(prefixed(raw), KEY, RUN, sink.append))


def coordinator(raw: KVStore, node_rank: int, incarnation: str, nnodes: int = 2) -> Coordinator:
    return Coordinator(prefixed(raw), nnodes, 3, key=KEY, run_id=RUN, node_rank=node_rank,
                       on_forged=lambda name: None, incarnation=incarnation)


def members(h: Harness) -> MemberRecords:
    """The records as `h`'s membership thread reads them (a view over its store)."""
    return MemberRecords(h.coord.view(h.flaky).records)


def loss_of(node: int, incarnation: str, generation: int = 1, by_node: int = 0) -> NodeLoss:
    return NodeLoss(node=node, incarnation=incarnation, generation=generation, by_node=by_node,
                    why="no lease renewal for 3.0s", wall_time=1.7e9)


def go_messages(h: Harness) -> list[P.Go]:
    return [m for _, m in h.control.of(P.Go)]


def cluster(nnodes: int = 2, **overrides: object) -> tuple[list[Harness], KVStore]:
    """`nnodes` running nodes of one in-process job, each holding its node rank as incarnation "inc<n>"."""
    store = shared_store()
    cfg = config(**{"nnodes": nnodes, "inprocess_restart": True, "node_timeout": NODE_TIMEOUT,
                    "replace_timeout": REPLACE_TIMEOUT, **overrides})
    nodes = [Harness(cfg, node_rank=n, store=store, incarnation=f"inc{n}") for n in range(nnodes)]
    for h in nodes:
        assert members(h).take_free(h.node_rank, h.incarnation)
    for h in nodes:
        h.start()
    for h in nodes:
        h.hello_all()
        assert h.phase is Phase.RUNNING
    return nodes, store


def keep_beating(h: Harness, seconds: float, step: float = 5.0) -> None:
    """Time passes while `h`'s ranks keep sending heartbeats (they wait for GO, or train); the loop ticks."""
    end = h.clock.now + seconds
    while h.clock.now < end and h.state.active:
        h.clock.advance(min(step, end - h.clock.now))
        r = h.inproc.round if h.inproc is not None else None
        gen = r.target if r is not None else h.state.generation
        for lr, proc in list(h.procs.workers.items()):
            if proc.alive:
                h.beat(lr, gen, step=7, seq=3, state="waiting" if r is not None else "running")
        h.tick()


def lose(h: Harness, node: int, incarnation: str, silent: float = NODE_TIMEOUT) -> None:
    """What `h`'s membership thread posts once `node`'s lease stopped moving (LeaseWatch's words)."""
    h.node.on_posted(("node_lost", (node, incarnation, f"no lease renewal for {silent:.1f}s")))


def tell(h: Harness, watch: LossNews) -> list[Posted]:
    """What the membership thread of `h` (not the store host) posts now: the news of the list of losses."""
    view = members(h)
    events = watch.observe(view.losses(), view.holder)
    for event in events:
        h.node.on_posted(event)
    return events


# ------------------------------------------------------------------ LeaseWatch (pure)
def silent_for(seconds: float) -> str:
    return f"no lease renewal for {seconds:.1f}s"


def test_a_lease_that_keeps_moving_is_never_lost():
    watch = LeaseWatch(0, 2, timeout=5.0)
    for t in range(100):
        assert watch.observe(float(t), {1: ("a", lease("a", t))}) == []


def test_a_lease_that_stops_moving_is_reported_lost_once():
    watch = LeaseWatch(0, 2, timeout=5.0)
    assert watch.observe(0.0, {1: ("a", lease("a", 1))}) == []
    assert watch.observe(1.0, {1: ("a", lease("a", 2))}) == []           # moved at t=1: silence starts here
    assert watch.observe(5.5, {1: ("a", lease("a", 2))}) == []           # 4.5 s < 5 s
    assert watch.observe(6.0, {1: ("a", lease("a", 2))}) == [("node_lost", (1, "a", silent_for(5.0)))]
    assert watch.observe(7.0, {1: ("a", lease("a", 2))}) == []           # reported once
    assert watch.observe(60.0, {1: ("a", lease("a", 2))}) == []


def test_silence_is_measured_from_the_first_sight_of_a_lease():
    watch = LeaseWatch(0, 2, timeout=5.0)
    assert watch.observe(100.0, {1: ("a", lease("a", 40))}) == []        # an old count: no judgement yet
    assert watch.observe(104.0, {1: ("a", lease("a", 40))}) == []
    assert watch.observe(105.0, {1: ("a", lease("a", 40))}) == [("node_lost", (1, "a", silent_for(5.0)))]


def test_a_lost_node_that_renews_again_is_not_reported_twice():
    watch = LeaseWatch(0, 2, timeout=5.0)
    watch.observe(0.0, {1: ("a", lease("a", 1))})
    assert watch.observe(5.0, {1: ("a", lease("a", 1))})[0][0] == "node_lost"
    assert watch.observe(6.0, {1: ("a", lease("a", 2))}) == []           # SIGCONT: it renews again
    assert watch.observe(60.0, {1: ("a", lease("a", 2))}) == []          # (node, incarnation) told once


def test_a_holder_that_never_renewed_gets_three_timeouts():
    """membership.NEVER_RENEWED_FACTOR: it may be slow to start renewing, or died right after its rendezvous."""
    assert membership.NEVER_RENEWED_FACTOR == 3
    watch = LeaseWatch(0, 3, timeout=5.0)
    assert watch.observe(0.0, {1: ("a", None), 2: (None, None)}) == []
    assert watch.observe(14.9, {1: ("a", None), 2: (None, None)}) == []  # > 1 timeout, < 3
    assert watch.observe(15.0, {1: ("a", None), 2: (None, None)}) == [("node_lost", (1, "a", silent_for(15.0)))]
    # node 2 holds no rank (nobody joined as node 2): never lost
    assert watch.observe(1000.0, {1: ("a", None), 2: (None, None)}) == []


def test_replaying_a_dead_nodes_old_lease_records_does_not_keep_it_alive():
    """Issue 33, item 8: whoever can write the store replays node 1's own signed records (counts 5 and 6, over
    and over); only a count past the highest seen for the incarnation is a renewal."""
    watch = LeaseWatch(0, 2, timeout=5.0)
    for t in range(1, 7):
        assert watch.observe(float(t), {1: ("a", lease("a", t))}) == []   # renewals up to count 6 at t=6
    events = []
    for t in range(7, 12):
        events += watch.observe(float(t), {1: ("a", lease("a", 5 if t % 2 else 6))})
    assert events == [("node_lost", (1, "a", silent_for(5.0)))]


def test_another_incarnations_lease_moving_is_no_renewal_of_the_holder():
    watch = LeaseWatch(0, 2, timeout=5.0)
    assert watch.observe(0.0, {1: ("b", lease("b", 1))}) == []
    for t in range(1, 15):      # "a"'s lease moves on: no renewal of "b" (which is now judged never renewed)
        assert watch.observe(float(t), {1: ("b", lease("a", 10 + t))}) == []
    assert watch.observe(15.0, {1: ("b", lease("a", 30))}) == [("node_lost", (1, "b", silent_for(15.0)))]


def test_a_lease_left_by_another_incarnation_is_no_renewal_of_the_holder():
    watch = LeaseWatch(0, 2, timeout=5.0)
    assert watch.observe(0.0, {1: ("b", lease("a", 9))}) == []
    assert watch.observe(10.0, {1: ("b", lease("a", 9))}) == []          # "b" has not renewed: 3 timeouts
    assert watch.observe(15.0, {1: ("b", lease("a", 9))}) == [("node_lost", (1, "b", silent_for(15.0)))]


def test_the_first_holder_is_no_replacement():
    watch = LeaseWatch(0, 2, timeout=5.0)
    assert watch.observe(0.0, {1: (None, None)}) == []
    assert watch.observe(1.0, {1: ("a", None)}) == []                    # node 1 joined: not "node_joined"
    assert watch.observe(2.0, {1: ("a", lease("a", 1))}) == []


def test_a_new_holder_is_reported_joined_and_watched_afresh():
    watch = LeaseWatch(0, 2, timeout=5.0)
    watch.observe(0.0, {1: ("a", lease("a", 1))})
    assert watch.observe(5.0, {1: ("a", lease("a", 1))}) == [("node_lost", (1, "a", silent_for(5.0)))]
    # a replacement takes the rank; its lease is not renewed yet (the old one is still in the store)
    assert watch.observe(20.0, {1: ("b", lease("a", 1))}) == [("node_joined", (1, "b"))]
    assert watch.observe(30.0, {1: ("b", lease("a", 1))}) == []          # the watch restarted at t=20
    assert watch.observe(31.0, {1: ("b", lease("b", 1))}) == []          # "b" renews: watched from here
    assert watch.observe(35.0, {1: ("b", lease("b", 1))}) == []
    assert watch.observe(36.0, {1: ("b", lease("b", 1))}) == [("node_lost", (1, "b", silent_for(5.0)))]
    assert watch.observe(50.0, {1: ("b", lease("b", 1))}) == []


def test_nodes_are_judged_independently():
    watch = LeaseWatch(0, 3, timeout=5.0)
    for t in range(6):
        events = watch.observe(float(t), {1: ("a", lease("a", 1)), 2: ("c", lease("c", t))})
    assert events == [("node_lost", (1, "a", silent_for(5.0)))]


# ------------------------------------------------------------------ the Membership loop, run on this thread
class Loops:
    """Stands in for Membership's stop event: `n` passes of its loop, `between(i)` after pass i, no waiting."""

    def __init__(self, n: int, between: Callable[[int], None] = lambda i: None) -> None:
        self.n = n
        self.passes = 0
        self.between = between

    def is_set(self) -> bool:
        return self.passes >= self.n

    def set(self) -> None:
        self.n = 0

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.passes += 1
        self.between(self.passes)
        return self.is_set()


def membership_of(raw: KVStore, node: int, nnodes: int, incarnation: str, clock: FakeClock,
                  posted: list[Posted], *, watch_all: bool, passes: Loops,
                  open_store: Optional[Callable[[], KVStore]] = None) -> Membership:
    m = Membership(open_store or (lambda: prefixed(raw)),
                   lambda store: SignedRecords(store, KEY, RUN, lambda name: None), posted.append,
                   node=node, nnodes=nnodes, incarnation=incarnation, node_timeout=NODE_TIMEOUT,
                   watch_all=watch_all, clock=clock.monotonic)
    setattr(m, "_halt", passes)
    return m


def test_the_store_host_renews_its_lease_and_reports_a_silent_node_once():
    raw = shared_store()
    other = records_on(raw)
    assert records_on(raw).take_free(0, "inc0") and other.take_free(1, "inc1")
    other.renew(1, "inc1", 1)                      # node 1 renewed once, then went silent
    clock, posted = FakeClock(), list[Posted]()
    membership_of(raw, 0, 2, "inc0", clock, posted, watch_all=True,
                  passes=Loops(8, between=lambda i: clock.advance(1.0))).run()
    assert posted == [("node_lost", (1, "inc1", silent_for(NODE_TIMEOUT)))]
    assert other.lease(0) == lease("inc0", 8)     # renewed on every pass


def test_the_store_host_never_watches_its_own_node(monkeypatch: pytest.MonkeyPatch):
    seen: list[set[int]] = []

    class Recording(LeaseWatch):
        def observe(self, now: float, state: dict[int, tuple[Optional[str], Optional[NodeLease]]]
                    ) -> list[Posted]:
            seen.append(set(state))
            return super().observe(now, state)
    monkeypatch.setattr(membership, "LeaseWatch", Recording)
    raw = shared_store()
    clock, posted = FakeClock(), list[Posted]()
    membership_of(raw, 1, 3, "inc1", clock, posted, watch_all=True,
                  passes=Loops(3, between=lambda i: clock.advance(10.0))).run()
    assert seen == [{0, 2}] * 3 and posted == []


def test_the_store_host_posts_a_replacement_as_joined():
    raw = shared_store()
    rec = records_on(raw)
    assert rec.take_free(0, "inc0") and rec.take_free(1, "inc1")
    rec.renew(1, "inc1", 1)
    clock, posted = FakeClock(), list[Posted]()

    def between(i: int) -> None:
        clock.advance(1.0)
        if i == 1:                                 # node 1 is declared lost and replaced meanwhile
            rec.declare_lost(loss_of(1, "inc1"))
            assert rec.take_over(1, "inc1", "inc2")
    membership_of(raw, 0, 2, "inc0", clock, posted, watch_all=True, passes=Loops(2, between)).run()
    assert posted == [("node_joined", (1, "inc2"))]


def test_another_agent_learns_losses_from_the_list_and_reads_no_lease(monkeypatch: pytest.MonkeyPatch):
    def no_watch(*args: object) -> LeaseWatch:
        raise AssertionError("only the store host watches every lease")
    monkeypatch.setattr(membership, "LeaseWatch", no_watch)
    raw = shared_store()
    rec = records_on(raw)
    for n in range(3):
        assert rec.take_free(n, f"inc{n}")
    host = coordinator(raw, 0, "inc0", nnodes=3)
    clock, posted = FakeClock(), list[Posted]()
    lost = loss_of(1, "inc1", generation=2)

    def between(i: int) -> None:
        if i == 2:
            host.declare_lost(lost)                # the store host declared node 1 lost (into the list)
        if i == 4:
            assert rec.take_over(1, "inc1", "inc9")
    membership_of(raw, 2, 3, "inc2", clock, posted, watch_all=False, passes=Loops(6, between)).run()
    assert posted == [("node_lost", (1, "inc1", lost.why)), ("node_joined", (1, "inc9"))]
    assert rec.lease(2) == lease("inc2", 6) and rec.lease(1) is None


def test_membership_of_a_replaced_agent_posts_fenced_and_renews_nothing():
    raw = shared_store()
    rec = records_on(raw)
    assert rec.take_free(1, "inc1")
    rec.declare_lost(loss_of(1, "inc1"))
    assert rec.take_over(1, "inc1", "inc2")
    for watch_all in (True, False):
        clock, posted, passes = FakeClock(), list[Posted](), Loops(5)
        membership_of(raw, 1, 2, "inc1", clock, posted, watch_all=watch_all, passes=passes).run()
        assert posted == [("fenced", "inc2")] and passes.passes == 0 and rec.lease(1) is None


def test_membership_stops_quietly_when_the_store_is_gone():
    raw = shared_store()
    flaky = FlakyStore(prefixed(raw))
    clock, posted = FakeClock(), list[Posted]()
    passes = Loops(5, between=lambda i: setattr(flaky, "lost", True))
    membership_of(raw, 0, 2, "inc0", clock, posted, watch_all=True, passes=passes,
                  open_store=lambda: cast(KVStore, flaky)).run()
    assert posted == [] and passes.passes == 1      # the watcher reports a lost store; this thread only stops

    def no_store() -> KVStore:
        raise RuntimeError("connection refused")
    membership_of(raw, 0, 2, "inc0", clock, posted, watch_all=True, passes=Loops(5), open_store=no_store).run()
    assert posted == []


# ------------------------------------------------------------------ MemberRecords over a HashStore
def test_a_free_node_rank_is_taken_only_once():
    raw = shared_store()
    first, second = records_on(raw), records_on(raw)
    assert first.holder(0) is None
    assert first.take_free(0, "inc0")
    assert not second.take_free(0, "inc9")
    assert second.holder(0) == first.holder(0) == "inc0"
    assert second.take_free(1, "inc9") and first.holder(1) == "inc9"     # another rank is another record


def test_take_over_needs_a_declared_loss_and_only_one_newcomer_wins():
    raw = shared_store()
    agent, survivor, newcomer, late = records_on(raw), records_on(raw), records_on(raw), records_on(raw)
    assert agent.take_free(1, "inc1")
    assert not newcomer.take_over(1, "inc1", "inc2")                      # inc1 was not declared lost
    assert agent.holder(1) == "inc1"
    survivor.declare_lost(loss_of(1, "inc1"))
    assert newcomer.take_over(1, "inc1", "inc2")
    assert not late.take_over(1, "inc1", "inc3")                          # the rank is inc2's now
    assert agent.holder(1) == late.holder(1) == "inc2"
    assert not late.take_over(1, "inc2", "inc3")                          # inc2 is not declared lost


def test_vacancy_is_the_declared_lost_holder_until_it_is_taken_over():
    raw = shared_store()
    rec, spare = records_on(raw), records_on(raw)
    assert rec.take_free(0, "inc0") and rec.take_free(1, "inc1") and rec.take_free(2, "inc2")
    assert spare.vacancy(3) is None
    loss = loss_of(2, "inc2", generation=4, by_node=1)
    rec.declare_lost(loss)
    assert spare.vacancy(3) == (2, "inc2", loss)
    assert spare.take_over(2, "inc2", "spare")
    assert spare.vacancy(3) is None and rec.vacancy(3) is None
    assert rec.loss(2, "inc2") == loss                                    # the record stays: history


def test_the_first_declaration_of_a_loss_wins():
    raw = shared_store()
    a, b = records_on(raw), records_on(raw)
    first = loss_of(1, "inc1", generation=3, by_node=0)
    second = loss_of(1, "inc1", generation=5, by_node=2)
    assert a.declare_lost(first) == first
    assert b.declare_lost(second) == first
    assert b.loss(1, "inc1") == first
    # the Coordinator declares into the same record (what Node._on_node_lost uses)
    assert coordinator(raw, 2, "inc2", nnodes=3).declare_lost(second) == first
    other = loss_of(1, "inc7", generation=9, by_node=2)                   # another incarnation: another record
    assert coordinator(raw, 2, "inc2", nnodes=3).declare_lost(other) == other
    assert a.losses() == [first, other]                                   # the list holds each loss once


def test_an_unsigned_loss_record_lets_nobody_take_over():
    raw = shared_store()
    forged: list[str] = []
    rec = records_on(raw, forged)
    assert rec.take_free(1, "inc1")
    prefixed(raw).set(K.node_lost(1, "inc1"), loss_of(1, "inc1").model_dump_json())   # not signed
    assert rec.vacancy(2) is None and not rec.take_over(1, "inc1", "intruder")
    assert rec.holder(1) == "inc1" and set(forged) == {K.node_lost(1, "inc1")}


def test_a_lease_round_trips():
    raw = shared_store()
    rec = records_on(raw)
    assert rec.lease(0) is None
    rec.renew(0, "inc0", 1)
    rec.renew(0, "inc0", 2)
    assert records_on(raw).lease(0) == lease("inc0", 2)


# ------------------------------------------------------------------ fencing in the Coordinator
def test_check_holder_fences_an_agent_whose_rank_was_taken_over():
    raw = shared_store()
    old = coordinator(raw, 1, "inc1")
    old.check_holder()                                                    # nobody holds the rank yet
    rec = records_on(raw)
    assert rec.take_free(1, "inc1")
    old.check_holder()                                                    # ours
    coordinator(raw, 1, "").check_holder()                                # no incarnation: never checked
    rec.declare_lost(loss_of(1, "inc1"))
    with pytest.raises(FencedError, match="node 1 was declared lost"):   # fenced at once, replaced or not
        old.check_holder()
    assert rec.take_over(1, "inc1", "inc2")
    with pytest.raises(FencedError, match="node 1 was declared lost"):
        old.check_holder()
    coordinator(raw, 1, "inc2").check_holder()                            # the replacement is not fenced


def test_a_fenced_coordinator_moves_no_generation_and_marks_nothing():
    raw = shared_store()
    rec = records_on(raw)
    assert rec.take_free(0, "inc0") and rec.take_free(1, "inc1")
    old, survivor = coordinator(raw, 1, "inc1"), coordinator(raw, 0, "inc0")
    assert survivor.request_restart(0, FailureInfo(summary="node 1 lost"), count_budget=False).generation == 1
    rec.declare_lost(loss_of(1, "inc1"))
    assert rec.take_over(1, "inc1", "inc2")
    with pytest.raises(FencedError):
        old.request_restart(1, FailureInfo(summary="a late fault on the old node"), count_budget=True)
    assert survivor.generation() == 1 and survivor.restarts_used() == 0
    assert not prefixed(raw).check([K.restart_claim(2)])
    with pytest.raises(FencedError):
        old.mark_ready(1)
    assert survivor.ready_count(1) == 0


# ------------------------------------------------------------------ the node: a lost node, not replaced
def test_a_lost_node_starts_a_round_that_waits_for_its_replacement_then_ends_the_job():
    (n0, n1), _ = cluster(2)
    lose(n0, 1, "inc1")
    assert n0.phase is Phase.RESTARTING and n0.inproc is not None and n0.inproc.round is not None
    assert n0.inproc.round.target == 1 and n0.inproc.round.awaiting == {1: "inc1"}
    assert n0.coord.generation() == 1 and len(n0.control.of(P.Restart)) == 2
    fault = n0.sink.named("fault")[0]
    assert fault["root_cause"] == "node 1 lost: no lease renewal for 3.0s (--node-timeout 3s)"
    root = n0.coord.root_cause(1)
    assert root is not None and root.summary.startswith("node 1 lost") and root.cause == "node lost"
    loss = members(n0).loss(1, "inc1")
    assert loss is not None and (loss.node, loss.generation, loss.by_node) == (1, 1, 0)
    assert members(n0).vacancy(2) == (1, "inc1", loss)
    assert members(n0).losses() == [loss]                                 # listed for the other agents
    declared = n0.sink.named("node_lost")[0]
    assert declared["generation"] == 1 and "wait up to --replace-timeout 120s" in declared["msg"]

    n0.ready_all(1)
    n0.tick()
    assert n0.coord.ready_count(1) == 1 and n0.phase is Phase.RESTARTING    # node 1's ranks: never
    keep_beating(n0, REPLACE_TIMEOUT - 1)
    assert n0.phase is Phase.RESTARTING and not n0.sink.named("not_replaced")
    assert not n0.sink.named("inprocess_timeout")     # past --inprocess-timeout (60 s): still waiting
    keep_beating(n0, 1.5)
    not_replaced = n0.sink.named("not_replaced")
    assert len(not_replaced) == 1 and not_replaced[0]["generation"] == 1
    assert "node(s) 1 lost and not replaced within --replace-timeout 120s" in not_replaced[0]["msg"]
    failure = n0.coord.failure()
    assert failure is not None and failure.exit_code == EXIT_NODE_NOT_REPLACED == 79
    assert n0.phase is Phase.STOPPING and not go_messages(n0)
    n0.settle()
    assert n0.phase is Phase.DONE and n0.state.exit_code == EXIT_NODE_NOT_REPLACED
    assert n0.sink.named("job_failed") and not n0.sink.named("inprocess_timeout")


def test_a_lost_node_without_an_inprocess_round_ends_the_job():
    store = shared_store()
    cfg = config(nnodes=2, node_timeout=NODE_TIMEOUT)                     # no --inprocess-restart
    n0 = Harness(cfg, node_rank=0, store=store, incarnation="inc0").start()
    lose(n0, 1, "inc1")
    assert n0.sink.named("node_lost")[0]["node"] == 1 and n0.phase is Phase.STOPPING
    failure = n0.coord.failure()
    assert failure is not None and failure.exit_code == EXIT_NODE_NOT_REPLACED and failure.cause == "node lost"
    assert members(n0).loss(1, "inc1") is None                            # nobody will take its place
    n0.settle()
    assert n0.phase is Phase.DONE and n0.state.exit_code == EXIT_NODE_NOT_REPLACED


def test_a_node_that_leaves_after_the_job_completed_is_not_lost():
    (n0, n1), _ = cluster(2)
    for h in (n0, n1):
        h.done(0, 0)
        h.done(1, 0)
        h.tick()
    n0.tick()
    assert n0.inproc is not None and n0.inproc.completing
    lose(n0, 1, "inc1")
    assert n0.coord.failure() is None and n0.inproc.round is None and n0.coord.generation() == 0
    assert not n0.sink.named("node_lost") and members(n0).loss(1, "inc1") is None


def test_a_node_lost_during_a_round_is_folded_into_it():
    (n0, n1), _ = cluster(2)
    n0.fault(1, generation=0, summary="bad batch")
    lose(n0, 1, "inc1")
    assert n0.inproc is not None and n0.inproc.round is not None
    assert n0.inproc.round.target == 1 and n0.inproc.round.folded == 1 and n0.coord.generation() == 1
    loss = members(n0).loss(1, "inc1")
    assert loss is not None and loss.generation == 1


def test_another_survivor_learns_the_loss_from_the_list_and_joins_the_round():
    (n0, n1, n2), _ = cluster(3)
    news = LossNews(2)
    assert tell(n2, news) == []
    lose(n0, 1, "inc1")                                                   # the store host declares it
    n2.clock.advance(0.5)
    assert tell(n2, news) == [("node_lost", (1, "inc1", "no lease renewal for 3.0s"))]
    assert n2.inproc is not None and n2.inproc.round is not None
    assert n2.inproc.round.target == 1 and n2.inproc.round.awaiting == {1: "inc1"}
    assert n2.coord.generation() == 1
    assert "by node 0" in n2.sink.named("node_lost")[0]["msg"]            # node 0's declaration won
    assert [x.by_node for x in members(n2).losses()] == [0]               # declared again: listed once
    assert tell(n2, news) == []


# ------------------------------------------------------------------ the node: a replacement
def replace(n0: Harness, store: KVStore, node: int = 1, incarnation: str = "inc1b") -> Harness:
    """The lost node's command started again: its rendezvous takes the rank over, then its Node starts."""
    rdzv_view = records_on(store)
    found = rdzv_view.vacancy(n0.cfg.nnodes)
    assert found is not None and found[:2] == (node, f"inc{node}")
    assert rdzv_view.take_over(node, found[1], incarnation)
    return Harness(n0.cfg, node_rank=node, store=store, incarnation=incarnation, replacing=found[2]).start()


def test_a_replacement_joins_the_survivors_generation_and_every_node_goes():
    (n0, n1), store = cluster(2)
    lose(n0, 1, "inc1")
    n0.ready_all(1)
    n0.tick()
    keep_beating(n0, 30)                                                  # the replacement starts later

    repl = replace(n0, store)
    replacing = repl.sink.named("replacing")[0]
    assert replacing["generation"] == 1 and "takes over node 1 (declared lost by node 0" in replacing["msg"]
    assert repl.launcher.spawned == [(0, 1, 30001, False), (1, 1, 30001, False)]   # generation 1's store
    assert repl.phase is Phase.RESTARTING and repl.inproc is not None and repl.inproc.round is not None
    assert repl.inproc.round.target == 1 and repl.state.generation == 1
    assert [p.rank for p in repl.procs.workers.values()] == [2, 3]
    repl.hello_all()
    assert not repl.control.of(P.Restart)                                 # they start in generation 1
    repl.sync()                                                           # the watcher's generation 1: no news
    assert repl.phase is Phase.RESTARTING and not repl.procs.signals

    n0.node.on_posted(("node_joined", (1, "inc1b")))
    assert n0.inproc is not None and n0.inproc.round is not None and n0.inproc.round.awaiting == {}
    assert n0.sink.named("node_replaced")[0]["node"] == 1
    repl.ready_all(1)
    n0.tick()
    assert n0.phase is Phase.RESTARTING and not go_messages(n0)           # node 1 not counted ready yet
    repl.tick()
    n0.tick()
    assert n0.phase is repl.phase is Phase.RUNNING
    assert [(m.generation, m.master_port) for m in go_messages(n0)] == [(1, 30001)] * 2
    assert [(m.generation, m.master_port) for m in go_messages(repl)] == [(1, 30001)] * 2
    assert "node 1 lost" in n0.sink.named("go")[0]["root_cause"]
    assert "node 1 lost" in repl.sink.named("go")[0]["root_cause"]
    assert "(node 0)" in repl.sink.named("go")[0]["root_cause"]           # the cause node 0 published
    assert n0.coord.failure() is None and not n0.sink.named("not_replaced")
    assert members(n0).vacancy(2) is None and members(n0).holder(1) == "inc1b"


def test_a_replacement_that_joins_late_gets_a_fresh_inprocess_timeout():
    (n0, n1), store = cluster(2)
    lose(n0, 1, "inc1")
    n0.ready_all(1)
    n0.tick()
    keep_beating(n0, REPLACE_TIMEOUT - 5)
    repl = replace(n0, store)
    n0.node.on_posted(("node_joined", (1, "inc1b")))
    keep_beating(n0, 30)                                                  # past --replace-timeout
    assert n0.phase is Phase.RESTARTING and not n0.sink.named("not_replaced")
    repl.hello_all()
    repl.ready_all(1)
    repl.tick()
    n0.tick()
    assert n0.phase is repl.phase is Phase.RUNNING and n0.state.generation == 1


def test_the_replaced_agent_is_fenced_on_its_next_store_write():
    (n0, n1), store = cluster(2)
    lose(n0, 1, "inc1")
    replace(n0, store)
    # the old agent of node 1 comes back (it was stopped): its rank's fault would start a round
    with pytest.raises(FencedError):
        n1.fault(0, generation=0)
    assert n1.coord.generation() == 1 and not prefixed(store).check([K.restart_claim(2)])
    n1.sync()                                                             # it learns of generation 1 ...
    n1.ready_all(1)
    with pytest.raises(FencedError):                                      # ... but may not count itself READY
        n1.tick()
    assert n0.coord.ready_count(1) == 0


# ------------------------------------------------------------------ the node: fenced
def test_a_fenced_node_stops_its_workers_and_exits_with_exit_fenced():
    (n0, n1), _ = cluster(2)
    n1.node.on_posted(("fenced", "other"))
    fenced = n1.sink.named("fenced")
    assert len(fenced) == 1 and fenced[0]["exit_code"] == EXIT_FENCED == 80 and "other" in fenced[0]["msg"]
    assert n1.phase is Phase.STOPPING and sorted(n1.procs.signals) == [(0, signal.SIGKILL), (1, signal.SIGKILL)]
    n1.settle()
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_FENCED
    # it changed nothing in the job: no failure, no generation, no marks
    assert n0.coord.failure() is None and n0.coord.generation() == 0 and n0.coord.done_count(0) == 0
    n1.node.on_posted(("fenced", "other"))                                # once done: nothing more
    assert len(n1.sink.named("fenced")) == 1


def test_a_fenced_node_in_a_round_stops_too():
    (n0, n1), _ = cluster(2)
    n1.fault(0, generation=0)
    assert n1.phase is Phase.RESTARTING
    n1.node.on_posted(("fenced", "other"))
    n1.settle()
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_FENCED and not go_messages(n1)


def test_a_fenced_node_stopping_for_a_restart_spawns_no_new_workers():
    (n0, n1), _ = cluster(2, inprocess_restart=False)
    n0.node.open_worker_store(1)                                          # generation 1's store is up
    n1.obey = False
    n1.node.on_posted(("generation", 1))                                  # process level: stop, then gen 1
    assert n1.phase is Phase.STOPPING and n1.state.stop is not None and n1.state.stop.action == "restart"
    n1.node.on_posted(("fenced", "other"))
    n1.obey = True
    n1.settle()
    assert [g for _, g, _, _ in n1.launcher.spawned] == [0, 0]            # no worker of generation 1
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_FENCED


def test_a_replaced_agent_cannot_end_the_job():
    (n0, n1), store = cluster(2)
    lose(n0, 1, "inc1")
    replace(n0, store)
    try:
        n1.fault(0, generation=0, retryable=False, exit_code=3)           # the old agent, come back
    except FencedError:
        pass                                                              # the agent's run() exits 80
    assert n0.coord.failure() is None


def test_a_replacement_is_not_ended_by_an_older_loss_of_another_node():
    (n0, n1, n2), store = cluster(3)
    news2 = LossNews(2)
    lose(n0, 1, "inc1")                                                   # node 1 lost ...
    tell(n2, news2)
    r1 = replace(n0, store, 1, "inc1b")                                   # ... and replaced
    n0.node.on_posted(("node_joined", (1, "inc1b")))
    tell(n2, news2)
    r1.hello_all()
    for h in (n0, n2, r1):
        h.ready_all(1)
    for h in (n0, n2, r1, n0, n2):
        h.tick()
    assert n0.phase is n2.phase is r1.phase is Phase.RUNNING and r1.state.generation == 1
    lose(n0, 2, "inc2")                                                   # later node 2 is lost ...
    r2 = replace(n0, store, 2, "inc2b")                                   # ... and its command started again
    assert r2.phase is Phase.RESTARTING and r2.state.generation == 2
    told = tell(r2, LossNews(2))                                          # its membership thread's first pass
    assert told == [], "a loss replaced before this agent joined is no news to it"
    r2.node.on_posted(("node_lost", (1, "inc1", "no lease renewal for 3.0s")))   # and were it told anyway
    assert r2.coord.failure() is None and r2.phase is Phase.RESTARTING


def test_hot_spares_are_listed_while_they_wait() -> None:
    raw = shared_store()
    a, b = records_on(raw), records_on(raw)
    assert a.spares() == []
    a.add_spare("s1", "hostA", 1.0)
    b.add_spare("s2", "hostB", 2.0)
    a.add_spare("s1", "hostA", 3.0)                                       # listed once
    assert [(x["incarnation"], x["host"]) for x in b.spares()] == [("s2", "hostB"), ("s1", "hostA")]
    b.remove_spare("s1")                                                  # it took over a node
    assert [x["incarnation"] for x in a.spares()] == ["s2"]
