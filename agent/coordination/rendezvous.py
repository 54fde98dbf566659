"""Node rendezvous with a fixed number of nodes: `local`, `static` and `c10d`, handlers in a registry.

static: `--nnodes N --node-rank i --master-addr A --master-port P`; node 0 serves the coordination store
        at A:P. c10d: `--rdzv-endpoint H:P --nnodes N`; the agent on H serves the store, node ranks are
        handed out in join order. Either way the agents then agree on each node's worker count, so global
        ranks are assigned node by node, as torchrun does.

Before joining, the agents settle the job secret (hyperpodrun/auth.py): the user's (the same on every node,
checked here through an HMAC of the run id, never the secret itself), or, without one, a random one the
first agent puts in the store - which then protects nothing from whoever can reach the store, and the
agent says so once.

Each backend implements the Rendezvous port (agent/ports.py) and is registered under its name
(`register_backend`); `rendezvous()` picks "local" for a single node, else `--rdzv-backend`. A new backend
(dynamic membership, a Kubernetes one) is one more registration (docs/ARCHITECTURE.md, "Ports").
"""
from __future__ import annotations

import abc
import importlib
import json
import logging
from dataclasses import dataclass
import socket
import time
import uuid
from datetime import timedelta
from typing import Callable, NamedTuple, Optional

from hyperpodrun import auth, netaddr
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination import stores
from hyperpodrun.agent.coordination.coordinator import is_coordinator
from hyperpodrun.agent.coordination.signed_records import SignedRecords, agree_secret
from hyperpodrun.agent.coordination.layout import LayoutRecords, free_ranks
from hyperpodrun.agent.coordination.membership import MemberRecords, lease_interval, new_incarnation
from hyperpodrun.agent.coordination.reconnect import CoordinatorLink, coordinator_link
from hyperpodrun.agent.coordination.resupply import Resupply
from hyperpodrun.agent.ports import KVStore, Rendezvous, RendezvousInfo, StoreLink
from hyperpodrun.agent.coordination.store_schema import Layout, NodeJoin, NodeLoss
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import HyperpodrunError, RendezvousError

log = logging.getLogger("hyperpodrun.agent")


def hostname() -> str:
    return socket.gethostname()


class RendezvousInterrupted(HyperpodrunError):
    """The agent was told to stop (a signal) while it waited for the other nodes."""


class JobOver(HyperpodrunError):
    """A hot spare (or late replacement) found the job already ended: nothing to take over."""


@dataclass(frozen=True)
class Seat:
    """Where an agent sits in the job: its node rank, and how it got it - at the job's start (neither set),
    in place of a lost node (`replacing`), or as a node an elastic job grew by (`admitted`)."""

    node: int
    replacing: Optional[NodeLoss] = None
    admitted: Optional[Layout] = None


class Connected(NamedTuple):
    """A coordination store reached: (the run's store, this agent serves it, a standalone coordinator or etcd
    serves it - no agent does, the address this agent's store servers listen on, host, port, the link of
    connections that outlive an outage)."""

    store: KVStore
    serve: bool
    coordinator: bool
    bind: str
    host: str
    port: int
    link: Optional[StoreLink]


#: rendezvous backends by name: a factory each (the Rendezvous port)
_BACKENDS: dict[str, Callable[[], Rendezvous]] = {}


def register_backend(name: str, factory: Callable[[], Rendezvous]) -> None:
    """Make `name` a rendezvous backend (the name `--rdzv-backend` takes; "local" is the single-node one)."""
    _BACKENDS[name] = factory


def backend_for(cfg: LaunchConfig) -> Rendezvous:
    """The handler of this launch: "local" on a single node, else the one --rdzv-backend names."""
    name = "local" if cfg.single_node else cfg.rdzv_backend
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise RendezvousError(f"unknown rendezvous backend {name!r}; known: {', '.join(sorted(_BACKENDS))}") from None


def rendezvous(cfg: LaunchConfig, stop_requested: Optional[Callable[[], bool]] = None,
               on_standby: Optional[Callable[[], None]] = None) -> RendezvousInfo:
    """Meet the other agents (or not, on one node) and return this node's place in the job.

    While waiting for the other nodes, `stop_requested()` is polled so a signal ends the wait at once.
    `on_standby()` is called once when this agent starts to wait for a place in a running job (a hot spare, a
    replacement, an elastic newcomer): it may prepare its workers meanwhile (backends that have such waits
    take it as their `on_standby` attribute)."""
    backend = backend_for(cfg)
    if on_standby is not None and hasattr(backend, "on_standby"):
        setattr(backend, "on_standby", on_standby)
    return backend.join(cfg, stop_requested or (lambda: False))


