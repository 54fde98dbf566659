"""Worker output: the agent drains each worker's stdout/stderr pipe into its log file and, as whole lines
with a `[host:rank]: ` prefix, onto the console.

Why pipes and not files the workers write themselves: a worker's `print` must never be what fails a
training step. With a file, a full or broken log filesystem (ENOSPC, EIO) raises in the worker. With a
pipe the worker only ever writes into memory; the agent's pump thread empties it, and when it cannot write
a log file or the console it drops that output, says so once (`on_problem`, which the agent puts in its
event log and on stderr) and keeps going. Console lines go through their own writer thread and a bounded
queue, so a console that blocks (a stdout pipe nobody reads) or is closed never stops the pump - and never
the workers behind it. A partial last line is held until its newline or until the stream ends.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import selectors
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from hyperpodrun import safe_fs

log = logging.getLogger("hyperpodrun.agent")

F_SETPIPE_SZ = 1031
#: pipe capacity asked for (best effort): room for bursts while the pump is busy
PIPE_BYTES = 1 << 20
#: a line longer than this (no newline yet) goes to the console in pieces
MAX_PARTIAL = 64 * 1024
#: console bytes queued at most; beyond that console lines are dropped (the log files keep them)
CONSOLE_QUEUE_BYTES = 8 << 20


def worker_pipe() -> tuple[int, int]:
    """(read end for the agent, write end for the worker); the read end is non-blocking."""
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(r, False)
    try:
        fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass   # over the user's pipe-buffer allowance: the default 64 KiB
    return r, w


class Console:
    """Writes console lines from a bounded queue in its own thread (one per console fd)."""

    def __init__(self, fd: int, on_problem: Callable[[str, str], None]) -> None:
        self.fd = fd
        self._on_problem = on_problem
        self._queue: "collections.deque[bytes]" = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._broken = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"hyperpodrun-console-{fd}", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        with self._cond:
            if self._broken:
                return
            if self._queued + len(data) > CONSOLE_QUEUE_BYTES:
                self._on_problem("console-slow", f"the console (fd {self.fd}) does not keep up with the workers' "
                                 "output (a blocked stdout?): dropping console lines; the log files keep them")
                return
            self._queue.append(data)
            self._queued += len(data)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                data = b"".join(self._queue)
                self._queue.clear()
                self._queued = 0
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as exc:
                with self._cond:
                    self._broken = True
                    self._queue.clear()
                    self._queued = 0
                self._on_problem("console-broken", f"cannot write workers' output to the console (fd {self.fd}): "
                                 f"{exc.strerror or exc}; dropping it from the console (the log files keep it)")
                return

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (for at most `timeout` s: a blocked console is left behind)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)


@dataclass
class _Stream:
    key: int
    fd: int
    path: Optional[str]
    file_fd: Optional[int]
    console: Optional[Console]
    prefix: bytes
    partial: bytes = b""
    closed: bool = field(default=False)


class Tee:
    """Drains worker pipes into log files and console lines. `on_problem(message)` is called once per kind
    of trouble (a log file that cannot be written, a console that is broken or too slow), from any thread."""

    def __init__(self, on_problem: Optional[Callable[[str], None]] = None) -> None:
        self._on_problem_cb = on_problem
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}   # by stream key (never reused, unlike fd numbers)
        self._next_key = 0
        self._consoles: dict[int, Console] = {}
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-tee", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ problems
    def problem(self, kind: str, message: str) -> None:
        """Report lost output of `kind` ("file", "console-broken", ...): the first time only."""
        self._problem(kind, message)

    def _problem(self, kind: str, message: str) -> None:
        with self._warn_lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        if self._on_problem_cb is not None:
            try:
                self._on_problem_cb(message)
                return
            except Exception:   # never let a report of lost output stop the pump
                pass
        log.warning("%s", message)

    def console(self, fd: int) -> Console:
        with self._lock:
            if fd not in self._consoles:
                self._consoles[fd] = Console(fd, self._problem)
            return self._consoles[fd]

    # ------------------------------------------------------------------------------------ streams
    def attach(self, fd: int, path: Optional[str], console_fd: Optional[int], prefix: str) -> int:
        """Follow pipe read end `fd` (owned by the tee from now on): its bytes go to the log file `path` (if
        any, appended, created 0600, never through a symlink) and its lines to `console_fd` (if any).
        Returns the stream's key for release()."""
        file_fd = None
        if path is not None:
            try:
                file_fd = safe_fs.open_append(path)
            except OSError as exc:
                self._problem("file", f"cannot open the log file {path}: {exc.strerror or exc}; that output is "
                              "not kept in a file (the job goes on)")
        console = self.console(console_fd) if console_fd is not None else None
        with self._lock:
            self._next_key += 1
            stream = _Stream(self._next_key, fd, path, file_fd, console, prefix.encode())
            self._streams[stream.key] = stream
            self._sel.register(fd, selectors.EVENT_READ, stream)
        return stream.key

    def release(self, key: int) -> None:
        """The worker is gone: take what is left in its pipe (a partial last line too) and stop following."""
        with self._lock:
            stream = self._streams.get(key)
            if stream is not None:
                self._drain(stream)
                self._finish(stream)

    def _drain(self, stream: _Stream, chunks: int = 256) -> None:
        """Read until the pipe is empty (EAGAIN), closed (EOF: then the stream is finished) or `chunks` reads
        were made (a writer that never pauses must not hold the pump). Lock held."""
        for _ in range(chunks):
            if stream.closed:
                return
            try:
                data = os.read(stream.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._finish(stream)
                return
            self._deliver(stream, data)

    def _deliver(self, stream: _Stream, data: bytes) -> None:
        if stream.file_fd is not None:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(stream.file_fd, view):]
            except OSError as exc:   # ENOSPC, EIO, EDQUOT...: drop it from the file, keep draining the pipe
                self._problem("file", f"cannot write worker output to {stream.path}: {exc.strerror or exc}; "
                              "dropping output from the log files (the job goes on)")
        if stream.console is None:
            return
        data = stream.partial + data
        cut = data.rfind(b"\n") + 1
        if not cut and len(data) > MAX_PARTIAL:
            cut = len(data)
        stream.partial = data[cut:]
        if cut:
            self._to_console(stream, data[:cut])

    @staticmethod
    def _to_console(stream: _Stream, data: bytes) -> None:
        assert stream.console is not None
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        stream.console.put(b"".join(stream.prefix + line + b"\n" for line in lines))

    def _finish(self, stream: _Stream) -> None:
        """Flush the partial line, close the pipe and the file. Lock held."""
        if stream.closed:
            return
        stream.closed = True
        if stream.console is not None and stream.partial:
            self._to_console(stream, stream.partial)
            stream.partial = b""
        self._streams.pop(stream.key, None)
        try:
            self._sel.unregister(stream.fd)
        except (KeyError, ValueError):
            pass
        for fd in (stream.fd, stream.file_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    # ------------------------------------------------------------------------------------ pump thread
    def _run(self) -> None:
        while not self._stop:
            try:
                ready = self._sel.select(timeout=1.0)
            except (OSError, ValueError):   # a stream closed under us: select again
                continue
            for key, _ in ready:
                if key.data is None:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except OSError:
                        pass
                    continue
                with self._lock:
                    if not key.data.closed:
                        self._drain(key.data, chunks=4)

    def close(self) -> None:
        """Drain and close every stream, write what the consoles have queued, stop the threads."""
        with self._lock:
            for stream in list(self._streams.values()):
                self._drain(stream)
                self._finish(stream)
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)
        for console in list(self._consoles.values()):
            console.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
