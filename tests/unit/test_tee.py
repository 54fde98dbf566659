"""Console output never stops the agent (agent/workers/tee.py): a console nobody reads blocks only its writer
thread - never a caller of `Console.put`, of the agent's logging, or of the tee's attach/release."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from hyperpodrun.agent.workers import tee as T


def _returns_within(seconds: float, fn: Callable[[], object]) -> None:
    """Run `fn` in a thread; fail if it has not returned after `seconds` (it would be blocked for good)."""
    done = threading.Event()
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:   # re-raised below, in the test's thread
            box.append(exc)
        finally:
            done.set()
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"blocked for more than {seconds:g}s"
    if box:
        raise box[0]


@pytest.fixture
def blocked_pipe() -> Iterator[tuple[int, int]]:
    """(read end, write end) of a pipe nobody reads, already full."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"\0" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    yield r, w
    os.close(r)
    os.close(w)


def test_the_writer_holds_no_lock_while_it_writes(blocked_pipe: tuple[int, int]) -> None:
    console = T.Console(blocked_pipe[1], lambda kind, msg: None)
    console.put(b"line\n")
    deadline = time.monotonic() + 5
    while not console._writing:          # the writer took the line and is now stuck in os.write
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert console._cond.acquire(timeout=1), "the writer thread holds the console's lock while it writes"
    console._cond.release()
    _returns_within(1, lambda: [console.put(b"more\n") for _ in range(1000)])


def test_a_slow_problem_report_does_not_hold_up_other_puts(blocked_pipe: tuple[int, int]) -> None:
    """The overflow report runs outside the console's lock: while one thread is in it (a logger that is slow
    to write, say), another thread's put() still returns."""
    release = threading.Event()
    entered = threading.Event()

    def slow_report(kind: str, message: str) -> None:
        entered.set()
        release.wait(10)
    console = T.Console(blocked_pipe[1], slow_report, max_bytes=1024)
    first = threading.Thread(target=console.put, args=(b"x" * 4096,), daemon=True)   # too big: dropped, reported
    first.start()
    assert entered.wait(5)
    try:
        _returns_within(1, lambda: console.put(b"y\n"))
        assert console.dropped == 1
    finally:
        release.set()
        first.join(5)


def test_log_handler_never_blocks_the_logging_thread(blocked_pipe: tuple[int, int]) -> None:
    r, w = blocked_pipe
    handler = T.ConsoleLogHandler(w, max_bytes=64 * 1024)
    logger = logging.getLogger("hyperpodrun.test-tee")
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        _returns_within(10, lambda: [logger.warning("agent line %d %s", i, "z" * 200) for i in range(5000)])
        assert handler.console.dropped > 0, "1 MB of lines into a blocked 64 KB pipe and a 64 KB queue"
        drained = bytearray()
        stop = threading.Event()

        def drain() -> None:
            os.set_blocking(r, False)
            while not stop.is_set():
                try:
                    drained.extend(os.read(r, 1 << 16))
                except BlockingIOError:
                    time.sleep(0.01)
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        deadline = time.monotonic() + 10
        while b"after the jam" not in drained:
            logger.warning("after the jam")
            assert time.monotonic() < deadline, "the handler never wrote again once the reader came back"
            time.sleep(0.05)
        stop.set()
        reader.join(5)
        assert b"log line(s) dropped so far" in drained, "the next line says that lines were dropped"
    finally:
        logger.handlers[:] = []
        _returns_within(5, handler.close)


def test_release_and_close_are_not_blocked_by_a_blocked_console(tmp_path: Path,
                                                                blocked_pipe: tuple[int, int]) -> None:
    """The loop thread calls release() when a worker ends and close() at exit: neither waits for a console
    that nobody reads; the log file still gets every byte."""
    tee = T.Tee()
    r, w = T.worker_pipe()
    key = tee.attach(r, str(tmp_path / "out.log"), blocked_pipe[1], "[h:0]: ")
    data = b"".join(b"line %d\n" % i for i in range(100_000))   # ~ 1 MB
    writer = threading.Thread(target=lambda: (os.write(w, data), os.close(w)), daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive(), "the pump drains the worker's pipe although the console is blocked"
    _returns_within(5, lambda: tee.release(key))
    assert (tmp_path / "out.log").read_bytes() == data
    started = time.monotonic()
    _returns_within(10, tee.close)
    assert time.monotonic() - started < 5, "close gives a blocked console at most 2 s"
