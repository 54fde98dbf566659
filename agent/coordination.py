"""Job-wide state in the coordination store: restart generation, restart budget, failure, completion.

The generation moves only forward and only through the store: the first agent to ask for g+1 (an
atomic `add` on `restart/<g+1>` returns 1) owns that restart and spends one unit of the job-wide budget;
an agent that asks later joins the same generation. A watcher thread per agent (its own connection)
turns changes made by other nodes into loop events.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("hyperpodrun.agent")


class Coordinator:
    """Main-thread view of the job-wide keys. `store` is already prefixed to the run."""

    def __init__(self, store: Any, nnodes: int, max_restarts: int) -> None:
        self.store = store
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.store.add("gen", 0)  # creates the key at 0 if absent

    def generation(self) -> int:
        return int(self.store.add("gen", 0))

    def request_restart(self, current: int, reason: dict[str, Any], count_budget: bool = True
                        ) -> tuple[int, bool, bool]:
        """Ask for generation current+1 -> (target generation, we started it, budget allows it).

        In-process restarts move the generation without spending the --max-restarts budget
        (count_budget=False); process-level restarts spend one unit."""
        latest = self.generation()
        if latest > current:
            return latest, False, True  # someone already moved it: fold our failure into theirs
        target = current + 1
        first = self.store.add(f"restart/{target}", 1) == 1
        if not first:
            return target, False, True
        used = self.store.add("restarts_used", 1 if count_budget else 0)
        if count_budget and used > self.max_restarts:
            return target, True, False
        self.store.set(f"restart/{target}/reason", json.dumps(reason, default=str))
        # the generation key is a counter: add the difference so it never moves backwards
        self.store.add("gen", target - latest)
        return target, True, True

    def restarts_used(self) -> int:
        return int(self.store.add("restarts_used", 0))

    def report_failure(self, info: dict[str, Any]) -> None:
        """The job failed for good: tell every agent (first report wins)."""
        if self.store.add("failed/claim", 1) == 1:
            self.store.set("failed", json.dumps(info, default=str))

    def failure(self) -> Optional[dict[str, Any]]:
        if self.store.check(["failed"]):
            return json.loads(self.store.get("failed"))
        return None

    def publish_worker_store(self, generation: int, port: int) -> None:
        self.store.set(f"wstore/{generation}", str(port))

    def worker_store_port(self, generation: int) -> Optional[int]:
        key = f"wstore/{generation}"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def mark_done(self, generation: int) -> None:
        self.store.add(f"done/{generation}", 1)

    def done_count(self, generation: int) -> int:
        return int(self.store.add(f"done/{generation}", 0))

    def mark_left(self) -> int:
        return int(self.store.add("left", 1))

    def left_count(self) -> int:
        return int(self.store.add("left", 0))


class Watcher(threading.Thread):
    """Polls the job-wide keys over its own connection; posts ("generation", g) / ("failed", info)."""

    def __init__(self, open_store: Callable[[], Any], post: Callable[[tuple], None], interval: float) -> None:
        super().__init__(name="hyperpodrun-watch", daemon=True)
        self._open_store = open_store
        self._post = post
        self._interval = interval
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            store = self._open_store()
        except Exception as exc:  # the loop learns of a lost store through this event
            self._post(("store_lost", str(exc)))
            return
        seen_gen = -1
        failed_sent = False
        while not self._stop.wait(self._interval):
            try:
                gen = int(store.add("gen", 0))
                if gen != seen_gen:
                    seen_gen = gen
                    self._post(("generation", gen))
                if not failed_sent and store.check(["failed"]):
                    failed_sent = True
                    self._post(("failed", json.loads(store.get("failed"))))
            except Exception as exc:
                if not self._stop.is_set():
                    self._post(("store_lost", str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                return

    def stop(self) -> None:
        self._stop.set()