class LocalRendezvous:
    """One node: an in-memory coordination store, nothing to wait for."""

    def join(self, cfg: LaunchConfig, stop_requested: Callable[[], bool]) -> RendezvousInfo:
        run_id = str(uuid.uuid4()) if cfg.rdzv_id == "none" else cfg.rdzv_id
        # the workers' store listens on loopback only; MASTER_ADDR must lead there (docs/security.md)
        return RendezvousInfo(node_rank=0, nnodes=1, rank_offset=0, world_size=cfg.nproc_per_node, run_id=run_id,
                              master_addr=netaddr.single_node_master(cfg.master_addr),
                              store=stores.prefixed(K.run_prefix(run_id), stores.local_store()),
                              store_host=True, store_endpoint=None, single_node=True,
                              bind_addr=netaddr.single_node_bind(cfg.master_addr),
                              secret=auth.job_secret(cfg.job_secret_file) or auth.new_secret())


class _StoreRendezvous(abc.ABC):
    """Several nodes meeting through a TCP coordination store: settle the job secret, take a node rank, say
    how many workers this node runs, wait until every node has joined. Subclasses say who serves the store
    and how node ranks are handed out."""

    def __init__(self) -> None:
        self.on_standby: Callable[[], None] = lambda: None   # called once before a wait for a place (rendezvous())

    @abc.abstractmethod
    def open_store(self, cfg: LaunchConfig) -> tuple[KVStore, bool, str, str, int]:
        """-> (raw store, this agent serves it, the address it listens on or "", host, port)."""

    @abc.abstractmethod
    def node_rank(self, store: KVStore, cfg: LaunchConfig, members: MemberRecords, incarnation: str,
                  stop_requested: Callable[[], bool]) -> Seat:
        """This node's seat in the job: its rank (0..nnodes-1), taken through the store and held by
        `incarnation`, and whether it replaces a lost node or was admitted to a running elastic job."""

    def connect(self, cfg: LaunchConfig) -> Connected:
        """The run's coordination store, and who serves it: this agent, another agent, or a standalone
        coordinator (then every connection reconnects should it be started again: agent/coordination/reconnect.py)."""
        run_id = cfg.rdzv_id
        raw, serve, bind, host, port = self.open_store(cfg)
        coordinator = not serve and is_coordinator(raw)
        if coordinator:
            if cfg.elastic:
                raise RendezvousError(f"{host}:{port} is a standalone coordinator, which does not run elastic jobs "
                                      f"(--nnodes {cfg.min_nnodes}:{cfg.nnodes}) yet; give --nnodes N, or let an "
                                      "agent host the store (no coordinator at that endpoint)")
            # no agent hosts the store: each serves the workers' stores it claims, on its address towards it
            bind = netaddr.multi_node_bind(host, cfg.local_addr)
            log.info("the coordination store at %s:%d is a standalone coordinator: this agent hosts none", host, port)
        link = coordinator_link(host, port, run_id, raw, cfg.coordinator_timeout) if coordinator else None
        store = stores.prefixed(K.run_prefix(run_id), raw)
        return Connected(link.connect(store) if link is not None else store, serve, coordinator, bind, host, port, link)

    def join(self, cfg: LaunchConfig, stop_requested: Callable[[], bool]) -> RendezvousInfo:
        run_id = cfg.rdzv_id
        store, serve, coordinator, bind, host, port, link = self.connect(cfg)
        store.set_timeout(timedelta(seconds=cfg.join_timeout))
        secret, warning = agree_secret(store, auth.job_secret(cfg.job_secret_file), run_id,
                                       link.where if link is not None else f"{host}:{port}")
        if isinstance(link, CoordinatorLink):   # what it wrote and saw goes back into a coordinator started again
            link.resupply = Resupply(auth.derive(secret, "store"), run_id)
        records = SignedRecords(store, auth.derive(secret, "store"), run_id, forged=lambda name: None)
        members = MemberRecords(records)
        incarnation = new_incarnation()
        seat = self.node_rank(store, cfg, members, incarnation, stop_requested)
        node_rank = seat.node
        layout = seat.admitted or LayoutRecords(records).latest()
        if layout is not None:      # the job's nodes changed since it formed (elastic): run on the newest layout
            counts = dict(layout.nodes)
        else:
            size = int(store.get(K.RDZV_SIZE)) if cfg.elastic else cfg.nnodes
            listed = None if cfg.elastic or not store.check([K.RDZV_NPROCS]) else json.loads(store.get(K.RDZV_NPROCS))
            counts = {i: int(listed[i]) if listed else int(store.get(K.rdzv_nproc(i))) for i in range(size)}
        if seat.replacing is not None and counts.get(node_rank) != cfg.nproc_per_node:
            raise RendezvousError(f"this agent replaces node {node_rank}, which ran {counts.get(node_rank)} "
                                  f"worker(s); start it with --nproc-per-node {counts.get(node_rank)}")
        offset = sum(n for k, n in counts.items() if k < node_rank)
        return RendezvousInfo(node_rank=node_rank, nnodes=len(counts), rank_offset=offset,
                              world_size=sum(counts.values()), run_id=run_id, master_addr=host, store=store,
                              store_host=serve, store_endpoint=(host, port), single_node=False, bind_addr=bind,
                              secret=secret, secret_warning=warning, incarnation=incarnation,
                              replacing=seat.replacing, counts=counts, admitted=seat.admitted,
                              previous_world_size=seat.admitted.previous_world_size if seat.admitted else None,
                              layout_generation=layout.generation if layout is not None else -1,
                              coordinator=coordinator, link=link)

    @staticmethod
    def wait_for_nodes(store: KVStore, cfg: LaunchConfig, node_rank: int, host: str,
                       stop_requested: Callable[[], bool]) -> None:
        """The job's start, fixed size: say this node's worker count and wait until every node has joined."""
        store.set(K.rdzv_nproc(node_rank), str(cfg.nproc_per_node))
        if store.add(K.RDZV_JOINED, 1) == cfg.nnodes:   # the last to join lists every count: one read for each
            store.set(K.RDZV_NPROCS, json.dumps([int(store.get(K.rdzv_nproc(n))) for n in range(cfg.nnodes)]))
            store.set(K.RDZV_READY, "1")
        log.info("node %d waiting for %d node(s) at %s (up to %.0fs)", node_rank, cfg.nnodes, host,
                 cfg.join_timeout)
        deadline = time.monotonic() + cfg.join_timeout
        while not store.check([K.RDZV_READY]):
            if stop_requested():
                raise RendezvousInterrupted()
            if time.monotonic() > deadline:
                raise RendezvousError(f"not all {cfg.nnodes} nodes joined within {cfg.join_timeout:.0f}s; "
                                      "start the other agents or raise --rdzv-conf join_timeout=SECONDS")
            time.sleep(0.05)

    def take_vacancy(self, store: KVStore, cfg: LaunchConfig, members: MemberRecords, incarnation: str,
                     stop_requested: Callable[[], bool], node: Optional[int], deadline: float) -> Seat:
        """Wait until a node rank (`node`, or any with None: a hot spare) is held by an incarnation declared
        lost, and take it over - or, with node None in an elastic job below MAX nodes, be admitted as a new
        node (`admission`); RendezvousError past `deadline`, JobOver once the job has ended."""
        interval = lease_interval(cfg.node_timeout)
        layouts = LayoutRecords(members.records)
        self.on_standby()
        while True:
            if stop_requested():
                raise RendezvousInterrupted()
            try:
                found = members.vacancy(cfg.nnodes)
                if found is not None and (node is None or found[0] == node):
                    lost_node, lost, loss = found
                    if members.take_over(lost_node, lost, incarnation):
                        log.info("taking over node %d of run %r (lost %s ago: %s)", lost_node, cfg.rdzv_id,
                                 f"{time.time() - loss.wall_time:.1f}s", loss.why)
                        return Seat(lost_node, replacing=loss)
                if node is None and cfg.elastic:
                    seat = _StoreRendezvous.admission(store, cfg, members, layouts, incarnation, stop_requested)
                    if seat is not None:
                        return seat
                ended = store.check([K.FAILED]) or any(store.check([K.node_mark(K.LEFT, n)])
                                                       for n in range(cfg.nnodes))
            except RuntimeError as exc:   # torch's DistError: the store's host has gone away
                if not any(c.__name__ == "DistError" for c in type(exc).__mro__):
                    raise
                raise JobOver(f"the coordination store of run {cfg.rdzv_id!r} is gone (the job has ended, or the "
                              "node that hosts it was lost); this agent was not needed") from None
            if ended:
                raise JobOver(f"run {cfg.rdzv_id!r} has ended; this agent was not needed")
            if time.monotonic() > deadline:
                raise RendezvousError(f"--node-rank {node} of run {cfg.rdzv_id!r} is held by a live agent (it renews "
                                      f"its lease) and was not declared lost within {cfg.join_timeout:.0f}s; give "
                                      "this node another --node-rank, or stop the other agent first")
            time.sleep(interval)

    @staticmethod
    def admission(store: KVStore, cfg: LaunchConfig, members: MemberRecords, layouts: LayoutRecords,
                  incarnation: str, stop_requested: Callable[[], bool]) -> Optional[Seat]:
        """Elastic, below MAX nodes: hold an unused node rank, ask to be admitted and wait until the store host
        puts this node in the layout of a generation (agent/coordination/layout.py); None when the job has MAX nodes."""
        latest = layouts.latest()
        nodes = list(latest.nodes) if latest is not None else list(range(int(store.get(K.RDZV_SIZE))))
        if len(nodes) >= cfg.nnodes:
            return None
        node = next((n for n in free_ranks(nodes, cfg.nnodes) if members.take_unused(n, incarnation)), None)
        if node is None:
            return None
        store.set(K.rdzv_nproc(node), str(cfg.nproc_per_node))
        layouts.ask_to_join(node, NodeJoin(incarnation=incarnation, nproc=cfg.nproc_per_node, host=hostname()))
        log.warning("run %r runs on %d node(s) (--nnodes %d:%d): asking to join it as node %d", cfg.rdzv_id,
                    len(nodes), cfg.min_nnodes, cfg.nnodes, node)
        interval, count = lease_interval(cfg.node_timeout), 0
        while True:
            if stop_requested():
                raise RendezvousInterrupted()
            count += 1
            members.renew(node, incarnation, count)   # alive while it waits: the host admits a live node
            latest = layouts.latest()
            if latest is not None and node in latest.nodes:
                log.info("admitted to run %r as node %d from generation %d (%d ranks)", cfg.rdzv_id, node,
                         latest.generation, latest.world_size)
                return Seat(node, admitted=latest)
            if members.holder(node) != incarnation:
                return None   # the rank was taken from us (cannot happen while we renew): look again
            if store.check([K.FAILED]) or any(store.check([K.node_mark(K.LEFT, n)]) for n in range(cfg.nnodes)):
                raise JobOver(f"run {cfg.rdzv_id!r} has ended; this agent was not needed")
            time.sleep(interval)


