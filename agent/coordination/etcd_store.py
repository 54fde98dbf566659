"""The coordination store in an etcd v3 cluster (`--rdzv-backend etcd`): a KVStore (agent/ports.py) over etcd's
HTTP JSON gateway, so the agents' code - rendezvous, signed records, membership, job state - runs on it
unchanged, as it runs on a TCPStore.

Why etcd: a cluster of 3 (or 5) members keeps the job's coordination records through the loss of any
minority of them - its leader included - where a node-hosted store dies with its node and a standalone
coordinator is one process. Why etcd3gw (HTTP/JSON, the gateway every etcd v3 member serves) and not the
`etcd3` package (gRPC): `etcd3` 0.12 (its last release) fails to import with the protobuf versions current
torch environments carry, and gRPC would be one more native dependency in every training image; the gateway
works with every etcd from 3.4 on (Debian's 3.4 included) and needs only `requests`.

How each store operation maps onto etcd (each key under the run's prefix, so jobs never see each other's):
- set / get / check / delete: put, range (get waits for the key, polling, up to the store's timeout, as a
  TCPStore's get does), a transaction comparing each key's create revision, deleterange;
- add and compare_set: transactions (compare-and-swap on the key's mod revision or value), so agents that
  move one counter or claim one record together never lose an update; values are the TCPStore's (a
  counter is its decimal text), so the records read the same in either store.

Endpoints: every call goes to the member that answered last; on a connection error, a timeout, or a member
without a leader, it goes to the next one, round the list, with backoff once every member has failed - for
up to --rdzv-conf coordinator_timeout from the first failure (`EtcdLink`, shared by the agent's connections),
then `EtcdUnreachable`, and the job ends with one line. Meanwhile training goes on: the workers talk to the
workers' store a live agent hosts, never to etcd.

A call that a member carried out but whose answer was lost (the member died before it answered) is tried
again on the next member: harmless for every call but `add`, which may then count twice. The agents call
add before the job runs (the rendezvous) and for the hints beside signed marks (the marks decide); a member
lost exactly inside a rendezvous add can skip a node rank - the job then does not form and ends at
join_timeout with one line, not silently.

Leases: liveness is judged as in the other deployments - signed lease records, each observer timing them on
its own monotonic clock (agent/coordination/membership.py) - and not by etcd leases: an etcd lease's TTL is
kept by the etcd leader and renewed on every leader election (a leader lost mid-run would delay every loss
declaration by a TTL), and a lease is kept alive by whoever knows its ID, where a signed record is not.
"""
from __future__ import annotations

import base64
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from hyperpodrun.agent.ports import Clock, KVStore, Posted, StoreValue, SystemClock
from hyperpodrun.errors import HyperpodrunError
from hyperpodrun.launch.rdzv_conf import EtcdConf

log = logging.getLogger("hyperpodrun.agent")

T = TypeVar("T")

#: how long one request to one member may take before the next member is tried
REQUEST_TIMEOUT_S = 2.0
#: the wait between two rounds of the endpoints once every member failed; doubles up to MAX_BACKOFF_S
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
#: how often a get that waits for its key looks again (first, then at most)
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.05
#: how often add's compare-and-swap is tried again while other agents move the counter
_CAS_TRIES = 1000


class EtcdUnreachable(HyperpodrunError):
    """No etcd member answered for --rdzv-conf coordinator_timeout."""


def _b64(value: StoreValue) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def _raw(value: StoreValue) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _transient(exc: BaseException) -> bool:
    """Whether a call failed because of the member (down, slow, no leader), not because of what it asked."""
    from etcd3gw import exceptions as E
    if isinstance(exc, (E.ConnectionFailedError, E.ConnectionTimeoutError, E.InternalServerError)):
        return True
    if isinstance(exc, E.Etcd3Exception):
        text = f"{exc} {getattr(exc, 'detail_text', '')}".lower()
        return any(w in text for w in ("leader", "timed out", "timeout", "too many requests", "unavailable"))
    return isinstance(exc, OSError)


def _why(exc: BaseException, where: str) -> str:
    """A failed call in a few words (requests' own messages run to several hundred characters)."""
    text = f"{exc} {getattr(exc, 'detail_text', '') or ''}".strip()
    for needle, words in (("refused", "connection refused"), ("timed out", "no answer in time"),
                          ("Timeout", "no answer in time"), ("CERTIFICATE_VERIFY_FAILED", "TLS certificate not "
                          "trusted (--rdzv-conf cacert)"), ("SSL", "TLS handshake failed"),
                          ("no leader", "no leader"), ("Name or service not known", "unknown host")):
        if needle in text:
            return f"{where}: {words}"
    return f"{where}: {(text.splitlines() or [type(exc).__name__])[0][:200]}"


