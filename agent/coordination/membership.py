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

Records (agent/coordination/store_schema.py): holder, lease (NodeLease), lost (NodeLoss, first claim wins). All signed
with the job's key, as every record that changes the job's fate (agent/coordination/job_state.py).
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.signed_records import SignedRecords
from hyperpodrun.agent.ports import KVStore, Posted
from hyperpodrun.agent.coordination.store_schema import NodeLease, NodeLoss

log = logging.getLogger("hyperpodrun.agent")


#: a holder that never renewed its lease is lost after this many --node-timeout (it may be slow to start)
NEVER_RENEWED_FACTOR = 3


#: the holder record of a node rank whose incarnation was declared lost: "lost:<incarnation>"
TOMBSTONE = "lost:"


def tombstone(incarnation: str) -> str:
    return TOMBSTONE + incarnation


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
        another newcomer was faster (or `lost` is not the last holder any more)."""
        if self.loss(node, lost) is None:
            return False
        won = self.records.update(K.node_holder(node),
                                  lambda cur: incarnation if cur in (lost, tombstone(lost)) else (cur or ""))
        return won == incarnation

    def take_unused(self, node: int, incarnation: str) -> bool:
        """Elastic: hold node rank `node`, which the job does not use (never held, or dropped when it shrank)."""
        won = self.records.update(K.node_holder(node), lambda cur: incarnation
                                  if not cur or cur.startswith(K.node_dropped("")) else cur)
        return won == incarnation

    def drop(self, node: int, incarnation: str) -> bool:
        """Elastic shrink: node rank `node`, lost as `incarnation`, is no longer taken over (its tombstone
        becomes `dropped:`); False when a replacement holds it already."""
        dropped = K.node_dropped(incarnation)
        won = self.records.update(K.node_holder(node), lambda cur: dropped if cur in (tombstone(incarnation), dropped)
                                  else (cur or ""))
        return won == dropped

    # ------------------------------------------------------------ leases
    def renew(self, node: int, incarnation: str, count: int) -> None:
        self.records.write(K.node_lease(node), NodeLease(incarnation=incarnation, count=count).model_dump_json())

    def lease(self, node: int) -> Optional[NodeLease]:
        value = self.records.read(K.node_lease(node))
        return NodeLease.model_validate_json(value) if value is not None else None

    # ------------------------------------------------------------ losses
    def declare_lost(self, loss: NodeLoss) -> NodeLoss:
        """Record that `loss.incarnation` of node `loss.node` is lost (the first declaration wins; returned):
        the holder record becomes its tombstone - so that incarnation, should it come back, is fenced even
        before a replacement arrives, and the rank is vacant - and the loss is added to the list the agents
        that do not watch every lease read."""
        won = self.records.claim(K.node_lost(loss.node, loss.incarnation), loss.model_dump_json())
        loss = NodeLoss.model_validate_json(won) if won is not None else loss
        self.records.update(K.node_holder(loss.node),
                            lambda cur: tombstone(loss.incarnation) if cur == loss.incarnation else (cur or ""))

        def listed(current: Optional[str]) -> str:
            losses = json.loads(current) if current else []
            if not any(x.get("node") == loss.node and x.get("incarnation") == loss.incarnation for x in losses):
                losses.append(loss.model_dump())
            return json.dumps(losses)
        self.records.update(K.NODE_LOSSES, listed)
        return loss

    def loss(self, node: int, incarnation: str) -> Optional[NodeLoss]:
        value = self.records.read(K.node_lost(node, incarnation))
        return NodeLoss.model_validate_json(value) if value is not None else None

    def losses(self) -> list[NodeLoss]:
        """Every node loss declared so far (one record, whatever the job's size)."""
        value = self.records.read(K.NODE_LOSSES)
        return [NodeLoss.model_validate(x) for x in json.loads(value)] if value else []

    # ------------------------------------------------------------ hot spares
    def add_spare(self, incarnation: str, host: str, since: float) -> None:
        """This agent waits as a hot spare (listed, so the event log of the job can name it)."""
        def add(current: Optional[str]) -> str:
            spares = [x for x in (json.loads(current) if current else []) if x.get("incarnation") != incarnation]
            return json.dumps([*spares, {"incarnation": incarnation, "host": host, "since": since}])
        self.records.update(K.SPARES, add)

    def remove_spare(self, incarnation: str) -> None:
        def remove(current: Optional[str]) -> str:
            return json.dumps([x for x in (json.loads(current) if current else [])
                               if x.get("incarnation") != incarnation])
        self.records.update(K.SPARES, remove)

    def spares(self) -> list[dict[str, Any]]:
        value = self.records.read(K.SPARES)
        return list(json.loads(value)) if value else []

    def vacancy(self, nnodes: int) -> Optional[tuple[int, str, NodeLoss]]:
        """A node rank whose holder was declared lost and not yet replaced: (node, lost incarnation, loss)."""
        for node in range(nnodes):
            holder = self.holder(node)
            if holder:
                lost = holder.removeprefix(TOMBSTONE)
                loss = self.loss(node, lost)
                if loss is not None:
                    return node, lost, loss
        return None


class Elector(Protocol):
    """The owner election an agent takes part in when no agent hosts the store (agent/coordination/owner.py)."""

    def step(self, after_reads: Callable[[], object]) -> tuple[bool, Optional[tuple[int, str, str]]]: ...

    def grace(self, now: float) -> None: ...


class Membership(threading.Thread):
    """Renews this node's lease and learns of lost and replaced nodes, over its own store connection; posts:

    ("node_lost", (node, incarnation, why))  a node was lost (its lease stopped moving for --node-timeout)
    ("node_joined", (node, incarnation))     another incarnation now holds a lost node's rank (a replacement)
    ("fenced", incarnation)                  this node's rank is held by another incarnation: leave
    ("spare", (incarnation, host))           a hot spare waits (store host only)
    ("node_joining", (node, NodeJoin))       an elastic newcomer holds unused node rank `node` (store host only)

    ("owner", node)                          this agent was elected to watch every lease (`elect` only)

    Only one agent reads every lease and declares the losses (agent/node.py): the one that hosts the
    coordination store (`watch_all`) - locally, as its store is in-process - or, with a standalone
    coordinator or etcd (`elect`), the owner elected through the store (agent/coordination/owner.py), which
    also follows the declared losses (`news`: it may have been elected after some). Every other agent reads
    the list of declared losses (and, with `elect`, the owner's record and lease), so the store's load per
    renewal interval grows with the number of nodes, not its square.
    """

    def __init__(self, open_store: Callable[[], KVStore], records: Callable[[KVStore], SignedRecords],
                 post: Callable[[Posted], None], *, node: int, nnodes: int, incarnation: str,
                 node_timeout: float, watch_all: bool, clock: Callable[[], float] = time.monotonic,
                 nodes: Optional[Callable[[], Sequence[int]]] = None, elastic: bool = False,
                 news: bool = False, elect: Optional[Callable[[MemberRecords], Elector]] = None,
                 reconnects: Optional[Callable[[], int]] = None) -> None:
        super().__init__(name="hyperpodrun-membership", daemon=True)
        self._open_store = open_store
        self._records = records
        self._post = post
        self.node = node
        self.nnodes = nnodes                # the most nodes (MAX of an elastic --nnodes)
        self.nodes = nodes or (lambda: range(nnodes))   # the node ranks of the job now
        self.elastic = elastic
        self.incarnation = incarnation
        self.timeout = node_timeout
        self.watch_all = watch_all
        self.news = news                    # while watching: follow the declared losses too (coordinator)
        self.elect = elect                  # no agent hosts the store: watch every lease while elected owner
        self.interval = lease_interval(node_timeout)
        self._clock = clock
        # how many times a standalone coordinator came back empty (agent/coordination/reconnect.py): each time,
        # every lease vanished with it and none could be renewed meanwhile - the watch starts over
        self._reconnects = reconnects or (lambda: 0)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            members = MemberRecords(self._records(self._open_store()))
        except Exception as exc:  # the loop learns of a lost store from the watcher
            log.debug("membership: no store connection (%s)", exc)
            return
        watch = LeaseWatch(self.node, self.nnodes, self.timeout) if self.watch_all else None
        election = self.elect(members) if self.elect is not None else None
        told = LossNews(self.node)
        spares_told: set[Any] = set()
        joins_told: set[tuple[int, str]] = set()
        once: set[tuple[Any, ...]] = set()
        count, restarts = 0, self._reconnects()

        def reconnected() -> None:
            """Called after the reads that may have reconnected: a store that came back empty meanwhile gives
            every lease a whole timeout again (LeaseWatch.grace), the owner's included."""
            nonlocal restarts
            if self._reconnects() != restarts:
                restarts = self._reconnects()
                for w in (watch, election):
                    if w is not None:
                        w.grace(self._clock())
        while not self._halt.is_set():
            try:
                holder = members.holder(self.node)
                if holder is not None and holder != self.incarnation:
                    self._post(("fenced", holder))
                    return                      # and renew nothing: the rank is someone else's now
                count += 1
                members.renew(self.node, self.incarnation, count)
                events: list[Posted] = []
                if election is not None:
                    owner, lost = election.step(reconnected)
                    if owner and watch is None:       # elected: watch every lease from now on
                        watch = LeaseWatch(self.node, self.nnodes, self.timeout)
                        events.append(("owner", self.node))
                    elif not owner:
                        watch = None                  # another agent owns the duties (or took them over)
                    if lost is not None:              # the old owner's lease stopped moving: its loss
                        events.append(("node_lost", lost))
                if watch is not None:
                    nodes = list(self.nodes())
                    state = {n: (members.holder(n), members.lease(n)) for n in nodes if n != self.node}
                    reconnected()
                    events += watch.observe(self._clock(), state)
                    if self.elastic:
                        events += self._joining(members, nodes, joins_told)
                    for spare in members.spares():
                        if spare.get("incarnation") not in spares_told:
                            spares_told.add(spare.get("incarnation"))
                            events.append(("spare", (spare.get("incarnation"), spare.get("host"))))
                if watch is None or self.news:
                    events += told.observe(members.losses(), members.holder)
                for event in once_each(events, once):
                    self._post(event)
            except Exception as exc:  # the store host is gone: the watcher reports it; stop renewing
                log.debug("membership: store unreachable (%s)", exc)
                return
            self._halt.wait(self.interval)

    def _joining(self, members: MemberRecords, nodes: list[int], told: set[tuple[int, str]]) -> list[Posted]:
        """Newcomers of an elastic job: an unused node rank held by the incarnation that asked to join."""
        from hyperpodrun.agent.coordination.layout import LayoutRecords, free_ranks
        layouts = LayoutRecords(members.records)
        events: list[Posted] = []
        for n in free_ranks(nodes, self.nnodes):
            join = layouts.join_request(n)
            if join is not None and (n, join.incarnation) not in told and members.holder(n) == join.incarnation:
                told.add((n, join.incarnation))
                events.append(("node_joining", (n, join)))
        return events


def once_each(events: list[Posted], told: set[tuple[Any, ...]]) -> list[Posted]:
    """`events` less the node losses and replacements already in `told` (noted there): an agent that both
    watches the leases and follows the declared losses hears of each loss once, whoever declared it."""
    out: list[Posted] = []
    for kind, value in events:
        key = (kind, *value[:2]) if kind in ("node_lost", "node_joined") else None
        if key is not None and key in told:
            continue
        if key is not None:
            told.add(key)
        out.append((kind, value))
    return out


class LossNews:
    """The pure part of following the declared losses (agents that do not watch every lease): each loss is
    told once, and so is its replacement, once another incarnation holds the node rank."""

    def __init__(self, me: int) -> None:
        self.me = me
        self._told: set[tuple[int, str]] = set()
        self._replaced: set[tuple[int, str]] = set()
        self._first = True

    def observe(self, losses: list[NodeLoss], holder: Callable[[int], Optional[str]]) -> list[Posted]:
        events: list[Posted] = []
        first, self._first = self._first, False
        for loss in losses:
            key = (loss.node, loss.incarnation)
            if loss.node == self.me:
                continue
            now = holder(loss.node) if key not in self._replaced else None
            replaced = bool(now) and now not in (loss.incarnation, tombstone(loss.incarnation))
            if first and replaced:   # over before this agent joined (it may be a replacement itself): no news
                self._told.add(key)
                self._replaced.add(key)
                continue
            if key not in self._told:
                self._told.add(key)
                events.append(("node_lost", (loss.node, loss.incarnation, loss.why)))
            if replaced and key not in self._replaced:
                self._replaced.add(key)
                events.append(("node_joined", (loss.node, now)))
        return events


class LeaseWatch:
    """The pure part of watching leases: given what the store says now, which nodes became lost or were
    replaced. A lease is judged by whether it *moved* since this observer last saw it move - forward: a renewal
    counts only when its count exceeds the highest this observer has seen for that incarnation. Lease records
    are signed, not fresh: anyone who can write the store could replay a dead node's own old records (count 5,
    6, 5, 6, ...), and "any change" would keep that node alive for ever."""

    def __init__(self, me: int, nnodes: int, timeout: float) -> None:
        self.me = me
        self.nnodes = nnodes
        self.timeout = timeout
        self._seen: dict[int, tuple[Optional[str], Optional[tuple[str, int]], float]] = {}
        self._reported: set[tuple[int, str]] = set()
        self._highest: dict[str, int] = {}   # incarnation -> the highest lease count seen

    def _forward(self, key: Optional[tuple[str, int]]) -> bool:
        """Whether lease `key` (incarnation, count) is past every count seen for its incarnation (and note it)."""
        if key is None:
            return False
        incarnation, count = key
        if count <= self._highest.get(incarnation, -1):
            return False
        self._highest[incarnation] = count
        return True

    def grace(self, now: float) -> None:
        """The coordination store came back empty (a standalone coordinator started again): every lease vanished
        with it, and none could be renewed while it was away - each node's silence counts from `now`, so
        every node has a whole timeout to renew into the new store before it may be declared lost."""
        for node, (holder, key, _since) in self._seen.items():
            self._seen[node] = (holder, key, now)

    def observe(self, now: float, state: dict[int, tuple[Optional[str], Optional[NodeLease]]]) -> list[Posted]:
        events: list[Posted] = []
        for node, (holder, lease) in state.items():
            key = (lease.incarnation, lease.count) if lease is not None else None
            forward = self._forward(key)
            prev = self._seen.get(node)
            if prev is None:
                self._seen[node] = (holder, key, now)
                continue
            prev_holder, prev_key, since = prev
            if holder != prev_holder:
                self._seen[node] = (holder, key, now)
                if prev_holder is not None and holder and not holder.startswith(TOMBSTONE):
                    events.append(("node_joined", (node, holder)))
                continue
            if not holder or holder.startswith(TOMBSTONE):
                continue   # declared lost already: nothing to watch until someone takes the rank
            if forward and key is not None and key[0] == holder:   # the holder's own lease, moved on
                self._seen[node] = (holder, key, now)
                continue
            silent = now - since
            # a holder that has not renewed even once (it died right after its rendezvous or take-over, or is
            # slow to start renewing) is given NEVER_RENEWED_FACTOR times the timeout
            renewed = key is not None and key[0] == holder
            limit = self.timeout if renewed else NEVER_RENEWED_FACTOR * self.timeout
            if holder is not None and silent >= limit and (node, holder) not in self._reported:
                self._reported.add((node, holder))
                events.append(("node_lost", (node, holder, f"no lease renewal for {silent:.1f}s")))
        return events