class StaticRendezvous(_StoreRendezvous):
    """`--nnodes N --node-rank i --master-addr A --master-port P`: node 0 serves the store at A:P."""

    def open_store(self, cfg: LaunchConfig) -> tuple[KVStore, bool, str, str, int]:
        host, port = cfg.master_addr, cfg.rdzv_port
        serve = cfg.node_rank == 0
        bind = netaddr.multi_node_bind(host, cfg.local_addr) if serve else ""
        return stores.open_tcp_store(host, port, server=serve, timeout_s=cfg.join_timeout, bind=bind), serve, \
            bind, host, port

    def node_rank(self, store: KVStore, cfg: LaunchConfig, members: MemberRecords, incarnation: str,
                  stop_requested: Callable[[], bool]) -> Seat:
        node_rank = int(cfg.node_rank or 0)
        if store.add(K.rdzv_claim(node_rank), 1) == 1:
            members.take_free(node_rank, incarnation)
            self.wait_for_nodes(store, cfg, node_rank, f"{cfg.master_addr}:{cfg.rdzv_port}", stop_requested)
            return Seat(node_rank)
        if not store.check([K.RDZV_READY]):
            raise RendezvousError(f"two agents joined with --node-rank {node_rank}; give each node its own rank "
                                  f"0..{cfg.nnodes - 1}")
        # the job is running: this is the node's command started again - its replacement once it is lost
        log.info("node %d of run %r is running: waiting to replace it once it is declared lost (no lease renewal "
                 "for --node-timeout %gs)", node_rank, cfg.rdzv_id, cfg.node_timeout)
        return self.take_vacancy(store, cfg, members, incarnation, stop_requested, node_rank,
                                 time.monotonic() + cfg.join_timeout)


