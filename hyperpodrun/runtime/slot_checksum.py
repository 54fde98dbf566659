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

import os
import threading
import zlib
from typing import Optional

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


class ChunkSums:
    """CRC32s of the `chunk`-byte pieces of view[start:start+length], summed by worker threads as the
    region fills: `advance(end)` says bytes [0, end) of the region are final, `result()` waits for (and
    helps with) the rest, `cancel()` stops the workers (the slot is abandoned)."""

    def __init__(self, view: memoryview, start: int, length: int, chunk: int = CHUNK,
                 threads: Optional[int] = None) -> None:
        self.view, self.base, self.length, self.chunk = view, start, length, chunk
        self.n = (length + chunk - 1) // chunk
        self.crcs = [0] * self.n
        self._filled = 0
        self._next = 0
        self._cancelled = False
        self._cv = threading.Condition()
        self._helpers = max(0, min((threads or crc_threads()) - 1, self.n - 1))   # result()'s caller helps too
        self._threads: list[threading.Thread] = []

    def start(self) -> "ChunkSums":
        """Start the worker threads now, to sum behind a copy that leaves the CPUs free (GPU DMA). A copy
        by the CPU (torch's own threads) is better not competed with: then they start in result()."""
        if not self._threads and self._helpers:
            self._threads = [threading.Thread(target=self._work, name="hyperpodrun-crc", daemon=True)
                             for _ in range(self._helpers)]
            for t in self._threads:
                t.start()
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

    def result(self) -> list[int]:
        self.advance(self.length)
        self.start()
        self._work()
        for t in self._threads:
            t.join()
        return self.crcs

    def cancel(self) -> None:
        with self._cv:
            self._cancelled = True
            self._cv.notify_all()


def chunk_crcs(view: memoryview, start: int, length: int, chunk: int = CHUNK) -> list[int]:
    """The chunks' CRC32s of a region that is already complete (verifying a slot)."""
    sums = ChunkSums(view, start, length, chunk)
    return sums.result()


__all__ = ["CHUNK", "ChunkSums", "chunk_crcs", "crc_threads"]
