"""Node rendezvous with a fixed number of nodes: `static` and `c10d` (torchrun's multi-node commands).

static: `--nnodes N --node-rank i --master-addr A --master-port P`; node 0 serves the coordination store
        at A:P. c10d: `--rdzv-endpoint H:P --nnodes N`; the agent on H serves the store, node ranks are
        handed out in join order. Either way the agents then agree on each node's worker count, so global
        ranks are assigned node by node, as torchrun does.

Before joining, the agents settle the job secret (hyperpodrun/auth.py): the user's (the same on every node,
checked here through an HMAC of the run id, never the secret itself), or, without one, a random one the
first agent puts in the store - which then protects nothing from whoever can reach the store, and the
agent says so once.
"""
from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

from hyperpodrun import auth, netaddr
from hyperpodrun.agent import stores
from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import RendezvousError

log = logging.getLogger("hyperpodrun.agent")


@dataclass
class Rendezvous:
    """The outcome: who this node is and how to reach the shared pieces."""

    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    run_id: str
    master_addr: str            # address the workers dial for their per-generation store
    store: object               # coordination store (prefixed to this run)
    store_host: bool            # this agent hosts the coordination store and the workers' stores
    store_endpoint: tuple[str, int] | None  # (host, port) for helper threads' own connections; None: local
    single_node: bool
    bind_addr: str = netaddr.LOOPBACK       # where this agent's store servers listen (netaddr.py); "": none
    secret: bytes = b""                     # the job secret (auth.py); never handed to workers
    secret_warning: str = ""                # set when the secret was agreed through the store (one warning)


def hostname() -> str:
    return socket.gethostname()


class RendezvousInterrupted(Exception):
    """The agent was told to stop (a signal) while it waited for the other nodes."""


def rendezvous(cfg: LaunchConfig, stop_requested: Optional[Callable[[], bool]] = None) -> Rendezvous:
    """Meet the other agents (or not, on one node) and return this node's place in the job.

    While waiting for the other nodes, `stop_requested()` is polled so a signal ends the wait at once."""
    run_id = cfg.rdzv_id
    if cfg.single_node:
        if run_id == "none":
            run_id = str(uuid.uuid4())
        # the workers' store listens on loopback only; MASTER_ADDR must lead there (README, Security)
        return Rendezvous(node_rank=0, nnodes=1, rank_offset=0, world_size=cfg.nproc_per_node, run_id=run_id,
                          master_addr=netaddr.single_node_master(cfg.master_addr),
                          store=stores.prefixed(f"hyperpodrun/{run_id}/", stores.local_store()),
                          store_host=True, store_endpoint=None, single_node=True,
                          bind_addr=netaddr.single_node_bind(cfg.master_addr),
                          secret=auth.job_secret(cfg.job_secret_file) or auth.new_secret())

    if cfg.rdzv_backend == "static":
        host, port = cfg.master_addr, cfg.rdzv_port
        serve = cfg.node_rank == 0
        bind = netaddr.multi_node_bind(host, cfg.local_addr) if serve else ""
        raw = stores.open_tcp_store(host, port, server=serve, timeout_s=cfg.join_timeout, bind=bind)
    else:
        host, port = cfg.rdzv_host, cfg.rdzv_port
        serve = False
        raw = None
        bind = ""
        if stores.is_local_host(host):
            bind = netaddr.multi_node_bind(host, cfg.local_addr)
            try:
                raw = stores.open_tcp_store(host, port, server=True, timeout_s=cfg.join_timeout, bind=bind)
                serve = True
            except RendezvousError:
                raw, bind = None, ""  # another agent on this machine serves it: join as a client
        if raw is None:
            raw = stores.open_tcp_store(host, port, server=False, timeout_s=cfg.join_timeout)
    store = stores.prefixed(f"hyperpodrun/{run_id}/", raw)
    store.set_timeout(timedelta(seconds=cfg.join_timeout))
    secret, warning = agree_secret(store, auth.job_secret(cfg.job_secret_file), run_id, f"{host}:{port}")

    if cfg.rdzv_backend == "static":
        node_rank = int(cfg.node_rank or 0)
        if store.add(f"rdzv/claim/{node_rank}", 1) > 1:
            raise RendezvousError(f"two agents joined with --node-rank {node_rank}; give each node its own rank "
                                  f"0..{cfg.nnodes - 1}")
    else:
        node_rank = store.add("rdzv/counter", 1) - 1
        if node_rank >= cfg.nnodes:
            raise RendezvousError(f"more agents joined run {run_id!r} than --nnodes {cfg.nnodes}; "
                                  "start exactly N agents or use a new --rdzv-id")
    store.set(f"rdzv/nproc/{node_rank}", str(cfg.nproc_per_node))
    if store.add("rdzv/joined", 1) == cfg.nnodes:
        store.set("rdzv/ready", "1")
    log.info("node %d waiting for %d node(s) at %s:%d (up to %.0fs)", node_rank, cfg.nnodes, host, port,
             cfg.join_timeout)
    deadline = time.monotonic() + cfg.join_timeout
    while not store.check(["rdzv/ready"]):
        if stop_requested is not None and stop_requested():
            raise RendezvousInterrupted()
        if time.monotonic() > deadline:
            raise RendezvousError(f"not all {cfg.nnodes} nodes joined within {cfg.join_timeout:.0f}s; start the "
                                  "other agents or raise --rdzv-conf join_timeout=SECONDS")
        time.sleep(0.05)
    counts = [int(store.get(f"rdzv/nproc/{i}")) for i in range(cfg.nnodes)]
    return Rendezvous(node_rank=node_rank, nnodes=cfg.nnodes, rank_offset=sum(counts[:node_rank]),
                      world_size=sum(counts), run_id=run_id, master_addr=host, store=store, store_host=serve,
                      store_endpoint=(host, port), single_node=False,
                      bind_addr=bind, secret=secret,
                      secret_warning=warning)


_AUTH_KEY = "auth"


def agree_secret(store: object, given: Optional[bytes], run_id: str, where: str) -> tuple[bytes, str]:
    """The job secret every agent of the run uses -> (secret, warning or "").

    The first agent sets the store's `auth` record: "user:<HMAC of the run id>" with a user secret (the
    others check theirs gives the same, so two nodes with different secrets fail here, plainly, instead of
    ignoring each other's records later), or "agreed:<random secret>" without one."""
    if given is not None:
        mine = "user:" + auth.derive(auth.derive(given, "check"), run_id).hex()
    else:
        mine = "agreed:" + auth.new_secret().decode()
    got = store.compare_set(_AUTH_KEY, "", mine).decode()  # type: ignore[attr-defined]
    fix = f"give every node the same secret ({auth.SECRET_ENV} or --job-secret-file)"
    if given is not None:
        if got == mine:
            return given, ""
        if got.startswith("agreed:"):
            raise RendezvousError(f"this node has a job secret but the node(s) that joined run {run_id!r} first "
                                  f"have none; {fix}")
        raise RendezvousError(f"this node's job secret differs from the one the other nodes of run {run_id!r} "
                              f"use; {fix}")
    if not got.startswith("agreed:"):
        raise RendezvousError(f"the other nodes of run {run_id!r} were given a job secret and this node was not; "
                              f"{fix}")
    warning = (f"no job secret was given: the nodes agreed on one through the coordination store at {where}, so the "
               "peer-copy receivers and the job's signed store records trust anyone who can reach that store. "
               f"To fix this, {fix}; see README, Security")
    return got.removeprefix("agreed:").encode(), warning
