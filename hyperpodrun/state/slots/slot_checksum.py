"""The checksum of a snapshot slot, computed while the slot is being filled.

Why like this: a slot holds the whole training state (12 GiB per rank for 1 B parameters with Adam),
and one thread of zlib.crc32 reads about 3 GiB/s - four times longer than the device-to-host copy
itself. So the data region is summed in 16 MiB chunks, by several threads (zlib releases the GIL), and
while the copy runs: for GPU tensors a chunk is summed as soon as the tensors covering it have been copied
(the copy waits on DMA with the GIL released, the CPUs are free); host tensors are copied by torch's
own threads, so their chunks are summed after the copy. The slot's checksum is the CRC32 of the header's
fields, the metadata and the chunks' CRC32s (snapshot_io.checksum).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import zlib
from typing import Callable, Optional

log = logging.getLogger("hyperpodrun.runtime")

CHUNK = 16 << 20
#: most threads one rank uses for its checksum (measured: 26 GiB/s with 16 threads on a 16-core host)
MAX_THREADS = 16


def crc_threads() -> int:
    """Threads for the checksum: this rank's share of the CPUs (LOCAL_WORLD_SIZE ranks per node)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(MAX_THREADS, cpus // local))


class _Helpers:
    """Daemon threads kept for the checksum work of every snapshot in this process.

    Why: a snapshot used to start its own 15 threads, and each `Thread.start()` waits until the new thread
    runs - milliseconds of the training thread's time per save, while the GPU idles. The threads are daemons
    (an abandoned job never keeps the process alive) and are made again in a forked child, which has none."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]]" = queue.SimpleQueue()
        self._idle = 0
        self._count = 0

    def run(self, job: Callable[[], None], copies: int, done: Callable[[], None]) -> None:
        """Have `copies` idle helpers run `job` (more threads are started when too few are idle); each calls
        `done()` after it is idle again, so a caller that waits for every `done` leaves the pool as it was."""
        with self._lock:
            jobs = self._jobs
            for _ in range(max(0, copies - self._idle)):
                t = threading.Thread(target=self._loop, args=(jobs,), name="hyperpodrun-crc", daemon=True)
                self._idle += 1
                self._count += 1
                t.start()        # waits until the thread runs: once per helper, not per snapshot
            self._idle -= copies
        for _ in range(copies):
            jobs.put((job, done))

    def _loop(self, jobs: "queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]]") -> None:
        if self.idle:
            _lowest_priority()
        while True:
            job, done = jobs.get()
            try:
                job()
            except BaseException:      # a job reports its own errors; the helper stays for the next one
                log.exception("checksum helper")
            with self._lock:
                if jobs is self._jobs:
                    self._idle += 1
            done()

    @property
    def threads(self) -> int:
        return self._count

    def forked(self) -> None:
        """In a forked child (os.register_at_fork): none of the parent's helpers, a lock no thread holds."""
        self._lock = threading.Lock()
        self._jobs, self._idle, self._count = queue.SimpleQueue(), 0, 0


def _lowest_priority() -> None:
    """Make the calling thread run only on CPU time nothing else wants (Linux SCHED_IDLE; else nice 19).

    Why: a snapshot's checksum is summed while training goes on. At normal priority 15 summing threads on a
    16-core host take the cores the training thread needs to launch its kernels (the step after a snapshot was
    ~25 ms slower on an H200 host); at idle priority they use what is left, and the writer thread, which helps
    at normal priority when it seals the slot, guarantees progress."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: this thread (a task of its own)
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


#: the same for other threads that work beside the training (the durable tier's writer)
lowest_priority = _lowest_priority

_HELPERS = _Helpers()                   # verifying a slot (a restore waits for it): normal priority
_BACKGROUND = _Helpers(idle=True)       # summing a slot while training goes on: idle priority
os.register_at_fork(after_in_child=_HELPERS.forked)
os.register_at_fork(after_in_child=_BACKGROUND.forked)


class ChunkSums:
    """CRC32s of the `chunk`-byte pieces of view[start:start+length], summed by helper threads as the
    region fills: `advance(end)` says bytes [0, end) of the region are final, `result()` waits for (and
    helps with) the rest, `cancel()` stops the helpers (the slot is abandoned)."""

    def __init__(self, view: memoryview, start: int, length: int, chunk: int = CHUNK,
                 threads: Optional[int] = None, background: bool = False) -> None:
        """`background`: summed beside the training (a snapshot being taken) - the helpers run at idle CPU
        priority (see _lowest_priority); else (a restore waits for it) at normal priority."""
        self.view, self.base, self.length, self.chunk = view, start, length, chunk
        self._pool = _BACKGROUND if background else _HELPERS
        self.n = (length + chunk - 1) // chunk
        self.crcs = [0] * self.n
        self._filled = 0
        self._next = 0
        self._summed = 0
        self._returned = 0         # helpers that are back in the pool
        self._cancelled = False
        self._cv = threading.Condition()
        self._helpers = max(0, min((threads or crc_threads()) - 1, self.n - 1))   # result()'s caller helps too
        self._started = False

    def start(self) -> "ChunkSums":
        """Put the helpers to work now, to sum behind a copy that leaves the CPUs free (GPU DMA). A copy
        by the CPU (torch's own threads) is better not competed with: then they start in result()."""
        if not self._started:
            self._started = True
            if self._helpers:
                self._pool.run(self._work, self._helpers, self._helper_done)
        return self

    def advance(self, end: int) -> None:
        with self._cv:
            if end > self._filled:
                self._filled = min(end, self.length)
                self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._cancelled and self._next < self.n and \
                        min((self._next + 1) * self.chunk, self.length) > self._filled:
                    self._cv.wait()
                if self._cancelled or self._next >= self.n:
                    return
                i = self._next
                self._next += 1
            a = self.base + i * self.chunk
            self.crcs[i] = zlib.crc32(self.view[a:a + min(self.chunk, self.length - i * self.chunk)])
            with self._cv:
                self._summed += 1
                if self._summed == self.n:
                    self._cv.notify_all()

    def _helper_done(self) -> None:
        with self._cv:
            self._returned += 1
            self._cv.notify_all()

    def result(self) -> list[int]:
        """The chunks' CRC32s, once every chunk is summed and every helper is back in the pool."""
        self.advance(self.length)
        self.start()
        self._work()
        with self._cv:
            while (self._summed < self.n or self._returned < self._helpers) and not self._cancelled:
                self._cv.wait()
        return self.crcs

    def cancel(self) -> None:
        with self._cv:
            self._cancelled = True
            self._cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """True once every helper put to work for this region is back in the pool (within `timeout` s)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._returned >= (self._helpers if self._started else 0), timeout)


def chunk_crcs(view: memoryview, start: int, length: int, chunk: int = CHUNK) -> list[int]:
    """The chunks' CRC32s of a region that is already complete (verifying a slot)."""
    sums = ChunkSums(view, start, length, chunk)
    return sums.result()


__all__ = ["CHUNK", "ChunkSums", "chunk_crcs", "crc_threads"]
