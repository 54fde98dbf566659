"""The agent event log: JSON lines in the run's log dir, readable lines on stderr.

Every worker start and exit, fault, restart phase and shutdown is one record with a wall-clock
timestamp and, where it ends a phase, its duration. `hyperpodrun logs --events` renders the file.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Optional

log = logging.getLogger("hyperpodrun.agent")


class EventLog:
    """Append-only event records; buffered in memory until the run directory is known."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.node_rank: Optional[int] = None
        self._fh = None
        self._pending: list[dict[str, Any]] = []

    def open(self, path: str, node_rank: int) -> None:
        self.node_rank = node_rank
        self._fh = open(path, "a", buffering=1)
        for rec in self._pending:
            rec["node"] = node_rank
            self._fh.write(json.dumps(rec) + "\n")
        self._pending.clear()

    def emit(self, event: str, message: str = "", *, level: int = logging.INFO, **fields: Any) -> dict[str, Any]:
        """Record one event; `message` is the human line, `fields` the structured data."""
        rec: dict[str, Any] = {"ts": round(time.time(), 6), "event": event, "host": self.host}
        if self.node_rank is not None:
            rec["node"] = self.node_rank
        rec.update({k: v for k, v in fields.items() if v is not None})
        if message:
            rec["msg"] = message
        if self._fh is not None:
            self._fh.write(json.dumps(rec, default=str) + "\n")
        else:
            self._pending.append(rec)
        log.log(level, "%s", message or event)
        return rec

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def format_event(rec: dict[str, Any]) -> str:
    """One readable line for an event record (used by `hyperpodrun logs --events`)."""
    ts = time.strftime("%H:%M:%S", time.localtime(rec.get("ts", 0))) + f".{int(rec.get('ts', 0) * 1000) % 1000:03d}"
    where = f"{rec.get('host', '?')}/node{rec.get('node', '?')}"
    extras = []
    for key in ("generation", "rank", "pid", "duration_s", "downtime_s"):
        if key in rec:
            val = rec[key]
            extras.append(f"{key}={val:.3f}" if isinstance(val, float) else f"{key}={val}")
    msg = rec.get("msg", "")
    return f"{ts} {where} {rec.get('event', '?'):<18} {msg}" + (f"  [{' '.join(extras)}]" if extras else "")


def event_files(run_dir: str) -> list[str]:
    return sorted(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".events.jsonl"))
