"""The standalone coordinator (`hyperpodrun coordinator --host H --port P`): the agents' coordination store,
served by a small CPU-only process of its own instead of by the agent on node 0 / the rendezvous host.

Why: with the node-hosted store, losing the host node (or `kill -9` of its agent) ends the job - every other
node can be lost and replaced, that one cannot. A coordinator on a head node (or a Kubernetes Deployment
behind a Service) takes the store off the training nodes: any node, node 0 included, can then be lost whole
and replaced by its command started again (docs/deployment.md, "A standalone coordinator").

What it serves: one TCPStore server (the c10d TCPStore protocol, so `--rdzv-backend c10d --rdzv-endpoint
H:P` reaches it as it reaches a node-hosted store), listening on the one address given - never on every
interface unless `--host 0.0.0.0` says so. It holds no job secret and writes nothing but `MARKER`: the
records that decide a job's fate are signed by the agents (agent/coordination/signed_records.py), exactly
as in the node-hosted store, so the coordinator authenticates the same things the node-hosted store does
and no more (docs/security.md). Each job's keys live under its own run prefix (`hyperpodrun/<run-id>/`).

How the agents tell it from a node-hosted store: `MARKER` is set, outside every run's prefix, before the
port accepts an agent; an agent that finds it hosts no coordination store, hosts the workers' store of the
generations it claims, and takes part in electing the agent that watches every lease
(agent/coordination/owner.py).

It keeps no worker stores (each generation's is hosted by a live agent and published here), so the
coordinator needs one port. It keeps nothing the agents cannot supply again: killed and started again at the
same address, it serves an empty store under a new `EPOCH`, and the agents, which reconnect, write back what
they hold (agent/coordination/reconnect.py, agent/coordination/resupply.py).
"""
from __future__ import annotations

import logging
import secrets
import signal
import threading
from datetime import timedelta
from typing import Any, Optional

from hyperpodrun import netaddr
from hyperpodrun.errors import HyperpodrunError

log = logging.getLogger("hyperpodrun.coordinator")

#: set (outside every run's prefix) by a standalone coordinator: agents that find it host no store themselves
MARKER = "hyperpodrun/coordinator"
#: the value of MARKER: the coordinator protocol's version (agents accept what they know)
MARKER_VALUE = "1"
#: a random token per coordinator start, set before MARKER: an agent that reconnects and finds another one
#: knows the store is a new, empty one and writes back what it holds (agent/coordination/resupply.py)
EPOCH = "hyperpodrun/coordinator/epoch"


class CoordinatorError(HyperpodrunError):
    """The coordinator cannot serve at the address it was given (the port is taken, the address is not ours)."""


def epoch(store: Any) -> str:
    """The start token of the coordinator serving `store` (a raw connection); "" when it has none yet."""
    return bytes(store.get(EPOCH)).decode() if store.check([EPOCH]) else ""


def is_coordinator(store: Any) -> bool:
    """Whether `store` (a raw, unprefixed connection) is served by a standalone coordinator."""
    try:
        return bool(store.check([MARKER]))
    except RuntimeError:   # torch's DistError: the store went away under us; treated as node-hosted
        return False


class CoordinatorServer:
    """The coordination store on host:port, until `stop()` (or a signal, through `serve`)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._store: Optional[Any] = None
        self._stop = threading.Event()

    def start(self) -> int:
        """Listen and serve; returns the port (the one given, or the one chosen for port 0)."""
        try:
            sock = netaddr.listen_socket(self.host, self.port)
        except OSError as exc:
            raise CoordinatorError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}; choose another "
                                   "--port, or stop what holds that one") from None
        port = sock.getsockname()[1]
        fd = sock.detach()       # the store owns the descriptor from here and closes it
        own = netaddr.LOOPBACK if self.host in ("0.0.0.0", "::") else self.host
        import torch.distributed as dist   # torch only once the arguments are valid: usage errors stay fast
        try:
            self._store = dist.TCPStore(own, port, is_master=True, timeout=timedelta(seconds=30),
                                        wait_for_workers=False, multi_tenant=False, master_listen_fd=fd,
                                        use_libuv=True)
        except (RuntimeError, ValueError, OSError) as exc:
            raise CoordinatorError(f"cannot serve on {self.host}:{port}: {str(exc).splitlines()[0]}") from None
        self._store.set(EPOCH, secrets.token_hex(8))
        self._store.set(MARKER, MARKER_VALUE)
        self.port = port
        return port

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until stopped (True) or `timeout` passes (False)."""
        return self._stop.wait(timeout)

    def close(self) -> None:
        self._store = None       # torch closes the server with its last reference


def serve(host: str, port: int) -> int:
    """Run the coordinator in this process until SIGTERM/SIGINT; returns the exit code (128 + the signal, as
    the launcher does)."""
    server = CoordinatorServer(host, port)
    got: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        got.append(signum)
        server.stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    bound = server.start()
    where = f"{host}:{bound}"
    if host in ("0.0.0.0", "::"):
        log.warning("listening on every interface (--host %s): whoever reaches port %d can read and disturb the "
                    "jobs' coordination records; give --host this machine's address on the jobs' network", host,
                    bound)
    log.info("coordinator serving the coordination store on %s; agents reach it with --rdzv-backend c10d "
             "--rdzv-endpoint %s", where, where)
    try:
        while not server.wait(1.0):
            pass
    finally:
        server.close()
    name = signal.Signals(got[0]).name if got else "stop"
    log.info("coordinator on %s stopped (%s)", where, name)
    return 128 + got[0] if got else 0
