"""MMAPDataLoader: the consumer side. Batches by step from the MMAP cache, resumable at any restored step.

    loader = MMAPDataLoader(DataLoader(ds, batch_size=32, sampler=ResumableSampler(ds), num_workers=4),
                            CacheResumeMMAPConfig())   # cache in /dev/shm/pdl_cache-<uid>

    @HPWrapper(checkpoint_manager=cm)
    def main(caller=None):
        ...
        start = cm.restore(state) or 0
        for step, batch in loader.iter_from(start, stop=steps):
            ...

`iter_from(step)` maps batch `step`, `step + 1`, ... from the cache as the producer (producer.py) writes
them; after any restart - in-process, a respawned rank, a process-level restart - it is called with the
restored step and the first batch is there at once if it was cached (the lookback keeps the batches
just behind the current step), while a new producer continues behind the cached ones.

When is a stream finished (its files may go at exit): when it reached `stop`, when the wrapped loader
ran out, or after `close()`. At interpreter exit a process removes the groups whose consumers all
finished; a process that ends any other way (an exception, a signal, a kill) leaves them for the restart.

Degraded mode: when the cache directory cannot be created or written, is full, or `max_bytes` is
reached, the loader logs one warning and reads the wrapped loader directly from the current step on,
positioned the same way a producer is - the batches are the same, only the restart benefit is lost.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from typing import Any, Iterable, Iterator, Optional, Sized

from hyperpodrun.errors import ApiTypeError, ApiValueError, UnsafePathError
from hyperpodrun.data import group as groups
from hyperpodrun.data import housekeeping, storage
from hyperpodrun.data.config import CacheResumeMMAPConfig
from hyperpodrun.data.errors import CacheCorruptError, CacheTimeoutError
from hyperpodrun.data.producer import Producer
from hyperpodrun.data.source import Source

log = logging.getLogger("hyperpodrun.data")

_END = object()
_DEGRADED = object()
_WARNED = False
_ATEXIT = threading.Lock()
_ATEXIT_DONE = False
#: a consumer in a shared group retries to become the producer this often while it waits
TAKEOVER_POLL_S = 0.1


def _warn_degraded(where: str, reason: str) -> None:
    """One warning per process, however many loaders and restarts."""
    global _WARNED
    if _WARNED:
        log.info("MMAP data cache off for %s: %s", where, reason)
        return
    _WARNED = True
    log.warning("MMAP data cache off for %s: %s; reading the wrapped loader directly (same batches; a "
                "restart reads the data again). Give the cache more room (Docker --shm-size, a larger "
                "Kubernetes emptyDir sizeLimit, CacheResumeMMAPConfig(max_bytes=...)) or a writable cache_dir",
                where, reason)


def shutdown() -> None:
    """Stop this process's producers and leave the cache: groups whose consumers all finished are removed,
    and the run directory when no other process uses it. Runs at interpreter exit; callable earlier."""
    groups.close_all()
    housekeeping.release_runs()


_REGISTERED = False


def _register_at_exit() -> None:
    global _REGISTERED
    if not _REGISTERED:
        _REGISTERED = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    global _ATEXIT_DONE
    with _ATEXIT:
        if _ATEXIT_DONE:
            return
        _ATEXIT_DONE = True
    shutdown()


class MMAPDataLoader:
    """Wraps a DataLoader (or any iterable of batches) and serves its batches by step from the MMAP cache.

    loader: the wrapped loader; how it is resumed after a restart is decided by what it is (source.py):
        a DataLoader over a ResumableSampler, a state_dict()/load_state_dict() loader, or a plain iterable.
    config: CacheResumeMMAPConfig (defaults: /dev/shm/pdl_cache-<uid>, prefetch 10, lookback 2).
    epochs: how many epochs the stream has (None: as many as are read). Steps count across epochs.
    name: tells apart the loaders of one rank (e.g. "train", "val"); part of the file names.
    rank: this consumer's rank (default: the RANK environment variable, 0 without one).
    """

    def __init__(self, loader: Iterable, config: Optional[CacheResumeMMAPConfig] = None, *,
                 epochs: Optional[int] = None, name: str = "train", rank: Optional[int] = None) -> None:
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ApiValueError(f"MMAPDataLoader(epochs={epochs!r}): a positive number of epochs, or None")
        self.loader = loader
        self.config = config if config is not None else CacheResumeMMAPConfig()
        self.epochs = epochs
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] or "loader"
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self.cursor = 0                   # the next step __iter__ / state_dict refer to
        self.stats: dict[str, Any] = {"cached": 0, "direct": 0, "wait_s": 0.0, "first_batch_s": None}
        self._token = 0
        self._direct: Optional[Source] = None
        self._pending: Optional[tuple[int, Any, dict, str]] = None
        self._group: Optional[groups.Group] = None

    # ------------------------------------------------------------------ public API
    def iter_from(self, step: int, stop: Optional[int] = None) -> Iterator[tuple[int, Any]]:
        """(step, batch) for step = `step`, `step` + 1, ... up to `stop` (exclusive) or the end of the data."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ApiValueError(f"iter_from(step={step!r}): a step index >= 0 (e.g. the restored step)")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop < step):
            raise ApiValueError(f"iter_from(stop={stop!r}): None or a step >= {step}")
        return self._stream(step, stop, one_epoch=False)

    def __iter__(self) -> Iterator[Any]:
        """The batches of one epoch from the cursor on (what Lightning's epoch loop iterates)."""
        return (batch for _, batch in self._stream(self.cursor, None, one_epoch=True))

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):
            raise ApiTypeError(f"{type(self.loader).__qualname__} has no len(), so the MMAPDataLoader over it has "
                               "none either")
        return len(self.loader)

    def state_dict(self) -> dict:
        """{"step": the next step}: put the loader into your checkpoint state to resume it with the model."""
        return {"step": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["step"])

    def close(self) -> None:
        """This rank is done with the stream: its files may be removed at exit; this process stops producing."""
        self._token += 1
        group = self._group
        if group is not None:
            group.set_position(self.rank, self.cursor, finished=True)
            if group.producer is not None and all(done for _, done in group.positions().values()):
                group.producer.fence()   # nobody needs more batches
                group.producer.retired.set()
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    def release(self) -> None:
        """close(), and leave the cache now instead of at exit: this process's producer stops and the stream's
        files are removed when every consumer finished (use it when nothing can ask for a batch again)."""
        self.close()
        group, self._group = self._group, None
        if group is not None:
            groups.release(group.path)

    @property
    def producer(self) -> Optional[Producer]:
        """This process's producer of this loader's group (None when another rank produces)."""
        return self._group.producer if self._group is not None else None

    @property
    def group_dir(self) -> Optional[str]:
        return self._group.path if self._group is not None else None

    # ------------------------------------------------------------------ internals
    def _open_group(self) -> Optional[groups.Group]:
        cfg = self.config
        if not cfg.enabled:
            return None
        key = f"share-{cfg.share_key}" if cfg.share_key else f"rank{self.rank}"
        try:
            run = housekeeping.open_run(cfg.cache_dir, cfg.cleanup_stale)
            group = groups.get(os.path.join(run.path, f"{self.name}.{key}"))
        except (OSError, UnsafePathError) as exc:   # not ours alone (another user's, a symlink): never read it
            _warn_degraded(cfg.cache_dir, f"cache_dir cannot be used ({exc})")
            return None
        _register_at_exit()
        self._group = group
        return group

    def _start_producer(self, group: groups.Group) -> None:
        old = group.producer
        if old is not None:
            old.fence()
        group.error = None
        source = Source(self.loader, epochs=self.epochs, replay=self.config.resume == "replay")
        group.producer = Producer(group, source, self.config, predecessor=old)
        group.producer.start()
        if old is not None:
            old.retired.set()

    def _direct_source(self, group: Optional[groups.Group], step: int) -> Source:
        if self._direct is None:
            self._direct = Source(self.loader, epochs=self.epochs, replay=self.config.resume == "replay")
        if self._direct.step != step or self._direct.moving:   # moving: a read of it was cut short
            cached = group.steps() if group is not None else {}
            meta = group.meta if group is not None else (lambda _k: None)
            self._direct.seek(step, meta, list(cached), why=f"batch {step} is not in the MMAP cache")
        return self._direct

    @staticmethod
    def _cached_now(group: groups.Group, step: int) -> Optional[tuple[Any, dict]]:
        """(batch, meta) of `step` if its file is in the cache now, else None (no waiting)."""
        try:
            batch, meta = storage.read_batch(group.batch_path(step))
        except (FileNotFoundError, CacheCorruptError):
            return None
        return (batch, meta) if meta.get("step") == step else None

    def _from_cache(self, group: groups.Group, step: int, start_producer: bool = False) -> tuple[Any, bool]:
        """((batch, meta) of `step` from the cache, waiting for the producer, or _END / _DEGRADED; whether it
        started this process's producer (`start_producer`: when the batch is not there yet)."""
        path = group.batch_path(step)
        started = False
        t0 = time.monotonic()
        deadline = t0 + self.config.wait_timeout
        next_takeover = t0
        pause = 0.0002
        while True:
            try:
                batch, meta = storage.read_batch(path)
            except FileNotFoundError:
                pass
            else:
                if meta.get("step") != step:
                    raise CacheCorruptError(f"{path} holds step {meta.get('step')}, not {step}")
                self.stats["wait_s"] += time.monotonic() - t0
                return (batch, meta), started
            if start_producer and not started:
                self._start_producer(group)
                started = True
            if group.degraded() is not None:
                return _DEGRADED, started
            end = group.end_step()
            if end is not None and step >= end:
                return _END, started
            now = time.monotonic()
            if group.owned:
                error = group.error
                if error is not None:
                    group.error = None
                    raise error
            elif now >= next_takeover:
                next_takeover = now + TAKEOVER_POLL_S
                if group.try_own():
                    log.info("rank %d takes over producing %s", self.rank, group.path)
                    self._start_producer(group)
                    continue
            if now >= deadline:
                raise CacheTimeoutError(
                    f"batch {step} did not appear in {group.path} within wait_timeout={self.config.wait_timeout:g}s "
                    f"(the producing rank is stuck); raise CacheResumeMMAPConfig(wait_timeout=...) if reading one "
                    "batch really takes that long")
            if group.owned:
                with group.cond:
                    if not os.path.exists(path) and group.error is None and group.degraded_reason is None:
                        group.cond.wait(0.05)
            else:
                time.sleep(pause)
                pause = min(pause * 2, 0.01)

    def _stream(self, start: int, stop: Optional[int], one_epoch: bool) -> Iterator[tuple[int, Any]]:
        self._token += 1
        token = self._token
        t_call = time.monotonic()
        group = self._open_group()
        produce = False          # this process produces: started once the first batch is in hand, so that
        if group is not None and group.degraded() is None:   # the new DataLoader's start does not delay it
            group.set_position(self.rank, start)
            if group.try_own():
                if group.producer is not None:
                    group.producer.fence()
                produce = True
        step, first_epoch, finished, first, warned = start, None, False, True, False
        try:
            while stop is None or step < stop:
                # the flag only (no file access per step): the marker is read when a batch is missing
                if group is not None and not warned and group.degraded_reason is not None:
                    _warn_degraded(group.path, group.degraded_reason)
                    warned = True
                if self._pending is not None and self._pending[0] == step:
                    _, batch, meta, origin = self._pending
                    self._pending = None
                elif group is not None and not warned:
                    group.set_position(self.rank, step)
                    got, started = self._from_cache(group, step, produce)
                    produce = produce and not started
                    if got is _END:
                        finished = True
                        break
                    if got is _DEGRADED:   # group.degraded() read the marker: degraded_reason is set
                        continue
                    batch, meta = got
                    origin = "cached"
                else:
                    # degraded (or no cache): a batch the producer had cached before still serves, until the
                    # first one missing; from there on the wrapped loader is read directly
                    item = self._cached_now(group, step) if group is not None and self._direct is None else None
                    origin = "cached"
                    if item is None:
                        item = self._direct_source(group, step).next()
                        origin = "direct"
                    if item is None:
                        finished = True
                        break
                    batch, meta = item
                if one_epoch:
                    if first_epoch is None:
                        first_epoch = meta["epoch"]
                    elif meta["epoch"] != first_epoch:
                        self._pending = (step, batch, meta, origin)
                        break
                if first:
                    self.stats["first_batch_s"] = time.monotonic() - t_call
                    first = False
                if produce and group is not None:   # produce is only ever set with a group
                    self._start_producer(group)
                    produce = False
                self.stats[origin] += 1
                self.cursor = step + 1
                yield step, batch
                step += 1
            else:
                finished = True
        finally:
            if finished and token == self._token and group is not None:
                group.set_position(self.rank, step, finished=True)


__all__ = ["MMAPDataLoader", "shutdown"]
