"""Worker output: the agent drains each worker's stdout/stderr pipe into its log file and, as whole lines
with a `[host:rank]: ` prefix, onto the console.

Why pipes and not files the workers write themselves: a worker's `print` must never be what fails a
training step. With a file, a full or broken log filesystem (ENOSPC, EIO) raises in the worker. With a
pipe the worker only ever writes into memory; the agent's pump thread empties it, and when it cannot write
a log file or the console it drops that output, says so once (`on_problem`, which the agent puts in its
event log and on stderr) and keeps going. Console lines go through their own writer thread and a bounded
queue, so a console that blocks (a stdout pipe nobody reads) or is closed never stops the pump - and never
the workers behind it. A partial last line is held until its newline or until the stream ends.

The agent's own log lines take the same road (`ConsoleLogHandler`): a stderr that nobody reads must not
stop the agent's loop in the middle of a log call, where it could no longer supervise anything. The rule
that keeps the loop free: no thread ever writes to a console while holding a lock that another thread
takes - the writer thread of a Console holds none while it writes, and `Console.put` only appends to a
bounded queue (dropping what does not fit).
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

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
    """Writes console lines from a bounded queue in its own thread (one per console fd).

    `put` never blocks: it appends to the queue, or drops the data when `max_bytes` are already waiting
    (counted in `dropped`, reported through `on_problem("console-slow", ...)`, called outside any lock). The
    writer thread holds no lock while it writes, so a blocked fd blocks only that thread."""

    def __init__(self, fd: int, on_problem: Callable[[str, str], None], what: str = "workers' output",
                 max_bytes: int = CONSOLE_QUEUE_BYTES) -> None:
        self.fd = fd
        self.what = what
        self.max_bytes = max_bytes
        #: puts dropped because the queue was full (the writer did not keep up)
        self.dropped = 0
        self._on_problem = on_problem
        self._queue: "collections.deque[bytes]" = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._writing = False
        self._broken = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"hyperpodrun-console-{fd}", daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        """Queue `data` for the console; never blocks."""
        with self._cond:
            if self._broken:
                return
            full = self._queued + len(data) > self.max_bytes
            if full:
                self.dropped += 1
            else:
                self._queue.append(data)
                self._queued += len(data)
                self._cond.notify()
        if full:
            stream = {1: "stdout", 2: "stderr"}.get(self.fd, "pipe")
            self._on_problem("console-slow", f"the console (fd {self.fd}) does not keep up with the {self.what} "
                             f"(a blocked {stream}?): dropping console lines; the log files keep them")

    def _run(self) -> None:
        while True:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                data = b"".join(self._queue)
                self._queue.clear()
                self._queued = 0
                self._writing = True
            try:   # no lock held: a blocked fd blocks this thread only
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as exc:
                with self._cond:
                    self._broken = True
                    self._writing = False
                    self._queue.clear()
                    self._queued = 0
                    self._cond.notify_all()
                self._on_problem("console-broken", f"cannot write {self.what} to the console (fd {self.fd}): "
                                 f"{exc.strerror or exc}; dropping it from the console (the log files keep it)")
                return

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until everything queued is written (at most `timeout` s); False if it was not."""
        end = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._writing) and not self._broken and self._thread.is_alive():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (for at most `timeout` s: a blocked console is left behind)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))


class ConsoleLogHandler(logging.Handler):
    """A logging handler that never blocks the thread that logs: records are formatted in the caller and
    written by a Console's writer thread (see the module doc). When the fd does not keep up, lines are
    dropped and the next line written says how many; on a closed or broken fd they are dropped silently
    (there is nowhere left to say so)."""

    def __init__(self, fd: int = 2, max_bytes: int = 1 << 20) -> None:
        super().__init__()
        self._noted = 0
        self.console = Console(fd, lambda _kind, _message: None, what="agent's log lines", max_bytes=max_bytes)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:   # never handleError(): it writes to sys.stderr, which may be the blocked fd
            return
        dropped = self.console.dropped
        if dropped > self._noted:
            self._noted = dropped
            line = (f"[hyperpodrun] {dropped} log line(s) dropped so far: the console (fd {self.console.fd}) did "
                    "not keep up (the event log keeps every event)\n" + line)
        self.console.put((line + "\n").encode(errors="replace"))

    def flush(self) -> None:
        self.console.flush(timeout=0.5)

    def close(self) -> None:
        """Write what is queued, for at most 2 s (a console nobody reads does not hold up the exit)."""
        self.console.close(timeout=2.0)
        super().close()


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
    dup_fd: Optional[int] = None             # --duplicate-*-filters: the filtered_*.log its matching lines go to
    dup_path: Optional[str] = None
    needles: tuple[bytes, ...] = ()


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
    def attach(self, fd: int, path: Optional[str], console_fd: Optional[int], prefix: str,
               duplicate: Optional[tuple[str, Sequence[str]]] = None) -> int:
        """Follow pipe read end `fd` (owned by the tee from now on): its bytes go to the log file `path` (if
        any, appended, created 0600, never through a symlink) and its lines to `console_fd` (if any);
        `duplicate` = (file, filters): the console lines that contain one of the filters are also appended,
        prefixed, to that file (torchrun's --duplicate-stdout/stderr-filters). Returns the stream's key for
        release()."""
        dup_fd = None
        if duplicate is not None and console_fd is not None:
            try:
                dup_fd = safe_fs.open_append(duplicate[0])
            except OSError as exc:
                self._problem("file", f"cannot open the log file {duplicate[0]}: {exc.strerror or exc}; that "
                              "output is not kept in a file (the job goes on)")
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
            stream = _Stream(self._next_key, fd, path, file_fd, console, prefix.encode(), dup_fd=dup_fd,
                             dup_path=duplicate[0] if duplicate else None,
                             needles=tuple(n.encode() for n in duplicate[1]) if duplicate else ())
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

    def _write_file(self, fd: int, path: Optional[str], data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:   # ENOSPC, EIO, EDQUOT...: drop it from the file, keep draining the pipe
            self._problem("file", f"cannot write worker output to {path}: {exc.strerror or exc}; "
                          "dropping output from the log files (the job goes on)")

    def _deliver(self, stream: _Stream, data: bytes) -> None:
        if stream.file_fd is not None:
            self._write_file(stream.file_fd, stream.path, data)
        if stream.console is None:
            return
        data = stream.partial + data
        cut = data.rfind(b"\n") + 1
        if not cut and len(data) > MAX_PARTIAL:
            cut = len(data)
        stream.partial = data[cut:]
        if cut:
            self._to_console(stream, data[:cut])

    def _to_console(self, stream: _Stream, data: bytes) -> None:
        assert stream.console is not None
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        stream.console.put(b"".join(stream.prefix + line + b"\n" for line in lines))
        if stream.dup_fd is not None:   # one write per batch of whole lines: the ranks' lines stay whole
            picked = b"".join(stream.prefix + line + b"\n" for line in lines
                              if any(needle in line for needle in stream.needles))
            if picked:
                self._write_file(stream.dup_fd, stream.dup_path, picked)

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
        for fd in (stream.fd, stream.file_fd, stream.dup_fd):
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
        end = time.monotonic() + 2.0   # for all consoles together: blocked ones are left behind
        for console in list(self._consoles.values()):
            console.close(timeout=end - time.monotonic())
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
