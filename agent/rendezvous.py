"""Node rendezvous with a fixed number of nodes: `static` and `c10d` (torchrun's multi-node commands).

static: `--nnodes N --node-rank i --master-addr A --master-port P`; node 0 serves the coordination store
        at A:P. c10d: `--rdzv-endpoint H:P --nnodes N`; the agent on H serves the store, node ranks are
        handed out in join order. Either way the agents then agree on each node's worker count, so global
        ranks are assigned node by node, as torchrun does.
"""
from __future__ import annotations

import logging
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

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
        return Rendezvous(node_rank=0, nnodes=1, rank_offset=0, world_size=cfg.nproc_per_node, run_id=run_id,
                          master_addr=cfg.master_addr, store=stores.prefixed(f"hyperpodrun/{run_id}/",
                                                                             stores.local_store()),
                          store_host=True, store_endpoint=None, single_node=True)

    if cfg.rdzv_backend == "static":
        host, port = cfg.master_addr, cfg.rdzv_port
        serve = cfg.node_rank == 0
        raw = stores.open_tcp_store(host, port, server=serve, timeout_s=cfg.join_timeout)
    else:
        host, port = cfg.rdzv_host, cfg.rdzv_port
        serve = False
        raw = None
        if stores.is_local_host(host):
            try:
                raw = stores.open_tcp_store(host, port, server=True, timeout_s=cfg.join_timeout)
                serve = True
            except RendezvousError:
                raw = None  # another agent on this machine serves it: join as a client
        if raw is None:
            raw = stores.open_tcp_store(host, port, server=False, timeout_s=cfg.join_timeout)
    store = stores.prefixed(f"hyperpodrun/{run_id}/", raw)
    store.set_timeout(timedelta(seconds=cfg.join_timeout))

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
                      store_endpoint=(host, port), single_node=False)