class C10dRendezvous(_StoreRendezvous):
    """`--rdzv-endpoint H:P --nnodes N` (or MIN:MAX): the agent on H serves the store; node ranks in join order."""

    def open_store(self, cfg: LaunchConfig) -> tuple[KVStore, bool, str, str, int]:
        host, port = cfg.rdzv_host, cfg.rdzv_port
        if stores.is_local_host(host):
            bind = netaddr.multi_node_bind(host, cfg.local_addr)
            try:
                return stores.open_tcp_store(host, port, server=True, timeout_s=cfg.join_timeout, bind=bind), True, \
                    bind, host, port
            except RendezvousError:
                pass  # another agent on this machine serves it: join as a client
        return stores.open_tcp_store(host, port, server=False, timeout_s=cfg.join_timeout), False, "", host, port

    def node_rank(self, store: KVStore, cfg: LaunchConfig, members: MemberRecords, incarnation: str,
                  stop_requested: Callable[[], bool]) -> Seat:
        where = f"{cfg.rdzv_host}:{cfg.rdzv_port}"
        node_rank = store.add(K.RDZV_COUNTER, 1) - 1 if not store.check([K.RDZV_READY]) else cfg.nnodes
        if node_rank < cfg.nnodes:
            members.take_free(node_rank, incarnation)
            if not cfg.elastic:
                self.wait_for_nodes(store, cfg, node_rank, where, stop_requested)
                return Seat(node_rank)
            if node_rank < self.form_elastic(store, cfg, node_rank, where, stop_requested):
                return Seat(node_rank)
            members.records.write(K.node_holder(node_rank), K.node_dropped(incarnation))   # joined too late
        # beyond the job's size: a hot spare (or a lost node's command started again) - it takes the first
        # node rank declared lost, for as long as the job runs; an elastic job below MAX nodes admits it
        if cfg.elastic:
            log.warning("run %r has formed: waiting to join it while it has fewer than %d nodes (--nnodes %d:%d), "
                        "or as a hot spare (not counted in the world size) to take over a node that is lost",
                        cfg.rdzv_id, cfg.nnodes, cfg.min_nnodes, cfg.nnodes)
        else:
            log.warning("run %r has its %d node(s): waiting as a hot spare (not counted in the world size) to take "
                        "over a node that is lost", cfg.rdzv_id, cfg.nnodes)
        members.add_spare(incarnation, hostname(), time.time())
        try:
            return self.take_vacancy(store, cfg, members, incarnation, stop_requested, None, float("inf"))
        finally:
            try:
                members.remove_spare(incarnation)
            except Exception as exc:  # the job (and its store) may be gone: nothing to unlist
                log.debug("could not unlist this spare: %s", exc)

    @staticmethod
    def form_elastic(store: KVStore, cfg: LaunchConfig, node_rank: int, where: str,
                     stop_requested: Callable[[], bool]) -> int:
        """The start of an elastic job: once MIN agents have joined, wait --rdzv-conf last_call_timeout for more
        (up to MAX), then the first agent whose wait is over fixes the size at the agents that joined so far
        (compare-and-set): node ranks below it form the job; returns the size."""
        store.set(K.rdzv_nproc(node_rank), str(cfg.nproc_per_node))
        log.info("node %d waiting for %d to %d node(s) at %s (up to %.0fs, then %gs for more)", node_rank,
                 cfg.min_nnodes, cfg.nnodes, where, cfg.join_timeout, cfg.last_call_timeout)
        deadline = time.monotonic() + cfg.join_timeout
        enough_since: Optional[float] = None
        while not store.check([K.RDZV_SIZE]):
            if stop_requested():
                raise RendezvousInterrupted()
            now = time.monotonic()
            joined = int(store.add(K.RDZV_COUNTER, 0))
            if joined >= cfg.min_nnodes and enough_since is None:
                enough_since = now
            if joined >= cfg.nnodes or (enough_since is not None and now - enough_since >= cfg.last_call_timeout):
                store.compare_set(K.RDZV_SIZE, "", str(min(joined, cfg.nnodes)))
                break
            if now > deadline:
                raise RendezvousError(f"only {joined} of at least {cfg.min_nnodes} nodes joined within "
                                      f"{cfg.join_timeout:.0f}s; start the other agents or raise --rdzv-conf "
                                      "join_timeout=SECONDS")
            time.sleep(0.05)
        size = int(store.get(K.RDZV_SIZE))
        store.set(K.RDZV_READY, "1")
        for n in range(size):   # every node of the job has said its worker count before the job starts
            store.get(K.rdzv_nproc(n))
        return size


register_backend("local", LocalRendezvous)
register_backend("static", StaticRendezvous)
register_backend("c10d", C10dRendezvous)
# imported when used: its client library is an optional extra (hyperpodrun[etcd])
register_backend("etcd", lambda: getattr(importlib.import_module("hyperpodrun.agent.coordination.etcd_rendezvous"),
                                         "EtcdRendezvous")())
