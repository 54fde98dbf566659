"""Signed records in the coordination store: every record that changes the job's fate carries an HMAC under a
key derived from the job secret, bound to the run id and the record's name; a record someone else wrote is
ignored and reported once (`forged_record`).

Why a module of its own: the job-wide state (job_state.py), node membership (membership.py) and elastic
layouts (layout.py) all keep their records this way, and job_state builds on the other two - with the
records here, the imports go one way. The job secret those records are signed with is agreed here too
(`agree_secret`, at the rendezvous).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from hyperpodrun import auth
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.ports import KVStore
from hyperpodrun.errors import RendezvousError

#: how often a compare-and-set is tried again when another agent changed the record meanwhile
_CAS_TRIES = 64


class Forgeries:
    """Reports each record name found forged once, from any thread."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self._report = report
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> None:
        with self._lock:
            if name in self._seen:
                return
            self._seen.add(name)
        self._report(f"ignored the coordination store record {name!r}: it is not signed with the job's key "
                     "(written by something outside the job; see docs/security.md)")


class SignedRecords:
    """Signed string records in a (prefixed) store. Not thread-safe: one instance per store connection."""

    def __init__(self, store: KVStore, key: bytes, run_id: str, forged: Callable[[str], None]) -> None:
        self.store = store
        self._key = key
        self._run = run_id
        self._forged = forged
        self._last: dict[str, str] = {}     # the newest valid value seen per name

    def _pack(self, name: str, value: str) -> bytes:
        return auth.sign(self._key, f"{self._run}/{name}={value}".encode())

    def verified(self, name: str, raw: bytes) -> Optional[str]:
        """The value of `raw` when it is a record of this job signed for `name`; None for anything else."""
        try:
            payload = auth.verify(self._key, raw).decode()
        except (auth.AuthError, UnicodeDecodeError):
            return None
        prefix = f"{self._run}/{name}="
        return payload[len(prefix):] if payload.startswith(prefix) else None

    def _unpack(self, name: str, raw: bytes) -> Optional[str]:
        """The value of a record we signed for `name`; None (and reported) for anything else."""
        value = self.verified(name, raw)
        if value is None:
            self._forged(name)
        return value

    def _raw(self, name: str) -> bytes:
        read_now = getattr(self.store, "read_now", None)   # etcd: one request (etcd_store.EtcdStore.read_now)
        if read_now is not None:
            return bytes(read_now(name) or b"")
        return bytes(self.store.get(name)) if self.store.check([name]) else b""

    def read(self, name: str) -> Optional[str]:
        """The record's value; None when absent. A forged record reads as the last valid value seen here."""
        raw = self._raw(name)
        if not raw:
            return None
        value = self._unpack(name, raw)
        if value is None:
            return self._last.get(name)
        self._last[name] = value
        return value

    def write(self, name: str, value: str) -> None:
        self.store.set(name, self._pack(name, value))
        self._last[name] = value

    def claim(self, name: str, value: str) -> Optional[str]:
        """First valid writer wins: the winning value (`value` when it is ours). A forged occupant is replaced;
        None if someone keeps replacing it (an attacker on the store: the claim is not made)."""
        mine = self._pack(name, value)
        expected = b""
        for _ in range(_CAS_TRIES):
            got = bytes(self.store.compare_set(name, expected, mine))
            if got == mine:
                self._last[name] = value
                return value
            theirs = self._unpack(name, got) if got else None
            if theirs is not None:
                self._last[name] = theirs
                return theirs
            expected = got
        return None

    def update(self, name: str, fn: Callable[[Optional[str]], str]) -> str:
        """Atomically replace the value by fn(current) (compare-and-set; current None when absent, the last
        valid value seen when the record is forged); returns the value written."""
        for _ in range(_CAS_TRIES):
            raw = self._raw(name)
            current = self._unpack(name, raw) if raw else None
            if raw and current is None:
                current = self._last.get(name)
            new = fn(current)
            packed = self._pack(name, new)
            if bytes(self.store.compare_set(name, raw, packed)) == packed:
                self._last[name] = new
                return new
        raise auth.AuthError(f"the coordination store record {name!r} keeps changing under this agent "
                             "(something outside the job writes it)")

    # ------------------------------------------------------------ per-node marks with a counter as hint
    def mark(self, name: str, node: int, on: bool = True) -> int:
        """Set (or take back) this node's signed mark `name`; the plain counter `name` moves with it (returned:
        the count this mark made). Taking a mark back also breaks the seal (`count`)."""
        self.write(K.node_mark(name, node), "1" if on else "0")
        counted = int(self.store.add(name, 1 if on else -1))
        if not on and self.store.check([K.sealed(name)]):
            self.write(K.sealed(name), "")
        return counted

    def count(self, name: str, nodes: Sequence[int], verify: bool = True) -> int:
        """How many of `nodes` set mark `name`. The counter says when it is worth checking the signed marks: below
        len(nodes) it is returned as is (an upper bound: it may include nodes outside the job that marked).

        Once the marks of every node are verified, that is said once in a signed *seal* (the nodes it covers),
        and whoever counts next reads that one record instead of N marks: with every agent of a round asking,
        reading the marks each would cost the store N*N reads per round. An agent that should not read the
        marks itself (`verify` False: another is to seal them) gets len(nodes) - 1 while the counter says
        complete and no seal is there yet."""
        sealed = self.read(K.sealed(name))
        if sealed and set(nodes) <= {int(n) for n in sealed.split(",")}:
            return len(nodes)
        hint = int(self.store.add(name, 0))
        if hint < len(nodes):
            return max(hint, 0)
        if not verify:
            return len(nodes) - 1
        marked = 0
        for node in nodes:
            if self._marked(name, node):
                marked += 1
        if marked < len(nodes) and hint > len(nodes):
            # more counted than marked: forged, unless nodes outside the job now (lost, dropped) marked too
            outside = [n for n in range(max(nodes, default=-1) + 1 + hint) if n not in nodes]
            if marked + sum(self._marked(name, n) for n in outside) < hint:
                self._forged(name)
        if nodes and marked == len(nodes):
            self.write(K.sealed(name), ",".join(str(n) for n in sorted(nodes)))
        return marked

    def _marked(self, name: str, node: int) -> bool:
        mark = K.node_mark(name, node)
        raw = self._raw(mark)
        return bool(raw) and self._unpack(mark, raw) == "1"


def agree_secret(store: KVStore, given: Optional[bytes], run_id: str, where: str) -> tuple[bytes, str]:
    """The job secret every agent of the run uses -> (secret, warning or "").

    The first agent sets the store's `auth` record: "user:<HMAC of the run id>" with a user secret (the
    others check theirs gives the same, so two nodes with different secrets fail here, plainly, instead of
    ignoring each other's records later), or "agreed:<random secret>" without one."""
    if given is not None:
        mine = "user:" + auth.derive(auth.derive(given, "check"), run_id).hex()
    else:
        mine = "agreed:" + auth.new_secret().decode()
    got = store.compare_set(K.AUTH, "", mine).decode()
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
               f"To fix this, {fix}; see docs/security.md")
    return got.removeprefix("agreed:").encode(), warning
