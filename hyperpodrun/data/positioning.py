"""Make torch's own samplers resumable: DistributedSampler, SequentialSampler and RandomSampler.

Why: most scripts never build a ResumableSampler. They pass `shuffle=True` to a DataLoader (a
RandomSampler), or Lightning / their own code puts a DistributedSampler in. Each of these is a function of
what it is told (DistributedSampler: seed and epoch; SequentialSampler: nothing; RandomSampler: the state
of its generator), so the MMAP cache can start an epoch at any sample without reading the ones before it.

How: `make_resumable(sampler)` gives the sampler object the `resume_from(epoch, offset)` protocol of
ResumableSampler by changing its class to a subclass that skips `offset` indices at the next `iter()`.
The object stays the same (a DataLoader refuses a new sampler once it is built), and so does every index
it yields: the same order as without hyperpodrun, apart from one case below.

- DistributedSampler (the class itself, as Lightning and most scripts make it): `set_epoch(e)` fixes the
  order; resuming is exact.
- SequentialSampler: exact.
- RandomSampler with a `generator` (`DataLoader(shuffle=True, generator=g)`): the order of epoch e is the
  one its generator yields after e epochs; the generator's state when the sampler was first seen is kept,
  and positioning at epoch e replays e epochs of draws from it (indices only, no data; with the
  DataLoader's base-seed draw when the loader shares the generator), so the order is the same as in a run
  that never restarted - provided the script makes the generator the same way each time (seeded where the
  loader is built).
- RandomSampler without a generator draws a fresh seed from the global torch RNG at every `iter()` -
  at moments that differ between a run and its restart. It gets a private generator seeded from
  `torch.initial_seed()` and the epoch: the order becomes a function of (seed, epoch) like
  DistributedSampler's (a different order from the one plain PyTorch would have drawn, the same in
  every run and restart of a script that seeds torch).

Subclasses that override `__iter__` (e.g. Lightning's DistributedSamplerWrapper, which re-samples another
sampler) are not touched: their order may depend on anything.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

log = logging.getLogger("hyperpodrun.data")

_BASES = (DistributedSampler, RandomSampler, SequentialSampler)


class _Resumable:
    """The methods put in front of a torch sampler class: `resume_from(epoch, offset)` skips indices at the
    next `iter()`; `set_epoch(epoch)` is available on every kind (Sequential: nothing changes).

    Not a mixin base: a class derived from it and from a torch sampler has another object layout, and an
    object's class can only change to one of the same layout; `make_resumable` copies these methods into a
    direct subclass of the torch class instead (`_hpr_base` names that class)."""

    _hpr_base: type = object
    _hpr_offset: int = 0
    _hpr_initial: Optional[torch.Tensor] = None    # RandomSampler: its generator's state when first seen
    _hpr_seed: Optional[int] = None                # RandomSampler without a generator: the private seed
    _hpr_drawn: int = 0                            # RandomSampler: epochs drawn since _hpr_initial
    _hpr_loader_draws: bool = False                # the DataLoader draws its base seed from the same generator

    def set_epoch(self, epoch: int) -> None:
        self._hpr_offset = 0
        if self._hpr_base is DistributedSampler:
            DistributedSampler.set_epoch(self, epoch)   # type: ignore[arg-type]
        elif self._hpr_base is RandomSampler:
            self._hpr_position(int(epoch))

    def resume_from(self, epoch: int, offset: int) -> None:
        """The next `iter()` yields epoch `epoch` from its `offset`-th index."""
        self.set_epoch(epoch)
        self._hpr_offset = int(offset)

    def _hpr_position(self, epoch: int) -> None:
        sampler: Any = self
        if self._hpr_seed is not None:
            sampler.generator.manual_seed((self._hpr_seed * 1_000_003 + epoch) & (2 ** 63 - 1))
            return
        if epoch == self._hpr_drawn:
            return    # the generator is where `epoch` starts (the usual case: epochs in order)
        sampler.generator.set_state(self._hpr_initial)
        self._hpr_drawn = 0
        for _ in range(epoch):   # replay the draws of the epochs before (indices only, no data)
            if self._hpr_loader_draws:   # iter(DataLoader) draws its workers' base seed first
                torch.empty((), dtype=torch.int64).random_(generator=sampler.generator)
            for _ in RandomSampler.__iter__(sampler):
                pass
            self._hpr_drawn += 1

    def __iter__(self) -> Iterator[int]:
        start, self._hpr_offset = self._hpr_offset, 0
        it = self._hpr_base.__iter__(self)   # type: ignore[attr-defined]
        if self._hpr_base is RandomSampler and self._hpr_seed is None:
            self._hpr_drawn += 1    # this iterator draws the epoch's order from the generator
        return itertools.islice(it, start, None) if start else it


_METHODS = {name: value for name, value in vars(_Resumable).items()
            if name.startswith("_hpr") or name in ("set_epoch", "resume_from", "__iter__")}
_CLASSES: dict[type, type] = {}


def resumable_kind(sampler: Any) -> Optional[type]:
    """The torch sampler class `sampler` is positioned as, or None when it cannot be positioned."""
    for base in _BASES:
        if isinstance(sampler, base) and type(sampler).__iter__ is base.__iter__:
            return base
    return None


def make_resumable(sampler: Any, loader_generator: Optional[torch.Generator] = None) -> bool:
    """Give `sampler` (in place) the `resume_from(epoch, offset)` protocol; False when it is not one of the
    samplers this module knows how to position (see the module doc). loader_generator: the `generator` of
    the DataLoader iterating it (`DataLoader(shuffle=True, generator=g)` shares g with its RandomSampler, and
    every `iter()` of the loader draws one number from it before the sampler draws the epoch's order)."""
    if getattr(type(sampler), "_hpr_base", None) is not None:
        return True
    base = resumable_kind(sampler)
    if base is None:
        return False
    cls = type(sampler)
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"Resumable{cls.__name__}", (cls,), {**_METHODS, "_hpr_base": base, "__module__": __name__,
                                                       "__doc__": cls.__doc__})
        _CLASSES[cls] = sub
    if base is RandomSampler:
        if sampler.generator is None:
            sampler.generator = torch.Generator()
            sampler._hpr_seed = int(torch.initial_seed())
            log.info("MMAP cache: RandomSampler without a generator gets one seeded by (torch.initial_seed(), "
                     "epoch) so that an epoch can be resumed")
        else:
            sampler._hpr_initial = sampler.generator.get_state()
            sampler._hpr_loader_draws = loader_generator is sampler.generator
    sampler.__class__ = sub
    return True


__all__ = ["make_resumable", "resumable_kind"]
