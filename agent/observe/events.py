"""The agent event log: one record per event, fanned out to sinks (the JSONL file, the console, ...).

Every worker start and exit, fault, restart phase and shutdown is one record with a wall-clock
timestamp and, where it ends a phase, its duration. `hyperpodrun logs --events` renders the file.
The EventLog only builds records; where they go is up to its sinks (the EventSink port, agent/ports.py):
a metrics exporter is one more `add_sink` (docs/ARCHITECTURE.md, "Ports").
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import IO, Any, Mapping, Optional

from hyperpodrun import safe_fs
from hyperpodrun.agent.ports import Clock, EventSink, SystemClock

log = logging.getLogger("hyperpodrun.agent")


class ConsoleSink:
    """The human line of each record, through the agent's logger (stderr)."""

    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        log.log(level, "%s", message or record.get("event"))

    def close(self) -> None:
        pass


class JsonlSink:
    """The run's `node<N>.events.jsonl`: one JSON line per record, never through a symlink, mode 0600."""

    def __init__(self, path: str) -> None:
        try:
            fd = safe_fs.open_append(path)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise safe_fs.UnsafePathError(f"{path} is a symlink; hyperpodrun does not write its logs through "
                                          "symlinks. Remove it (someone else may have planted it)") from None
        self._fh: Optional[IO[str]] = os.fdopen(fd, "a", buffering=1)
        self._write_failed = False
        self._torn = False      # the file ends in part of a record (a write that ran out of space midway)

    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        """Append one record in one write (O_APPEND, past the text buffer). A full or broken log filesystem
        loses records, with one warning on stderr; it never stops the agent."""
        if self._fh is None:
            return
        # after a torn record the next one starts on a line of its own: else, once there is space again, it
        # would be glued to the torn one and be lost with it (a reader skips the line it cannot parse)
        payload = ("\n" if self._torn else "") + json.dumps(record, default=str) + "\n"
        data = memoryview(payload.encode())
        whole = len(data)
        try:
            while data:
                data = data[os.write(self._fh.fileno(), data):]
            self._torn = False
        except OSError as exc:
            self._torn = self._torn or len(data) != whole
            if not self._write_failed:
                self._write_failed = True
                log.warning("cannot write the event log (%s); dropping event records while it cannot be written "
                            "(the job goes on)", exc.strerror or exc)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class EventLog:
    """Builds event records and hands each to every sink. The console sees records at once; the records made
    before the run directory is known are kept (`_pending`) and written to the file sink that `open` adds."""

    def __init__(self, host: str, clock: Optional[Clock] = None, console: bool = True) -> None:
        self.host = host
        self.node_rank: Optional[int] = None
        self._clock: Clock = clock or SystemClock()
        self._sinks: list[EventSink] = [ConsoleSink()] if console else []
        self._pending: Optional[list[dict[str, Any]]] = []   # None once a file sink took them

    def add_sink(self, sink: EventSink) -> None:
        """Send every record from now on to `sink` too."""
        self._sinks.append(sink)

    def open(self, path: str, node_rank: int) -> None:
        """The run directory is known: records go to `path` from now on, the earlier ones first."""
        sink = JsonlSink(path)
        self.node_rank = node_rank
        for rec in self._pending or []:
            rec["node"] = node_rank
            sink.write(rec, logging.DEBUG, str(rec.get("msg", "")))
        self._pending = None
        self.add_sink(sink)

    def emit(self, event: str, message: str = "", *, level: int = logging.INFO, **fields: Any) -> dict[str, Any]:
        """Record one event; `message` is the human line, `fields` the structured data."""
        rec: dict[str, Any] = {"ts": round(self._clock.time(), 6), "event": event, "host": self.host}
        if self.node_rank is not None:
            rec["node"] = self.node_rank
        rec.update({k: v for k, v in fields.items() if v is not None})
        if message:
            rec["msg"] = message
        if self._pending is not None:
            self._pending.append(rec)
        for sink in self._sinks:
            sink.write(rec, level, message)
        return rec

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


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