class EtcdLink:
    """One agent's tie to the etcd cluster (the StoreLink port): opens its connections (one per thread), and
    keeps the outage state they share - when every member was first found unreachable, told once as an event
    (`coordinator_lost`, `coordinator_back`: an outage is news, never a failure by itself)."""

    reconnects = 0    # etcd never comes back empty (its members keep the records): nothing is written back
    meanwhile = "training goes on; a fault waits for etcd"   # what an outage means now, for its message

    def __init__(self, conf: EtcdConf, prefix: str, *, timeout_s: float, clock: Optional[Clock] = None,
                 sleep: Callable[[float], None] = time.sleep, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.conf = conf
        self.prefix = prefix
        self.timeout_s = timeout_s                 # --rdzv-conf coordinator_timeout
        self.request_timeout_s = request_timeout_s
        self.clock = clock or SystemClock()
        self.sleep = sleep
        self.post: Callable[[Posted], None] = lambda event: None   # the agent's inbox, once it has one
        self.where = f"the etcd cluster {conf.where()}"
        self._down_since: Optional[float] = None
        self._lock = threading.Lock()

    def connect(self, store: Optional[KVStore] = None) -> KVStore:
        """A connection of this thread's own (`store`: one to go on with)."""
        return store if store is not None else EtcdStore(self)

    def down_for(self, why: str) -> float:
        """Every member failed just now: how long the cluster has been unreachable (told once per outage)."""
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = self.clock.monotonic()
            assert self._down_since is not None
            away = self.clock.monotonic() - self._down_since
        if first:
            msg = (f"no etcd member of {self.conf.where()} answers ({why}): {self.meanwhile} (up to --rdzv-conf "
                   f"coordinator_timeout {self.timeout_s:g}s)")
            log.debug("%s", msg)
            self.post(("coordinator_lost", msg))
        return away

    def answered(self) -> None:
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            msg = f"etcd ({self.conf.where()}) answers again after {self.clock.monotonic() - since:.1f}s"
            log.debug("%s", msg)
            self.post(("coordinator_back", msg))


class EtcdStore:
    """A KVStore over etcd, under the link's run prefix. Not thread-safe (one HTTP session): one per thread, as
    a TCPStore client is (EtcdLink.connect)."""

    def __init__(self, link: EtcdLink) -> None:
        from etcd3gw.client import Etcd3Client
        self._link = link
        conf = link.conf
        self._clients = [Etcd3Client(host=h, port=p, protocol=conf.protocol, timeout=link.request_timeout_s,
                                     session=_session(conf)) for h, p in conf.endpoints]
        self._at = 0                          # the member that answered last
        self._timeout_s = 300.0               # how long a get waits for its key (set_timeout)

    # ------------------------------------------------------------------ plumbing
    def _call(self, op: Callable[[Any], T]) -> T:
        """`op(client)` on the members in turn until one answers (module docstring); EtcdUnreachable after
        --rdzv-conf coordinator_timeout without an answer."""
        link, delay, failed = self._link, FIRST_BACKOFF_S, 0
        while True:
            client = self._clients[self._at]
            try:
                result = op(client)
            except Exception as exc:   # etcd3gw's and requests' errors have no narrower common class
                if not _transient(exc):
                    raise
                why = _why(exc, f"{client.host}:{client.port}")
                log.debug("etcd member %s", why)
                self._at = (self._at + 1) % len(self._clients)
                failed += 1
                if failed % len(self._clients):
                    continue                   # the next member, at once
                away = link.down_for(why)
                if away >= link.timeout_s:
                    raise EtcdUnreachable(
                        f"no etcd member of {link.conf.where()} answered for {away:.0f}s (--rdzv-conf "
                        f"coordinator_timeout {link.timeout_s:g}s; last: {why}); start etcd again, or raise "
                        "coordinator_timeout") from None
                link.sleep(min(delay, max(0.0, link.timeout_s - away)))
                delay = min(2 * delay, MAX_BACKOFF_S)
                continue
            if failed:
                link.answered()
            return result

    def _key(self, key: str) -> str:
        return _b64(self._link.prefix + key)

    def _range(self, key: str) -> Optional[tuple[bytes, int]]:
        """(value, mod revision) of `key`; None when absent."""
        got = self._call(lambda c: c.post(c.get_url("/kv/range"), json={"key": self._key(key)}))
        kvs = got.get("kvs") or []
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0))

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
        body = {"compare": compare, "success": success, "failure": failure or []}
        return dict(self._call(lambda c: c.post(c.get_url("/kv/txn"), json=body)))

    def _put(self, key: str, value: StoreValue) -> dict[str, Any]:
        return {"request_put": {"key": self._key(key), "value": _b64(value)}}

    # ------------------------------------------------------------------ the KVStore port
    def set(self, key: str, value: StoreValue) -> None:
        self._call(lambda c: c.post(c.get_url("/kv/put"), json={"key": self._key(key), "value": _b64(value)}))

    def get(self, key: str) -> bytes:
        """The key's value, waiting for it up to the store's timeout (torch's DistStoreError then, as a
        TCPStore's get raises)."""
        deadline, poll = time.monotonic() + self._timeout_s, FIRST_POLL_S
        while True:
            found = self._range(key)
            if found is not None:
                return found[0]
            if time.monotonic() >= deadline:
                raise _store_timeout(f"wait timeout after {self._timeout_s:g}s for key {key!r} in etcd")
            time.sleep(poll)
            poll = min(2 * poll, MAX_POLL_S)

    def read_now(self, key: str) -> Optional[bytes]:
        """The key's value, None when absent, in one request: what a TCPStore needs `check` and `get` for
        (signed_records reads every record this way when the store has it - half the requests)."""
        found = self._range(key)
        return found[0] if found is not None else None

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the counter (created at 0); the new count. A compare-and-swap on the key's mod
        revision: concurrent adds of several agents all count."""
        for _ in range(_CAS_TRIES):
            found = self._range(key)
            if found is not None and amount == 0:
                return int(found[0] or b"0")
            now = (int(found[0] or b"0") if found is not None else 0) + amount
            cmp: dict[str, Any]
            if found is None:
                cmp = {"key": self._key(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            else:
                cmp = {"key": self._key(key), "result": "EQUAL", "target": "MOD", "mod_revision": found[1]}
            if self._txn([cmp], [self._put(key, str(now))]).get("succeeded"):
                return now
        raise EtcdUnreachable(f"the etcd counter {key!r} keeps changing under this agent")

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (one transaction: each key's create revision above 0)."""
        cmp = [{"key": self._key(k), "result": "GREATER", "target": "CREATE", "create_revision": 0} for k in keys]
        return bool(self._txn(cmp, []).get("succeeded"))

    def compare_set(self, key: str, expected_value: StoreValue, desired_value: StoreValue) -> bytes:
        """A TCPStore's compare_set: `desired` when the key held `expected` (or was absent and `expected` is
        empty); else the value it holds (`expected` when it is absent)."""
        expected, desired = _raw(expected_value), _raw(desired_value)
        k = self._key(key)
        read: list[dict[str, Any]] = [{"request_range": {"key": k}}]
        cmp: dict[str, Any]
        if expected:
            cmp = {"key": k, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        else:
            cmp = {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        got = self._txn([cmp], [self._put(key, desired)], read)
        if got.get("succeeded"):
            return desired
        kvs = ((got.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        if not kvs:
            return expected
        current = base64.b64decode(kvs[0].get("value", ""))
        if not expected and not current:    # present but empty: equal to the empty expected value
            again = {"key": k, "result": "EQUAL", "target": "VALUE", "value": ""}
            if self._txn([again], [self._put(key, desired)]).get("succeeded"):
                return desired
        return current

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        """Until every key exists (torch's DistStoreError after `timeout`, default the store's)."""
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline, poll = time.monotonic() + limit, FIRST_POLL_S
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise _store_timeout(f"wait timeout after {limit:g}s for keys {keys!r} in etcd")
            time.sleep(poll)
            poll = min(2 * poll, MAX_POLL_S)

    def delete_key(self, key: str) -> bool:
        got = self._call(lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": self._key(key)}))
        return int(got.get("deleted", 0)) > 0

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()


def _session(conf: EtcdConf) -> Any:
    """The HTTP session of one member's client. Not from the environment: requests lets REQUESTS_CA_BUNDLE
    override a session's own CA file (so `cacert` would be ignored wherever that variable is set), and an
    HTTP(S)_PROXY meant for the internet must not carry the job's coordination records; the environment's CA
    bundle is still used when no `cacert` is given."""
    import requests
    session = requests.Session()
    session.trust_env = False
    session.verify = conf.cacert or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    if conf.cert and conf.key:
        session.cert = (conf.cert, conf.key)
    return session


def _store_timeout(message: str) -> Exception:
    """torch's DistStoreError (what a TCPStore's get raises on its timeout), for callers that tell it apart."""
    try:
        from torch.distributed import DistStoreError
        return DistStoreError(message)
    except ImportError:   # torch without distributed: a plain timeout
        return TimeoutError(message)
