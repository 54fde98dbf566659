"""The wrapped loader as a stream of batches indexed by global step, and how it is positioned at a step.

Three kinds of loaders, found by looking at the object (no registration):

- "sampler": a torch DataLoader whose sampler is a ResumableSampler (or has `resume_from(epoch, offset)`,
  or is one of torch's DistributedSampler / RandomSampler / SequentialSampler, which positioning.py
  makes resumable) and a fixed batch size. The position of step s is computed: epoch s // len(loader), batch s % len(loader);
  a new iterator starts right there (exact, for any step, with or without cached files).
- "state": an object with `state_dict()` / `load_state_dict()` (torchdata's StatefulDataLoader, or your
  own iterable). The state after every batch is stored with the batch in its cache file; a producer that
  starts again loads the state stored with the batch before the first missing one.
- "plain": anything else that iterates batches. It cannot be positioned: beyond the cached batches the
  stream is lost (DataStateLostError), unless the config says resume="replay" - then the epoch is read
  again from its start and batches are skipped (correct only when the loader yields the same batches
  every time it is iterated).

Epochs: the loader is iterated again for each epoch; before that `set_epoch(e)` is called on the loader,
its sampler, batch sampler and dataset where they have one. A torch DataLoader without a `generator`
gets a private one (seeded by epoch): otherwise every new iterator draws its worker seed from the global
torch RNG - from the producer thread, at moments that differ from run to run.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from hyperpodrun.data.positioning import make_resumable
from hyperpodrun.errors import DataStateLostError, OutOfOrderError

log = logging.getLogger("hyperpodrun.data")

_PRIVATE_GENERATORS: "weakref.WeakKeyDictionary[Any, torch.Generator]" = weakref.WeakKeyDictionary()


def _resumable_sampler(loader: Any) -> tuple[Any, int]:
    """(sampler, batch size) when `loader` is a DataLoader over a resumable sampler, else (None, 0)."""
    try:
        from torch.utils.data import BatchSampler, DataLoader
    except ImportError:  # pragma: no cover
        return None, 0
    if not isinstance(loader, DataLoader):
        return None, 0
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        sampler, size = loader.sampler, 1
    elif type(batch_sampler) is BatchSampler:
        sampler, size = batch_sampler.sampler, batch_sampler.batch_size
    else:
        return None, 0
    if callable(getattr(sampler, "resume_from", None)) or make_resumable(sampler, loader.generator):
        return sampler, size
    return None, 0


def describe(loader: Any) -> str:
    return f"{type(loader).__module__}.{type(loader).__qualname__}"


class Source:
    """Iterates the wrapped loader across epochs; `seek` positions it, `next` returns (batch, meta)."""

    def __init__(self, loader: Iterable, *, epochs: Optional[int] = None, replay: bool = False) -> None:
        self.loader: Any = loader   # duck-typed: what it offers besides iteration is in self.kind
        self.epochs = epochs
        self.replay = replay
        self.sampler, self.batch_size = _resumable_sampler(loader)
        if self.sampler is not None:
            self.kind = "sampler"
        elif callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            self.kind = "state"
        else:
            self.kind = "plain"
        self.step: Optional[int] = None    # step of the batch next() returns; None: not positioned
        #: a next() or seek() was left part-way (an exception, e.g. the interrupt of an in-process restart,
        #: landed inside it): `step` may no longer name the iterator's position, so whoever reads on seeks first
        self.moving = False
        self.epoch = 0
        self.index = 0                     # index within the epoch of the batch next() returns
        self._it: Optional[Iterator] = None
        self._fresh = False                # the current iterator started at the beginning of its epoch
        self.last_seek = ""                # how the last seek positioned the stream (tests, logs)
        self._generator = self._private_generator()

    @property
    def independent(self) -> bool:
        """True when two iterators of the loader share no state (a torch DataLoader over a ResumableSampler
        without persistent workers): a new producer need not wait until its predecessor let go of the loader."""
        from torch.utils.data import RandomSampler
        return self.kind == "sampler" and not getattr(self.loader, "persistent_workers", False) and \
            not isinstance(self.sampler, RandomSampler)   # its generator is state shared by every iterator

    # ------------------------------------------------------------------ helpers
    def _private_generator(self) -> Optional[torch.Generator]:
        try:
            from torch.utils.data import DataLoader
        except ImportError:  # pragma: no cover
            return None
        if not isinstance(self.loader, DataLoader):
            return None
        gen = _PRIVATE_GENERATORS.get(self.loader)
        if gen is None and self.loader.generator is None:
            gen = torch.Generator()
            self.loader.generator = gen
            _PRIVATE_GENERATORS[self.loader] = gen
        return gen

    def _set_epoch(self, epoch: int) -> None:
        seen: set[int] = set()
        loader = self.loader
        batch_sampler = getattr(loader, "batch_sampler", None)
        for obj in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                    getattr(loader, "dataset", None)):
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            fn = getattr(obj, "set_epoch", None)
            if callable(fn):
                fn(epoch)
        if self._generator is not None:
            base = int(getattr(self.sampler, "seed", 0) or 0)
            self._generator.manual_seed((base * 1_000_003 + epoch) & (2 ** 63 - 1))

    def _open(self, epoch: int, index: int, state: Any = None) -> Iterator[Any]:
        """A new iterator over `epoch` whose first batch is `index` (state: the loader's state there)."""
        self._it = None   # drop the old iterator first (its DataLoader workers end)
        self._set_epoch(epoch)
        if self.kind == "sampler" and index:
            self.sampler.resume_from(epoch, index * self.batch_size)
        if state is not None:
            self.loader.load_state_dict(state)
        it = self._it = iter(self.loader)
        self._fresh = index == 0 and state is None
        self.epoch, self.index = epoch, index
        return it

    def _skip(self, count: int) -> None:
        for _ in range(count):
            if self.next() is None:
                return

    def _lost(self, step: int, why: str) -> DataStateLostError:
        return DataStateLostError(
            f"cannot resume the data stream at step {step}: {why}, and {describe(self.loader)} has no resumable "
            "state. Use a torch DataLoader with hyperpodrun.data.ResumableSampler, a loader with state_dict()/"
            "load_state_dict() (torchdata's StatefulDataLoader), or CacheResumeMMAPConfig(resume='replay') if "
            "the loader yields the same batches every time it is iterated")

    # ------------------------------------------------------------------ positioning
    def seek(self, step: int, cached_meta: Callable[[int], Optional[dict]], cached_steps: Iterable[int] = (),
             why: str = "") -> None:
        """Position the stream so that next() returns the batch of `step`.

        cached_meta(k): the stored meta of batch k when it is in the cache; cached_steps: the steps there.
        """
        self.moving = True          # cleared only once positioned: a seek cut short is no position
        self._seek(step, cached_meta, cached_steps, why)
        self.moving = False

    def _seek(self, step: int, cached_meta: Callable[[int], Optional[dict]], cached_steps: Iterable[int],
              why: str) -> None:
        if step == 0:
            self._open(0, 0)
            self.step, self.last_seek = 0, "start"
            return
        if self.kind == "sampler":
            per_epoch = len(self.loader)
            if per_epoch <= 0:
                self._open(0, 0)
                self.step, self.last_seek = 0, "start"
                self._skip(step)
                return
            epoch, index = divmod(step, per_epoch)
            self._open(epoch, index)
            self.step, self.last_seek = step, "index"
            return
        before = sorted((k for k in cached_steps if k < step), reverse=True)
        anchor = None
        for k in before:
            anchor = cached_meta(k)
            if anchor is not None:
                break
        if self.kind == "state" and anchor is not None and anchor.get("state") is not None:
            self._open(anchor["epoch"], anchor["index"] + 1, anchor["state"])
            self.step = anchor["step"] + 1
            self.last_seek = "state" if self.step == step else "state+skip"
            self._skip(step - self.step)
            return
        if not self.replay:
            raise self._lost(step, why or f"batch {step} and the one before it are not in the MMAP cache")
        if anchor is not None:
            self._open(anchor["epoch"], 0)
            self.step = anchor["step"] - anchor["index"]
        else:
            self._open(0, 0)
            self.step = 0
        self.last_seek = "replay"
        log.warning("MMAP cache: replaying %s from step %d to reach step %d (resume='replay')",
                    describe(self.loader), self.step, step)
        self._skip(step - self.step)

    # ------------------------------------------------------------------ iteration
    def next(self) -> Optional[tuple[Any, dict]]:
        """The batch of step `self.step` and its meta, or None when the data ran out."""
        if self.step is None:
            raise OutOfOrderError("Source.next() before seek()")
        self.moving = True          # the iterator advances before `step` does: cleared once both agree again
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                self.moving = False
                return None
            it = self._it if self._it is not None else self._open(self.epoch, 0)
            try:
                batch = next(it)
            except StopIteration:
                empty = self._fresh and self.index == 0
                self._it = None
                if empty:
                    log.warning("MMAP cache: %s yielded no batch in epoch %d; the stream ends at step %d",
                                describe(self.loader), self.epoch, self.step)
                    self.moving = False
                    return None
                self.epoch, self.index = self.epoch + 1, 0
                continue
            meta = {"step": self.step, "epoch": self.epoch, "index": self.index,
                    "state": self.loader.state_dict() if self.kind == "state" else None}
            self.step += 1
            self.index += 1
            self.moving = False
            return batch, meta

    def close(self) -> None:
        self._it = None


__all__ = ["Source", "describe"]
