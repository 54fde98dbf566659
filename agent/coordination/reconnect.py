"""Connections to a standalone coordinator that come back: the coordinator may be killed and started again at
the same address (a Kubernetes Deployment behind a Service does exactly that), and the job goes on.

Why an adapter: a torch TCPStore client never reconnects - once its server is gone, every call on it fails
for good (checked on torch 2.13: "Broken pipe" on each call after the server restarted). So each of an
agent's connections to the coordinator (the loop's, the watcher's, the membership thread's) is a
`ReconnectingStore`: a KVStore whose calls, on a connection error, open a new connection with backoff and
are tried again - up to `--rdzv-conf coordinator_timeout` after the coordinator went away, then
`CoordinatorLost` (the job ends with one line). Meanwhile the call waits: training does not, as the workers
talk to the worker store a live agent hosts, never to the coordinator; only what needs the coordination
store (a fault's round, the exit barrier) waits for it.

The coordinator keeps nothing the agents cannot supply again (soft state): every connection of an agent
notes, in the agent's one `Ledger`, the newest value it wrote or read per key and the newest count it saw
per counter. A coordinator started again serves an empty store under a new epoch token
(agent/coordination/coordinator.py); the first of the agent's connections to find a new epoch writes the
ledger back (agent/coordination/resupply.py) before any of its connections goes on, so no part of the agent
reads the empty store. The outage is an event (`coordinator_lost`, `coordinator_back`), never a failure by
itself; `reconnects` tells the lease watcher to give every node a fresh --node-timeout (their leases vanished
with the old store, and nobody could renew one while it was down).

A call the old server may have carried out before it died is carried out again on the new one: harmless for
every call but `add`, and an `add` lost with a dead server is lost with its counter too (the counter comes
back as the highest count any agent saw, the retried add on top of it).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, TypeVar

from hyperpodrun.agent.coordination.coordinator import epoch as coordinator_epoch
from hyperpodrun.agent.ports import Clock, KVStore, Posted, StoreValue, SystemClock
from hyperpodrun.errors import HyperpodrunError

log = logging.getLogger("hyperpodrun.agent")

T = TypeVar("T")

#: the first wait between two reconnection attempts; it doubles up to MAX_BACKOFF_S
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
#: how long one attempt waits for the coordinator to accept the connection
CONNECT_TIMEOUT_S = 2.0


class CoordinatorLost(HyperpodrunError):
    """The standalone coordinator stayed unreachable for --rdzv-conf coordinator_timeout."""


def is_connection_error(exc: BaseException) -> bool:
    """Whether a store call failed because its connection is gone (torch's DistNetworkError, an OSError), not
    because of what it asked (a get's timeout is a DistStoreError: no reconnection would help)."""
    if any(c.__name__ == "DistNetworkError" for c in type(exc).__mro__):
        return True
    return isinstance(exc, OSError)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class Ledger:
    """What this agent wrote to and last read from the coordination store (thread-safe): per key the newest
    value, per counter the newest count. Only what the agent saw - nothing here is trusted more for being
    here: signed records are written back only when they verify (agent/coordination/resupply.py)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def saw(self, key: str, value: StoreValue) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if raw:
            with self._lock:
                self._values[key] = raw

    def counted(self, key: str, count: int) -> None:
        with self._lock:
            self._counts[key] = int(count)

    def values(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._values)

    def knows(self, key: str) -> bool:
        with self._lock:
            return key in self._values

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


#: writes the ledger back into a new, empty store -> how many records it wrote
Resupplier = Callable[[KVStore, Ledger], int]


class CoordinatorLink:
    """One agent's tie to a standalone coordinator: opens its connections, tells an outage once, waits for the
    coordinator up to the deadline, and has the ledger written back once per coordinator start."""

    def __init__(self, where: str, open_store: Callable[[float], KVStore], prefix: Callable[[KVStore], KVStore], *,
                 timeout_s: float, epoch: str, clock: Optional[Clock] = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.where = where                   # "host:port", for the messages
        self._open = open_store              # a raw (unprefixed) client, given a connect timeout
        self._prefix = prefix                # the run's prefix over a raw client
        self.timeout_s = timeout_s
        self._epoch = epoch                  # the coordinator start this agent's records are in
        self._clock = clock or SystemClock()
        self._sleep = sleep
        self.ledger = Ledger()
        self.resupply: Resupplier = lambda store, ledger: 0   # armed once the job's key is known (rendezvous)
        self.post: Callable[[Posted], None] = lambda event: None   # the agent's inbox, once it has one
        self.reconnects = 0                  # how many times the coordinator came back empty and was resupplied
        self._down_since: Optional[float] = None
        self._state = threading.Lock()
        self._supply = threading.Lock()      # one write-back per coordinator start; the others wait for it

    def connect(self, store: Optional[KVStore] = None) -> KVStore:
        """A connection that reconnects by itself (`store`: an open prefixed one to begin with)."""
        return ReconnectingStore(self, store)

    @property
    def down(self) -> bool:
        with self._state:
            return self._down_since is not None

    def reopen(self, why: str) -> KVStore:
        """A new prefixed connection, this agent's records in its store: at once when the coordinator answers,
        else with backoff until it does; CoordinatorLost once it has been away for timeout_s."""
        delay = FIRST_BACKOFF_S
        while True:
            try:
                raw = self._open(CONNECT_TIMEOUT_S)
                now_epoch = coordinator_epoch(raw)
                if not now_epoch:
                    raise ConnectionError("the coordinator is starting")
                store = self._prefix(raw)
                self._settle(store, now_epoch, why)
                return store
            except Exception as exc:   # torch's errors have no narrower common class; a bug surfaces below
                if not is_connection_error(exc) and not _is_connect_failure(exc):
                    raise
                self._lost(why)
            with self._state:
                since = self._down_since
            away = self._clock.monotonic() - since if since is not None else 0.0
            if away >= self.timeout_s:
                raise CoordinatorLost(f"the standalone coordinator at {self.where} has been unreachable for "
                                      f"{away:.0f}s (--rdzv-conf coordinator_timeout {self.timeout_s:g}s): {why}; "
                                      "start it again at that address, or raise coordinator_timeout")
            self._sleep(min(delay, self.timeout_s - away))   # the last attempt falls on the deadline
            delay = min(2 * delay, MAX_BACKOFF_S)

    def _lost(self, why: str) -> None:
        with self._state:
            if self._down_since is not None:
                return
            self._down_since = self._clock.monotonic()
        msg = (f"lost the standalone coordinator at {self.where} ({why}): training goes on; a fault waits for it "
               f"(up to --rdzv-conf coordinator_timeout {self.timeout_s:g}s) while the agents reconnect")
        log.debug("%s", msg)      # told once, as the event (the console shows it)
        self.post(("coordinator_lost", msg))

    def _settle(self, store: KVStore, now_epoch: str, why: str) -> None:
        """The coordinator answers: write this agent's records back if it is a new start, then say it is back."""
        with self._supply:
            if now_epoch != self._epoch:
                self._lost(why)            # it came back before this agent noticed it was away
                written = self.resupply(store, self.ledger)
                self._epoch = now_epoch
                self.reconnects += 1
                log.info("the coordinator at %s is a new start: wrote back %d record(s) of this agent", self.where,
                         written)
        with self._state:
            since, self._down_since = self._down_since, None
        if since is not None:
            away = self._clock.monotonic() - since
            msg = f"the standalone coordinator at {self.where} is back after {away:.1f}s; the job goes on"
            log.debug("%s", msg)
            self.post(("coordinator_back", msg))


def _is_connect_failure(exc: BaseException) -> bool:
    """Opening a client failed (agent/coordination/stores.py turns torch's errors into a RendezvousError)."""
    from hyperpodrun.errors import RendezvousError
    return isinstance(exc, RendezvousError)


class ReconnectingStore:
    """A KVStore over the coordinator that survives its restart (the module docstring says how). One per thread,
    as a TCPStore client is."""

    def __init__(self, link: CoordinatorLink, store: Optional[KVStore] = None) -> None:
        self._link = link
        self._store = store
        self._timeout: Optional[timedelta] = None

    def _call(self, op: Callable[[KVStore], T]) -> T:
        why = "not connected yet"
        while True:
            store = self._store
            if store is None:
                store = self._link.reopen(why)
                if self._timeout is not None:
                    store.set_timeout(self._timeout)
                self._store = store
            try:
                return op(store)
            except Exception as exc:   # see is_connection_error: anything else is the caller's
                if not is_connection_error(exc):
                    raise
                self._store = None
                why = first_line(exc)

    def set(self, key: str, value: StoreValue) -> None:
        self._call(lambda s: s.set(key, value))
        self._link.ledger.saw(key, value)

    def get(self, key: str) -> bytes:
        value = bytes(self._call(lambda s: s.get(key)))
        self._link.ledger.saw(key, value)
        return value

    def add(self, key: str, amount: int) -> int:
        count = int(self._call(lambda s: s.add(key, amount)))
        self._link.ledger.counted(key, count)
        return count

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set. Keys found set are read once into the ledger: an agent that only ever
        checked a record (the rendezvous' `ready`, which only the last agent to join writes) must still write
        it back - otherwise, once the agents that wrote it are replaced, a coordinator started again no longer
        knows that the job was formed, and a lost node's replacement starts a new rendezvous instead of taking
        its rank over."""
        found = bool(self._call(lambda s: s.check(keys)))
        if found:
            for key in keys:
                if not self._link.ledger.knows(key):
                    self.get(key)   # nothing deletes a record of the coordinator: a set key stays set
        return found

    def compare_set(self, key: str, expected_value: StoreValue, desired_value: StoreValue) -> bytes:
        now = bytes(self._call(lambda s: s.compare_set(key, expected_value, desired_value)))
        self._link.ledger.saw(key, now)       # what the key holds now (ours, or the value that won)
        return now

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._call(lambda s: s.set_timeout(timeout))


def coordinator_link(host: str, port: int, run_id: str, raw: KVStore, timeout_s: float) -> CoordinatorLink:
    """The link of an agent that has just reached the coordinator at host:port with `raw` (its first client)."""
    from hyperpodrun.agent.coordination import stores, store_schema as K

    def open_store(connect_timeout_s: float) -> KVStore:
        # a plain probe first: while the coordinator is away each attempt fails quietly here, where torch's
        # client would log a few lines of its own per attempt
        socket.create_connection((host, port), timeout=connect_timeout_s).close()
        return stores.open_tcp_store(host, port, server=False, timeout_s=connect_timeout_s)
    return CoordinatorLink(f"{host}:{port}", open_store, lambda store: stores.prefixed(K.run_prefix(run_id), store),
                           timeout_s=timeout_s, epoch=coordinator_epoch(raw))
