"""Tee worker log files to the console as whole lines with a `[host:rank]` prefix.

Workers write straight to their files (nothing in the agent can block them); one helper thread follows
the files and copies complete lines. A partial last line is held until its newline or the final flush.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import IO


@dataclass
class _Followed:
    path: str
    prefix: bytes
    out: IO[bytes]
    offset: int = 0
    partial: bytes = b""
    closing: bool = field(default=False)


class Tee:
    """Follows files and writes their new complete lines to console streams."""

    def __init__(self, interval: float = 0.05) -> None:
        self._interval = interval
        self._files: list[_Followed] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-tee", daemon=True)
        self._thread.start()

    def follow(self, path: str, prefix: str, out: IO[bytes]) -> None:
        start = os.path.getsize(path) if os.path.exists(path) else 0
        with self._lock:
            self._files.append(_Followed(path, prefix.encode(), out, offset=start))

    def release(self, path: str) -> None:
        """The writer is gone: copy what is left (partial line included) and stop following."""
        with self._lock:
            for f in [f for f in self._files if f.path == path]:
                self._pump(f, final=True)
                self._files.remove(f)

    def _pump(self, f: _Followed, final: bool = False) -> None:
        try:
            with open(f.path, "rb") as fh:
                fh.seek(f.offset)
                data = fh.read()
        except OSError:
            return
        if not data and not (final and f.partial):
            return
        f.offset += len(data)
        data = f.partial + data
        lines = data.split(b"\n")
        f.partial = lines.pop()
        if final and f.partial:
            lines.append(f.partial)
            f.partial = b""
        if lines:
            try:
                f.out.write(b"".join(f.prefix + line + b"\n" for line in lines))
                f.out.flush()
            except (OSError, ValueError):
                pass

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                for f in self._files:
                    self._pump(f)

    def close(self) -> None:
        with self._lock:
            for f in self._files:
                self._pump(f, final=True)
            self._files.clear()
        self._stop.set()
        self._thread.join(timeout=2)
