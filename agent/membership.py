"""Node membership: who holds each node rank, whether that agent is alive, and taking over a lost node's rank.

Why: a whole node can vanish (host crash, kernel panic, a GPU off the bus, a NIC): its agent, its workers and
its shared memory go at once, and nobody is left to report it. Each agent therefore holds a *lease* in the
coordination store and renews it; an agent whose lease stops moving for --node-timeout seconds (measured on
the observer's own monotonic clock, so clocks need not agree) is declared lost. The survivors then run the
in-process round as for any fault, and wait up to --replace-timeout for a *replacement*: the lost node's
command started again, or an agent already waiting as a hot spare, takes over the node rank at the
generation the survivors moved to (docs/ARCHITECTURE.md, "Node loss").

Who holds a node rank is the signed `member/<n>/holder` record: a random *incarnation* token per agent start.
A newcomer takes the rank only from an incarnation that was declared lost (compare-and-set), so two live
agents never hold one rank, and an agent that was declared lost and comes back (SIGSTOPped, partitioned)
sees another incarnation holding its rank: it is *fenced* - it writes nothing more and leaves with one line.

Records (agent/store_schema.py): holder, lease (NodeLease), lost (NodeLoss, first claim wins). All signed
with the job's key, as every record that changes the job's fate (agent/coordination.py).
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Optional

from hyperpodrun.agent import store_schema as K
from hyperpodrun.agent.coordination import SignedRecords
from hyperpodrun.agent.ports import KVStore, Posted
from hyperpodrun.agent.store_schema import NodeLease, NodeLoss

log = logging.getLogger("hyperpodrun.agent")


def new_incarnation() -> str:
    """A token naming this agent's start (a replacement on the same host has another one)."""
    return secrets.token_hex(8)


def lease_interval(node_timeout: float) -> float:
    """How often a lease is renewed and watched: a fifth of --node-timeout, between 0.1 and 1 s."""
    return min(1.0, max(0.1, node_timeout / 5))


class MemberRecords:
    """The membership records of one run, over one store connection (not thread-safe: one per thread)."""

    def __init__(self, records: SignedRecords) -> None:
        self.records = records

    # ------------------------------------------------------------ holders
    def holder(self, node: int) -> Optional[str]:
        return self.records.read(K.node_holder(node))

    def take_free(self, node: int, incarnation: str) -> bool:
        """Hold node rank `node` when nobody has held it yet (the job's first start)."""
        return self.records.claim(K.node_holder(node), incarnation) == incarnation

    def take_over(self, node: int, lost: str, incarnation: str) -> bool:
        """Hold node rank `node` in place of incarnation `lost`, which must have been declared lost; False when
        another newcomer was faster (or `lost` is not the holder any more)."""
        if self.loss(node, lost) is None:
            return False
        won = self.records.update(K.node_holder(node), lambda cur: incarnation if cur == lost else (cur or ""))
        return won == incarnation

    # ------------------------------------------------------------ leases
    def renew(self, node: int, incarnation: str, count: int) -> None:
        self.records.write(K.node_lease(node), NodeLease(incarnation=incarnation, count=count).model_dump_json())

    def lease(self, node: int) -> Optional[NodeLease]:
        value = self.records.read(K.node_lease(node))
        return NodeLease.model_validate_json(value) if value is not None else None

    # ------------------------------------------------------------ losses
    def declare_lost(self, loss: NodeLoss) -> NodeLoss:
        """Record that `loss.incarnation` of node `loss.node` is lost (the first declaration wins; returned)."""
        won = self.records.claim(K.node_lost(loss.node, loss.incarnation), loss.model_dump_json())
        return NodeLoss.model_validate_json(won) if won is not None else loss

    def loss(self, node: int, incarnation: str) -> Optional[NodeLoss]:
        value = self.records.read(K.node_lost(node, incarnation))
        return NodeLoss.model_validate_json(value) if value is not None else None

    def vacancy(self, nnodes: int) -> Optional[tuple[int, str, NodeLoss]]:
        """A node rank whose holder was declared lost and not yet replaced: (node, lost incarnation, loss)."""
        for node in range(nnodes):
            holder = self.holder(node)
            if holder:
                loss = self.loss(node, holder)
                if loss is not None:
                    return node, holder, loss
        return None


class Membership(threading.Thread):
    """Renews this node's lease and watches the others' over its own store connection; posts to the loop:

    ("node_lost", (node, incarnation, silent_s))  a node's lease stopped moving for --node-timeout
    ("node_joined", (node, incarnation))         another incarnation now holds a node rank (a replacement)
    ("fenced", incarnation)                      this node's rank is held by another incarnation: leave
    """

    def __init__(self, open_store: Callable[[], KVStore], records: Callable[[KVStore], SignedRecords],
                 post: Callable[[Posted], None], *, node: int, nnodes: int, incarnation: str,
                 node_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="hyperpodrun-membership", daemon=True)
        self._open_store = open_store
        self._records = records
        self._post = post
        self.node = node
        self.nnodes = nnodes
        self.incarnation = incarnation
        self.timeout = node_timeout
        self.interval = lease_interval(node_timeout)
        self._clock = clock
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            members = MemberRecords(self._records(self._open_store()))
        except Exception as exc:  # the loop learns of a lost store from the watcher
            log.debug("membership: no store connection (%s)", exc)
            return
        watch = LeaseWatch(self.node, self.nnodes, self.timeout)
        count = 0
        while not self._stop.is_set():
            try:
                holder = members.holder(self.node)
                if holder is not None and holder != self.incarnation:
                    self._post(("fenced", holder))
                    return                      # and renew nothing: the rank is someone else's now
                count += 1
                members.renew(self.node, self.incarnation, count)
                for event in watch.observe(self._clock(), {n: (members.holder(n), members.lease(n))
                                                           for n in range(self.nnodes) if n != self.node}):
                    self._post(event)
            except Exception as exc:  # the store host is gone: the watcher reports it; stop renewing
                log.debug("membership: store unreachable (%s)", exc)
                return
            self._stop.wait(self.interval)


class LeaseWatch:
    """The pure part of watching leases: given what the store says now, which nodes became lost or were
    replaced. A lease is judged by whether it *moved* since this observer last saw it move."""

    def __init__(self, me: int, nnodes: int, timeout: float) -> None:
        self.me = me
        self.nnodes = nnodes
        self.timeout = timeout
        self._seen: dict[int, tuple[Optional[str], Optional[tuple[str, int]], float]] = {}
        self._reported: set[tuple[int, str]] = set()

    def observe(self, now: float, state: dict[int, tuple[Optional[str], Optional[NodeLease]]]) -> list[Posted]:
        events: list[Posted] = []
        for node, (holder, lease) in state.items():
            key = (lease.incarnation, lease.count) if lease is not None else None
            prev = self._seen.get(node)
            if prev is None:
                self._seen[node] = (holder, key, now)
                continue
            prev_holder, prev_key, since = prev
            if holder != prev_holder:
                self._seen[node] = (holder, key, now)
                if prev_holder is not None and holder is not None:
                    events.append(("node_joined", (node, holder)))
                continue
            if key != prev_key:
                self._seen[node] = (holder, key, now)
                continue
            silent = now - since
            # only a lease that was renewed at least once can stop: an agent still in its pre-train script, or
            # not yet past its rendezvous, has not started renewing
            if holder is not None and key is not None and key[0] == holder and silent >= self.timeout \
                    and (node, holder) not in self._reported:
                self._reported.add((node, holder))
                events.append(("node_lost", (node, holder, silent)))
        return events
