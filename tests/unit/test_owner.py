"""The owner of the host-only duties (agent/coordination/owner.py) on the fake clock: the pure election (who
owns, when to bid, whose loss the winner declares), the bid over torch's in-memory HashStore (first bid wins,
a late bid reads the winner), and the Membership loop of an agent with `elect` (it takes over from a silent
owner and declares it lost; while another owns the duties it reads no lease but the owner's).
Nothing here starts a process or a thread, opens a socket or sleeps."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from fakes import KEY, RUN, FakeClock, shared_store
from test_membership import Loops, lease, loss_of, prefixed, records_on, silent_for

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.membership import MemberRecords, Membership, tombstone
from hyperpodrun.agent.coordination.owner import OwnerElection, Ownership, Verdict, electing
from hyperpodrun.agent.coordination.signed_records import SignedRecords
from hyperpodrun.agent.coordination.store_schema import Owner
from hyperpodrun.agent.ports import KVStore, Posted

TIMEOUT = 3.0


# ------------------------------------------------------------------ the pure election
def test_no_owner_yet_means_a_bid_and_the_named_agent_owns():
    e = OwnerElection(1, "inc1", TIMEOUT)
    assert e.observe(0.0, None, None, None) == Verdict(owner=False, bid=True)
    assert e.observe(0.0, Owner(node=1, incarnation="inc1"), None, None) == Verdict(owner=True)


def test_an_owner_whose_lease_moves_is_followed_and_a_silent_one_is_outbid_with_its_loss():
    e = OwnerElection(2, "inc2", TIMEOUT)
    boss = Owner(node=0, incarnation="inc0")
    for t in range(10):                                  # renewing every second: followed for ever
        assert e.observe(float(t), boss, "inc0", lease("inc0", t + 1)) == Verdict(owner=False)
    verdicts = [e.observe(10.0 + t, boss, "inc0", lease("inc0", 10)) for t in range(3)]   # last moved at 9
    assert verdicts[:2] == [Verdict(owner=False)] * 2    # silent for less than the timeout
    assert verdicts[2] == Verdict(owner=False, bid=True, lost=(0, "inc0", silent_for(TIMEOUT)))


def test_an_owner_whose_rank_was_declared_lost_or_taken_over_is_no_owner():
    e = OwnerElection(2, "inc2", TIMEOUT)
    boss = Owner(node=0, incarnation="inc0")
    assert e.observe(0.0, boss, tombstone("inc0"), None) == Verdict(owner=False, bid=True)
    assert e.observe(0.0, boss, "inc7", lease("inc7", 3)) == Verdict(owner=False, bid=True)
    # a store that came back empty has no holder yet: the owner is given its timeout, not outbid at once
    assert e.observe(0.0, boss, None, None) == Verdict(owner=False)


def test_after_the_store_came_back_empty_the_owner_has_a_whole_timeout_again():
    e = OwnerElection(1, "inc1", TIMEOUT)
    boss = Owner(node=0, incarnation="inc0")
    e.observe(0.0, boss, "inc0", lease("inc0", 1))
    e.grace(2.5)
    assert e.observe(5.0, boss, "inc0", lease("inc0", 1)) == Verdict(owner=False)   # 2.5 s since the grace
    assert e.observe(5.5, boss, "inc0", lease("inc0", 1)).bid


# ------------------------------------------------------------------ bids over a store
def ownership(raw: KVStore, node: int, clock: FakeClock) -> Ownership:
    return Ownership(records_on(raw), OwnerElection(node, f"inc{node}", TIMEOUT), clock.monotonic)


def test_the_first_bid_wins_and_a_late_one_reads_the_winner():
    raw, clock = shared_store(), FakeClock()
    rec = records_on(raw)
    for n in range(3):
        assert rec.take_free(n, f"inc{n}")
    a, b, c = (ownership(raw, n, clock) for n in range(3))
    assert a.step() == (True, None)
    assert b.step() == (False, None) and c.step() == (False, None)
    assert a.current() == Owner(node=0, incarnation="inc0")
    rec.renew(0, "inc0", 1)
    # node 0 stops renewing: both others see it silent; the first bid wins, the other reads the winner
    steps_b, steps_c = [], []
    for _ in range(5):                                    # seen to move at 1001 s, silent from then on
        clock.advance(1.0)
        rec.renew(1, "inc1", 1)
        steps_b.append(b.step())
        steps_c.append(c.step())
    assert steps_b == [(False, None)] * 3 + [(True, (0, "inc0", silent_for(TIMEOUT))), (True, None)]
    assert steps_c == [(False, None)] * 5
    assert c.current() == Owner(node=1, incarnation="inc1")
    assert a.step() == (False, None)                      # the old owner, should it come back, steps down


def test_a_bid_never_replaces_an_owner_elected_meanwhile():
    raw, clock = shared_store(), FakeClock()
    rec = records_on(raw)
    for n in range(3):
        assert rec.take_free(n, f"inc{n}")
    rec.records.write(K.OWNER, Owner(node=0, incarnation="inc0").model_dump_json())
    rec.declare_lost(loss_of(0, "inc0"))                  # the owner's rank is tombstoned: a bid is due
    late = ownership(raw, 2, clock)
    real_update = late.members.records.update

    def elected_meanwhile(name: str, fn):  # type: ignore[no-untyped-def]
        rec.records.write(K.OWNER, Owner(node=1, incarnation="inc1").model_dump_json())
        return real_update(name, fn)
    late.members.records.update = elected_meanwhile      # type: ignore[method-assign]
    assert late.step() == (False, None)
    assert late.current() == Owner(node=1, incarnation="inc1")


# ------------------------------------------------------------------ the Membership loop with `elect`
class CountingStore:
    """A connection that notes each key it reads (check/get), to show what a non-owner reads."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.read: set[str] = set()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        attr = getattr(self.inner, name)
        if name in ("get", "check"):
            def noted(arg):  # type: ignore[no-untyped-def]
                self.read.update(arg if isinstance(arg, list) else [arg])
                return attr(arg)
            return noted
        return attr


