"""The owner of the host-only duties: one agent watches every lease and declares the nodes lost.

Why: a node is lost when its lease stops moving, and somebody must notice. When an agent hosts the
coordination store (node 0 with --rdzv-backend static, the endpoint's host with c10d), that agent does it:
it reads the leases in-process, and it goes down with the store anyway. With a standalone coordinator or
etcd no agent hosts the store and any node may be lost. Were every agent to watch every lease, the store
would serve two reads per lease, per watcher, per lease period: 2*N*N - 200 million a second at 10,000
nodes renewing every second. Instead one agent, the *owner*, is elected through the store:

- the signed `member/owner` record (store_schema.Owner) names its node rank and incarnation; the owner
  watches every lease (membership.LeaseWatch) and declares the losses, as the store host does;
- every other agent renews its own lease, reads the list of declared losses, and watches one lease more:
  the owner's. Once that has not moved for --node-timeout on its own clock - or the owner's rank is held by
  another incarnation (declared lost, taken over) - it bids: it replaces the record it read by its own
  through compare-and-set (a CAS on a key, with etcd). The first bid wins; the others read the winner.
- the winner declares the old owner lost itself: the silence it saw is the one the owner's watch would have
  judged, so losing the owner's node takes no longer to notice than losing any other.

Per lease period the store then serves O(N) operations (about five per agent, two per node for the
owner), scripts/bench/control_plane.py measures it. Two owners for a moment (an owner stopped and resumed,
a coordinator that came back empty and had the record written back) are harmless: a declaration is
first-claim-wins, every agent tells each loss once (membership.once_each), and an agent that reads another
owner in the record steps down at its next pass.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.membership import LeaseWatch, MemberRecords
from hyperpodrun.agent.coordination.store_schema import NodeLease, Owner

log = logging.getLogger("hyperpodrun.agent")

#: a loss to declare: (node, incarnation, why), as membership's ("node_lost", ...) posts carry it
Lost = tuple[int, str, str]


@dataclass(frozen=True)
class Verdict:
    """What one look at the owner record says: this agent owns the duties; or it should bid for them (the
    owner is absent, or gone - `lost` then names the loss to declare should the bid win)."""

    owner: bool
    bid: bool = False
    lost: Optional[Lost] = None


class OwnerElection:
    """The pure part of the election: given the owner record and the owner's holder and lease as read now,
    whether this agent is the owner, or may bid. The owner's lease is judged as any lease is (LeaseWatch:
    it must move forward within --node-timeout on this agent's clock)."""

    def __init__(self, me: int, incarnation: str, timeout: float) -> None:
        self.me = Owner(node=me, incarnation=incarnation)
        self._watch = LeaseWatch(me, 0, timeout)

    def grace(self, now: float) -> None:
        """The store came back empty (a coordinator started again): the owner has a whole timeout to renew."""
        self._watch.grace(now)

    def observe(self, now: float, current: Optional[Owner], holder: Optional[str],
                lease: Optional[NodeLease]) -> Verdict:
        if current is None:
            return Verdict(owner=False, bid=True)
        if current == self.me:
            return Verdict(owner=True)
        if holder is not None and holder != current.incarnation:
            return Verdict(owner=False, bid=True)   # its rank was declared lost or taken over: no owner now
        events = self._watch.observe(now, {current.node: (holder, lease)})
        lost = next((value for kind, value in events if kind == "node_lost"), None)
        return Verdict(owner=False, bid=lost is not None,
                       lost=(int(lost[0]), str(lost[1]), str(lost[2])) if lost is not None else None)


class Ownership:
    """The election over one agent's membership records (its own store connection; one thread)."""

    def __init__(self, members: MemberRecords, election: OwnerElection, clock: Callable[[], float]) -> None:
        self.members = members
        self.election = election
        self._clock = clock

    def grace(self, now: float) -> None:
        self.election.grace(now)

    def current(self) -> Optional[Owner]:
        value = self.members.records.read(K.OWNER)
        return Owner.model_validate_json(value) if value else None

    def step(self, after_reads: Callable[[], object] = lambda: None) -> tuple[bool, Optional[Lost]]:
        """One look (and a bid when due): (this agent is the owner now, the old owner's loss to declare).
        `after_reads` runs between the reads and the verdict: Membership's check for a coordinator that came
        back empty meanwhile, which must give the owner's lease its grace before it is judged."""
        records = self.members.records
        seen = records.read(K.OWNER)
        current = Owner.model_validate_json(seen) if seen else None
        holder, lease = None, None
        if current is not None and current != self.election.me:
            holder, lease = self.members.holder(current.node), self.members.lease(current.node)
        after_reads()
        verdict = self.election.observe(self._clock(), current, holder, lease)
        if not verdict.bid:
            return verdict.owner, None
        mine = self.election.me.model_dump_json()
        won = records.update(K.OWNER, lambda now: mine if now in (seen, None) else now) == mine
        if won:
            log.info("node %d owns the job's lease watch now (%s)", self.election.me.node,
                     f"node {verdict.lost[0]} silent" if verdict.lost else "no live owner before")
        return won, verdict.lost if won else None


def electing(node: int, incarnation: str, timeout: float,
             clock: Callable[[], float] = time.monotonic) -> Callable[[MemberRecords], Ownership]:
    """What Membership takes as `elect`: this agent's part in the election, over the records it opens."""
    return lambda members: Ownership(members, OwnerElection(node, incarnation, timeout), clock)
