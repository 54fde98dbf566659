"""Processes outside the job: the agent's side of the roll call (hyperpodrun/runtime/roll_call.py).

Two parts, one idea - someone who is not the job is at the job's ports:

- `RollCallFailures`: a generation whose roll call failed (a worker exited with EXIT_INTRUDER, or raised
  RollCallError under HPWrapper) is retried once on a fresh store - every round opens a new one - without
  spending --max-restarts or counting as a failure of the step; when it happens again the job ends with the
  roll call's own message and EXIT_INTRUDER. An outsider at a fresh port a second time is not bad luck.
- `IntruderWatch`: once a second the agent reads /proc/net/tcp{,6} (hyperpodrun/netwatch.py) for
  connections from another uid to its workers' store or to the ports its workers listen on (gloo, peer
  copies; looked up from the workers' fds every 5 s) and emits `foreign_connection` (uid, port) once per
  pair: the operator learns of a probe even when it never got as far as a group, and an outsider that
  broke the group's first collective and was gone before the rank that caught it read the tables is still
  named (RollCallFailures.known_uids). Once a second: a read of the tables walks the kernel's whole TCP hash
  (measured: 13 ms on a loaded 2-CPU VM). On one node this sees every local user; a client on another
  host is not in this host's tables.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Optional

from hyperpodrun import netwatch
from hyperpodrun.agent.ports import Events
from hyperpodrun.agent.observe.report import read_error_file
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.errors import EXIT_INTRUDER

log = logging.getLogger("hyperpodrun.agent")

#: a second failed roll call in one job ends it
MAX_RETRIES = 1
_PREFIX = "RollCallError: "


def roll_call_message(info: FailureInfo) -> str:
    """The worker's own sentence ("a process outside the job took rank 1's place in generation 0 (uid
    65534)"), from its Fault or its error file; a generic one when neither has it."""
    for text in (info.cause, info.summary, read_error_file(info.error_file) or ""):
        at = text.find(_PREFIX)
        if at >= 0:
            return text[at + len(_PREFIX):].strip().splitlines()[0]
    where = f" in generation {info.generation}" if info.generation is not None else ""
    return f"a process outside the job took a rank's place{where} (rank {info.rank} refused it)"


def is_roll_call_failure(info: FailureInfo) -> bool:
    """A failure caused by a failed roll call (exit code or exception type), not by the script."""
    return info.exit_code == EXIT_INTRUDER or info.exc_type == "RollCallError"


class RollCallFailures:
    """Counts the job's failed roll calls on this node and says whether to retry."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.seen = 0
        #: the uids the agent itself saw at the job's ports (IntruderWatch, wired by the node): they name the
        #: outsider when the rank could not (it had hung up before the rank read the tables)
        self.known_uids: Callable[[], set[int]] = set

    def _message(self, info: FailureInfo) -> str:
        message = roll_call_message(info)
        uids = self.known_uids()
        if "(uid unknown)" in message and uids:
            message = message.replace("(uid unknown)", f"(uid {', '.join(str(u) for u in sorted(uids))})", 1)
        return message

    def retry(self, info: FailureInfo) -> bool:
        """Report the failed roll call; True: retry the round (not counted), False: end the job with it."""
        message = self._message(info)
        self.seen += 1
        again = self.seen > MAX_RETRIES
        self.events.emit("roll_call_failed", f"roll call failed: {message}; " +
                         ("it happened again: ending the job" if again else
                          "retrying the generation on a fresh store (not counted against --max-restarts)"),
                         generation=info.generation, rank=info.rank, level=logging.ERROR)
        return not again

    def final(self, info: FailureInfo) -> FailureInfo:
        """The job's failure record for a recurring intruder: its message, EXIT_INTRUDER."""
        message = self._message(info)
        return info.with_(summary=message, cause=message, exit_code=EXIT_INTRUDER)


class IntruderWatch:
    """Emits `foreign_connection` for connections from another uid to the store's or the workers' ports."""

    def __init__(self, events: Events, store_ports: Callable[[], Iterable[int]],
                 worker_pids: Callable[[], Iterable[int]], interval: float = 5.0, look_every: float = 1.0,
                 uid: Optional[int] = None) -> None:
        """`interval`: seconds between two looks at which ports the workers listen on (their fds);
        `look_every`: seconds between two reads of the tables."""
        self.events = events
        self.store_ports = store_ports
        self.worker_pids = worker_pids
        self.interval = interval
        self.uid = os.getuid() if uid is None else uid
        self.reported: set[tuple[int, int]] = set()
        self.look_every = look_every
        self._next = 0.0
        self._next_look = 0.0
        self._listening: set[int] = set()

    def uids(self) -> set[int]:
        """Every foreign uid seen so far, after one more look now."""
        self.poll(max(self._next, self._next_look))
        return {uid for uid, _ in self.reported}

    def poll(self, now: float) -> list[tuple[int, int]]:
        """Look at the tables (every `look_every` s); returns the (uid, port) pairs reported now."""
        if now < self._next_look:
            return []
        self._next_look = now + self.look_every
        rows = netwatch.read_tables()
        if now >= self._next:
            self._next = now + self.interval
            self._listening = netwatch.listening_ports(self.worker_pids(), rows)
        stores = set(self.store_ports())
        ports = self._listening | stores
        if not ports:
            return []
        new = sorted(netwatch.foreign_clients(ports, uid=self.uid, rows=rows) - self.reported)
        for uid, port in new:
            self.reported.add((uid, port))
            what = "the workers' store" if port in stores else "a worker's port"
            self.events.emit("foreign_connection", f"a process of uid {uid} outside the job connected to {what} "
                             f"(port {port})", uid=uid, port=port, level=logging.WARNING)
        return new