def elected(raw: KVStore, node: int, nnodes: int, clock: FakeClock, posted: list[Posted], passes: Loops,
            store: Optional[KVStore] = None) -> Membership:
    m = Membership(lambda: store or prefixed(raw), lambda s: SignedRecords(s, KEY, RUN, lambda name: None),
                   posted.append, node=node, nnodes=nnodes, incarnation=f"inc{node}", node_timeout=TIMEOUT,
                   watch_all=False, news=True, elect=electing(node, f"inc{node}", TIMEOUT, clock.monotonic),
                   clock=clock.monotonic)
    setattr(m, "_halt", passes)
    return m


def test_an_agent_takes_over_from_a_silent_owner_declares_it_lost_and_watches_every_lease():
    raw, clock = shared_store(), FakeClock()
    rec = records_on(raw)
    for n in range(3):
        assert rec.take_free(n, f"inc{n}")
    rec.records.write(K.OWNER, Owner(node=0, incarnation="inc0").model_dump_json())

    def between(i: int) -> None:
        clock.advance(1.0)
        rec.renew(2, "inc2", i)                           # node 2 renews throughout
        if i <= 2:
            rec.renew(0, "inc0", i)                       # the owner renews twice, then its node is lost
    posted: list[Posted] = []
    elected(raw, 1, 3, clock, posted, Loops(12, between)).run()
    assert posted == [("owner", 1), ("node_lost", (0, "inc0", silent_for(TIMEOUT)))]
    assert ownership(raw, 2, clock).current() == Owner(node=1, incarnation="inc1")


def test_a_follower_reads_no_lease_but_the_owners():
    raw, clock = shared_store(), FakeClock()
    rec = records_on(raw)
    nnodes = 6
    for n in range(nnodes):
        assert rec.take_free(n, f"inc{n}")
    rec.records.write(K.OWNER, Owner(node=0, incarnation="inc0").model_dump_json())

    def between(i: int) -> None:
        clock.advance(1.0)
        rec.renew(0, "inc0", i)
    counting = CountingStore(dist.PrefixStore(K.run_prefix(RUN), raw))
    posted: list[Posted] = []
    elected(raw, 3, nnodes, clock, posted, Loops(6, between), store=counting).run()   # type: ignore[arg-type]
    assert posted == []
    leases = {k for k in counting.read if k.endswith("/lease")}
    holders = {k for k in counting.read if k.endswith("/holder")}
    assert leases == {K.node_lease(0)} and holders == {K.node_holder(0), K.node_holder(3)}


def test_the_owner_that_reads_another_owner_stops_watching():
    raw, clock = shared_store(), FakeClock()
    rec = records_on(raw)
    for n in range(3):
        assert rec.take_free(n, f"inc{n}")
    rec.renew(2, "inc2", 1)                               # node 2 renewed once, then went silent

    def between(i: int) -> None:
        clock.advance(1.0)
        if i == 1:                                        # another agent's bid won meanwhile (a stopped owner)
            rec.records.write(K.OWNER, Owner(node=0, incarnation="inc0").model_dump_json())
        rec.renew(0, "inc0", i)
    posted: list[Posted] = []
    elected(raw, 1, 3, clock, posted, Loops(20, between)).run()
    assert posted == [("owner", 1)]                        # no verdict on node 2: that is node 0's now
    assert MemberRecords(SignedRecords(prefixed(raw), KEY, RUN, lambda n: None)).holder(2) == "inc2"
