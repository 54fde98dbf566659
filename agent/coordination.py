"""Job-wide state in the coordination store: restart generation, restart budget, failure, completion.

The generation moves only forward and only through the store: the first agent to claim `restart/<g+1>`
owns that restart and spends one unit of the job-wide budget; an agent that asks later joins the same
generation. A watcher thread per agent (its own connection) turns changes made by other nodes into loop
events.

Every record that changes the job's fate is signed with a key derived from the job secret
(hyperpodrun/auth.py) and bound to the run id and the record's name: the generation, the restart claims
and the budget spent, the failure record, the workers' store port, and the per-node completion and
barrier marks. The store itself authenticates nobody (as torchrun's), so a record someone else wrote is
ignored - reported once as `forged_record` - and a counter is only a hint whose count is confirmed
through signed per-node marks. What a store writer can still do is listed in the README, Security.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
from typing import Any, Callable, Optional

from hyperpodrun import auth

log = logging.getLogger("hyperpodrun.agent")

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
                     "(written by something outside the job; see README, Security)")


class SignedRecords:
    """Signed string records in a (prefixed) store. Not thread-safe: one instance per store connection."""

    def __init__(self, store: Any, key: bytes, run_id: str, forged: Callable[[str], None]) -> None:
        self.store = store
        self._key = key
        self._run = run_id
        self._forged = forged
        self._last: dict[str, str] = {}     # the newest valid value seen per name

    def _pack(self, name: str, value: str) -> bytes:
        return auth.sign(self._key, f"{self._run}/{name}={value}".encode())

    def _unpack(self, name: str, raw: bytes) -> Optional[str]:
        """The value of a record we signed for `name`; None (and reported) for anything else."""
        try:
            payload = auth.verify(self._key, raw).decode()
        except (auth.AuthError, UnicodeDecodeError):
            payload = ""
        prefix = f"{self._run}/{name}="
        if not payload.startswith(prefix):
            self._forged(name)
            return None
        return payload[len(prefix):]

    def _raw(self, name: str) -> bytes:
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
    def mark(self, name: str, node: int, on: bool = True) -> None:
        """Set (or take back) this node's signed mark `name`; the plain counter `name` moves with it."""
        self.write(f"{name}/node{node}", "1" if on else "0")
        self.store.add(name, 1 if on else -1)

    def count(self, name: str, nnodes: int) -> int:
        """How many nodes set mark `name`. The counter says when it is worth checking the signed marks."""
        hint = int(self.store.add(name, 0))
        if hint < nnodes:
            return max(hint, 0)
        marked = 0
        for node in range(nnodes):
            raw = self._raw(f"{name}/node{node}")
            if raw and self._unpack(f"{name}/node{node}", raw) == "1":
                marked += 1
        if marked < nnodes and hint > nnodes:
            self._forged(name)
        return marked


class Coordinator:
    """Main-thread view of the job-wide keys. `store` is already prefixed to the run."""

    def __init__(self, store: Any, nnodes: int, max_restarts: int, *, key: bytes, run_id: str, node_rank: int,
                 on_forged: Callable[[str], None]) -> None:
        self.store = store
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.node_rank = node_rank
        self._key = key
        self._run = run_id
        self.forgeries = Forgeries(on_forged)
        self.records = SignedRecords(store, key, run_id, self.forgeries)
        self._me = f"node{node_rank}:{secrets.token_hex(8)}"   # tells our claims from another agent's

    def records_for(self, store: Any) -> SignedRecords:
        """Signed records over another connection to the same store (the watcher's)."""
        return SignedRecords(store, self._key, self._run, self.forgeries)

    def generation(self) -> int:
        return int(self.records.read("gen") or 0)

    def request_restart(self, current: int, reason: dict[str, Any], count_budget: bool = True
                        ) -> tuple[int, bool, bool]:
        """Ask for generation current+1 -> (target generation, we started it, budget allows it).

        In-process restarts move the generation without spending the --max-restarts budget
        (count_budget=False); process-level restarts spend one unit."""
        latest = self.generation()
        if latest > current:
            return latest, False, True  # someone already moved it: fold our failure into theirs
        target = current + 1
        if self.records.claim(f"restart/{target}", self._me) != self._me:
            return target, False, True
        if count_budget:
            used = int(self.records.update("restarts_used", lambda u: str(int(u or 0) + 1)))
            if used > self.max_restarts:
                return target, True, False
        self.records.write(f"restart/{target}/reason", json.dumps(reason, default=str))
        # the generation never moves backwards
        self.records.update("gen", lambda g: str(max(int(g or 0), target)))
        return target, True, True

    def restarts_used(self) -> int:
        return int(self.records.read("restarts_used") or 0)

    def report_failure(self, info: dict[str, Any]) -> None:
        """The job failed for good: tell every agent (first report wins)."""
        self.records.claim("failed", json.dumps(info, default=str))

    def failure(self) -> Optional[dict[str, Any]]:
        value = self.records.read("failed")
        return json.loads(value) if value is not None else None

    def publish_worker_store(self, generation: int, port: int) -> None:
        self.records.write(f"wstore/{generation}", str(port))

    def worker_store_port(self, generation: int) -> Optional[int]:
        value = self.records.read(f"wstore/{generation}")
        return int(value) if value is not None else None

    def mark_node(self, name: str, on: bool = True) -> None:
        """This node's signed mark `name` (e.g. in-process barrier `ipready/<g>`); on=False takes it back."""
        self.records.mark(name, self.node_rank, on)

    def nodes_marked(self, name: str) -> int:
        return self.records.count(name, self.nnodes)

    def mark_done(self, generation: int) -> None:
        self.mark_node(f"done/{generation}")

    def done_count(self, generation: int) -> int:
        return self.nodes_marked(f"done/{generation}")

    def mark_left(self) -> None:
        self.mark_node("left")

    def left_count(self) -> int:
        return self.nodes_marked("left")


class Watcher(threading.Thread):
    """Polls the job-wide keys over its own connection; posts ("generation", g) / ("failed", info)."""

    def __init__(self, open_store: Callable[[], Any], post: Callable[[tuple], None], interval: float,
                 records: Callable[[Any], SignedRecords]) -> None:
        super().__init__(name="hyperpodrun-watch", daemon=True)
        self._open_store = open_store
        self._post = post
        self._interval = interval
        self._records = records
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            records = self._records(self._open_store())
        except Exception as exc:  # the loop learns of a lost store through this event
            self._post(("store_lost", str(exc)))
            return
        seen_gen = -1
        failed_sent = False
        while not self._stop.wait(self._interval):
            try:
                gen = int(records.read("gen") or 0)
                if gen != seen_gen:
                    seen_gen = gen
                    self._post(("generation", gen))
                if not failed_sent:
                    failed = records.read("failed")
                    if failed is not None:
                        failed_sent = True
                        self._post(("failed", json.loads(failed)))
            except Exception as exc:
                if not self._stop.is_set():
                    self._post(("store_lost", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                return

    def stop(self) -> None:
        self._stop.set()
