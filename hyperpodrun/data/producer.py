"""The producer: a thread that runs the wrapped loader ahead of the consumers into batch files.

Ownership (who starts, restarts and reaps it):
- It is a daemon thread of the rank process that holds the group's producer lock (group.py). Without a
  share_key every rank is its own group and owns it; with one, the first rank of the group on the node
  to ask owns it and the others only read.
- `MMAPDataLoader.iter_from()` starts it, and starts a new one at every call: after an in-process
  restart the wrapped function calls iter_from(restored step) again. The previous thread is fenced first
  (it can never commit another file). Unless the loader's iterators are independent (a torch DataLoader
  over a ResumableSampler without persistent workers), the new one waits for the old one to leave the
  wrapped loader first: it may be blocked up to 5 s in a DataLoader whose workers `finalize` ended.
  Consumers read the cached batches meanwhile.
- It ends when fenced (a newer producer, `close()`, interpreter exit) or when the cache cannot take a
  batch (DEGRADED). It dies with its process; the kernel then releases the lock, and the respawned rank
  - or, in a shared group, any surviving consumer - becomes the producer and continues from the files.

What it keeps: the batches of steps [m - lookback, m + prefetch) where m is the lowest step an unfinished
consumer reads (its position file), at most prefetch_length + lookback_length files: batches behind the
window are deleted; batches beyond it (a consumer went back after a restart) are kept while the bound
allows, so they are not produced twice. It fills the first missing step of that window; when its stream is not already there it
positions the wrapped loader with Source.seek (state of the cached batch before, or the step's index),
never by reading the batches in between again (except resume="replay").
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

from hyperpodrun.data import storage
from hyperpodrun.data.config import CacheResumeMMAPConfig
from hyperpodrun.data.errors import CacheFullError
from hyperpodrun.data.group import Group, batch_name
from hyperpodrun.data.source import Source

log = logging.getLogger("hyperpodrun.data")

#: how long a new producer waits for its fenced predecessor to leave the wrapped loader
PREDECESSOR_JOIN_S = 30.0
#: a producer with nothing to do re-reads the consumers' positions this often (other processes' moves)
IDLE_POLL_S = 0.02
#: how long a fenced producer keeps its loader at most before tearing it down (see Producer.retired)
RETIRE_WAIT_S = 10.0


class Producer(threading.Thread):
    """Fills one group's window of batch files from `source` (see the module doc)."""

    def __init__(self, group: Group, source: Source, config: CacheResumeMMAPConfig,
                 predecessor: Optional["Producer"] = None) -> None:
        super().__init__(name=f"hyperpodrun-mmap-producer[{os.path.basename(group.path)}]", daemon=True)
        self.group = group
        self.source = source
        self.config = config
        self.predecessor = predecessor
        self._fenced = False
        #: set when a fenced producer may tear its loader down (after its successor started: the consumer's
        #: first batch after a restart is not slowed by a DataLoader shutting down in this process)
        self.retired = threading.Event()
        self.sizes: dict[int, int] = {}
        #: (step, how) of every time the stream was positioned: start, index, state, replay (tests, logs)
        self.seeks: list[tuple[int, str]] = []
        self.end: Optional[int] = None
        self.written = 0
        self.max_files = 0
        self.max_bytes = 0

    # ------------------------------------------------------------------ control (any thread)
    def fence(self) -> None:
        """Stop: after this returns the producer commits no file any more. It is not woken: an idle one
        leaves within IDLE_POLL_S by itself, so its teardown does not compete for the GIL with the
        consumer's first batch after a restart."""
        with self.group.commit_lock:
            self._fenced = True

    @property
    def fenced(self) -> bool:
        return self._fenced

    # ------------------------------------------------------------------ thread
    def run(self) -> None:
        try:
            if self.predecessor is not None and not self.source.independent:
                self.predecessor.join(PREDECESSOR_JOIN_S)
                if self.predecessor.is_alive():
                    log.warning("the previous MMAP producer of %s is still inside the wrapped loader after %gs; "
                                "starting anyway", self.group.path, PREDECESSOR_JOIN_S)
                self.predecessor = None
            if self._fenced:
                return
            self.group.clean_tmp()
            self.sizes = self.group.steps()
            self.end = self.group.end_step()   # only the producer writes END: read once
            self._loop()
        except BaseException as exc:
            with self.group.commit_lock:
                mine = not self._fenced
                if mine:
                    self.group.error = exc
            if mine:
                log.warning("MMAP producer of %s failed: %s: %s", self.group.path, type(exc).__name__, exc)
            with self.group.cond:
                self.group.cond.notify_all()
        finally:
            if self._fenced:
                self.retired.wait(RETIRE_WAIT_S)
            self.source.close()

    def _idle(self) -> None:
        with self.group.cond:
            if not self._fenced:
                self.group.cond.wait(IDLE_POLL_S)

    def _remove(self, step: int) -> None:
        try:
            os.unlink(self.group.batch_path(step))
        except FileNotFoundError:
            pass
        del self.sizes[step]

    def _trim(self, lo: int, hi: int, room: int = 0) -> None:
        """Delete the batches behind the window; batches beyond it (left by a consumer that went back after
        a restart) stay while the bound allows, so they need not be produced again."""
        for step in [s for s in self.sizes if s < lo]:
            self._remove(step)
        ahead = sorted((s for s in self.sizes if s >= hi), reverse=True)
        while ahead and len(self.sizes) + room > self.config.window:
            self._remove(ahead.pop(0))

    def _loop(self) -> None:
        cfg = self.config
        while not self._fenced:
            low = self.group.min_position()
            if low is None:
                self._idle()
                continue
            end = self.end
            hi = low + cfg.prefetch_length if end is None else min(low + cfg.prefetch_length, end)
            self._trim(low - cfg.lookback_length, max(hi, low))
            target = next((s for s in range(low, hi) if s not in self.sizes), None)
            if target is None:
                self._idle()
                continue
            self._trim(low - cfg.lookback_length, max(hi, low), room=1)
            if self.source.step != target or self.source.moving:
                self.source.seek(target, self.group.meta, list(self.sizes))
                self.seeks.append((target, self.source.last_seek))
                log.info("MMAP producer %s: stream positioned at step %d (%s)", self.group.path, target,
                         self.source.last_seek)
            item = self.source.next()
            if item is None:
                self.end = self.source.step or 0
                self.group.mark_end(self.end)
                with self.group.cond:
                    self.group.cond.notify_all()
                continue
            batch, meta = item
            if not self._write(meta["step"], batch, meta):
                return

    # ------------------------------------------------------------------ writing
    def _reserve(self, size: int) -> None:
        cap = self.config.max_bytes
        used = sum(self.sizes.values())
        if cap is not None and used + size > cap:
            raise CacheFullError(f"a batch of {size} bytes does not fit max_bytes={cap} ({used} bytes in use)")

    def _write(self, step: int, batch: Any, meta: dict) -> bool:
        """Write and commit one batch; False when the cache cannot take it (the group is degraded)."""
        tmp = os.path.join(self.group.path, f".{batch_name(step)}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            size = storage.write_batch(tmp, batch, meta, reserve=self._reserve)
        except Exception as exc:   # full, unwritable, unpicklable: never a crash, never a wrong batch
            with self.group.commit_lock:
                if self._fenced:
                    return False
                self._fenced = True
            self.retired.set()
            self.group.mark_degraded(f"batch {step} not cached: {type(exc).__name__}: {exc}")
            return False
        with self.group.commit_lock:
            if self._fenced:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                return False
            storage.commit(tmp, self.group.batch_path(step))
        self.sizes[step] = size
        self.written += 1
        self.max_files = max(self.max_files, len(self.sizes))
        self.max_bytes = max(self.max_bytes, sum(self.sizes.values()))
        with self.group.cond:
            self.group.cond.notify_all()
        return True


__all__ = ["Producer"]
