"""The agent event log: JSON lines in the run's log dir, readable lines on stderr.

Every worker start and exit, fault, restart phase and shutdown is one record with a wall-clock
timestamp and, where it ends a phase, its duration. `hyperpodrun logs --events` renders the file.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any, Optional

from hyperpodrun import safe_fs

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
        # never through a symlink someone put there, and not readable by other users (safe_fs.py)
        try:
            fd = safe_fs.open_append(path)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise safe_fs.UnsafePathError(f"{path} is a symlink; hyperpodrun does not write its logs through "
                                          "symlinks. Remove it (someone else may have planted it)") from None
        self._fh = os.fdopen(fd, "a", buffering=1)
        for rec in self._pending:
            rec["node"] = node_rank
            self._write(json.dumps(rec, default=str) + "\n")
        self._pending.clear()

    def _write(self, line: str) -> None:
        """Append one record in one write (O_APPEND, past the text buffer). A full or broken log filesystem
        loses records, with one warning on stderr; it never stops the agent."""
        assert self._fh is not None
        try:
            data = memoryview(line.encode())
            while data:
                data = data[os.write(self._fh.fileno(), data):]
        except OSError as exc:
            if not getattr(self, "_write_failed", False):
                self._write_failed = True
                log.warning("cannot write the event log (%s); dropping event records while it cannot be written "
                            "(the job goes on)", exc.strerror or exc)

    def emit(self, event: str, message: str = "", *, level: int = logging.INFO, **fields: Any) -> dict[str, Any]:
        """Record one event; `message` is the human line, `fields` the structured data."""
        rec: dict[str, Any] = {"ts": round(time.time(), 6), "event": event, "host": self.host}
        if self.node_rank is not None:
            rec["node"] = self.node_rank
        rec.update({k: v for k, v in fields.items() if v is not None})
        if message:
            rec["msg"] = message
        if self._fh is not None:
            self._write(json.dumps(rec, default=str) + "\n")
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
