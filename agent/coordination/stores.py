"""Stores: one stable coordination store for the agents, one fresh store server per generation for workers.

Why a fresh worker store per generation (docs/ARCHITECTURE.md, "Stores"): torch's env:// init adds no
per-attempt prefix, so reusing one store across generations makes a replacement rank dial stale peer
addresses. A new server on a new port gives every generation a clean namespace; closing the old one
releases any rank still waiting on it. The store is hosted by an agent, never by a worker, so any rank -
rank 0 included - can die and be replaced.

Every server listens on one address only (hyperpodrun/netaddr.py decides which: loopback on one node, the
job's interface with several): torch's TCPStore would listen on every interface whatever host it is
given, so it gets a socket bound here (`master_listen_fd`), which it owns and closes with the store.
"""
from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from hyperpodrun import netaddr
from hyperpodrun.errors import RendezvousError

if TYPE_CHECKING:
    from hyperpodrun.agent.ports import Coordination, KVStore, RendezvousInfo, WorkerStoreHost

log = logging.getLogger("hyperpodrun.agent")


def _torch_dist() -> Any:
    import torch.distributed as dist  # the agent imports torch lazily: the CLI's usage errors stay fast
    return dist


def open_tcp_store(host: str, port: int, *, server: bool, timeout_s: float, wait_for_workers: bool = False,
                   bind: Optional[str] = None) -> "KVStore":
    """A TCPStore client or server; a clear RendezvousError instead of a torch traceback.

    A server listens on `bind` only (required for a server; "0.0.0.0" only where netaddr found no better)."""
    dist = _torch_dist()
    try:
        if not server:
            return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                 wait_for_workers=wait_for_workers, multi_tenant=False)
        if not bind:
            raise RendezvousError(f"cannot serve the coordination store on port {port}: no address to listen on")
        sock = netaddr.listen_socket(bind, port)
        port = sock.getsockname()[1]
        fd = sock.detach()                      # the store owns the descriptor from here and closes it
        # the server's own client connects to `bind` (a wildcard bind is reached on loopback)
        own = netaddr.LOOPBACK if bind in ("0.0.0.0", "::") else bind
        # (should the store fail to start, torch may have closed `fd` already: it is left alone then)
        return dist.TCPStore(own, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=wait_for_workers, multi_tenant=False, master_listen_fd=fd,
                             use_libuv=True)
    except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
        what = "serve" if server else "reach"
        where = f"{host}:{port}" + (f" (listening on {bind})" if server and bind and bind != host else "")
        raise RendezvousError(
            f"cannot {what} the coordination store at {where}: {str(exc).splitlines()[0]}. "
            "Check the address/port, that the port is free on the host node, and that the nodes can reach it.")


def local_store() -> "KVStore":
    """The coordination store of a single-node job: in memory, same API as TCPStore."""
    return _torch_dist().HashStore()


def prefixed(prefix: str, store: "KVStore") -> "KVStore":
    return _torch_dist().PrefixStore(prefix, store)


def is_local_host(host: str) -> bool:
    """Does `host` name this machine? (decides which c10d agent serves the endpoint)"""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        target = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local: set[str] = set()
    for name in names:
        try:
            local |= {str(ai[4][0]) for ai in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return bool(target & local) or any(a.startswith("127.") or a == "::1" for a in target)


class WorkerStores:
    """The per-generation store servers this agent hosts for the workers."""

    def __init__(self, bind_host: str) -> None:
        self._bind_host = bind_host       # loopback on one node, the job's interface with several
        self._servers: dict[int, Any] = {}

    def open(self, generation: int) -> int:
        """Start generation `generation`'s server; returns its port. Older servers are closed."""
        store: Any = open_tcp_store(self._bind_host, 0, server=True, timeout_s=60, bind=self._bind_host)
        self._servers[generation] = store
        for g in [g for g in self._servers if g < generation]:
            self.close(g)
        return int(store.port)

    def close(self, generation: int) -> None:
        self._servers.pop(generation, None)

    def close_all(self) -> None:
        self._servers.clear()

    def get(self, generation: int) -> Optional[object]:
        return self._servers.get(generation)


def open_worker_store(generation: int, wstores: "WorkerStoreHost", coord: "Coordination",
                      rdzv: "RendezvousInfo") -> None:
    """Start generation `generation`'s worker store on this agent and publish it, if this agent hosts it: the
    store host always; with a standalone coordinator (no store host), the first live agent that needs it
    claims it and publishes its address with the port - the coordinator never serves a worker store, so its
    restart never touches the workers (docs/ARCHITECTURE.md, "Stores")."""
    if wstores.get(generation) is not None:
        return
    if rdzv.store_host:
        coord.publish_worker_store(generation, wstores.open(generation))
    elif rdzv.coordinator and coord.worker_store_port(generation) is None and coord.claim_worker_store(generation):
        coord.publish_worker_store(generation, wstores.open(generation), rdzv.bind_addr)
