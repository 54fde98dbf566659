"""ResumableSampler: a DistributedSampler-like sampler that can start an epoch at any sample.

A plain `DataLoader` keeps no position: after a restart it can only start an epoch from the beginning.
With this sampler the MMAP cache positions a new DataLoader iterator directly at batch `b` of epoch `e`
(`resume_from(e, b * batch_size)`), so a restarted producer continues behind the cached batches without
reading the skipped ones again. The order depends only on (seed, epoch), as with DistributedSampler, and
the sampler draws no numbers from the global RNG.
"""
from __future__ import annotations

import math
from typing import Iterator, Sized, Union

import torch
from torch.utils.data import Sampler

from hyperpodrun.errors import ApiValueError


class ResumableSampler(Sampler[int]):
    """Indices of one replica's share of an epoch, optionally shuffled by (seed, epoch).

    data_source: the dataset (anything with len()) or its length.
    num_replicas, rank: shard like DistributedSampler (padding by repeating indices, or drop_last).
    State protocol: `state_dict()` / `load_state_dict()` with {"epoch", "offset"}; `resume_from(epoch,
    offset)`: the next `iter()` yields epoch `epoch` from its `offset`-th index (then offsets reset to 0).
    """

    def __init__(self, data_source: Union[Sized, int], *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, drop_last: bool = False) -> None:
        self.size = data_source if isinstance(data_source, int) else len(data_source)
        if self.size < 0:
            raise ApiValueError(f"ResumableSampler: negative dataset length {self.size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ApiValueError(f"ResumableSampler(num_replicas={num_replicas}, rank={rank}): need 0 <= rank < "
                                "num_replicas")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0

    def __len__(self) -> int:
        if self.drop_last:
            return self.size // self.num_replicas
        return math.ceil(self.size / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of `epoch` (as DistributedSampler.set_epoch)."""
        self.epoch = int(epoch)
        self.offset = 0

    def resume_from(self, epoch: int, offset: int) -> None:
        """Start the next iteration at index `offset` of this replica's share of `epoch`."""
        if offset < 0:
            raise ApiValueError(f"ResumableSampler.resume_from(offset={offset}): must be >= 0")
        self.epoch = int(epoch)
        self.offset = int(offset)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.resume_from(state["epoch"], state.get("offset", 0))

    def indices(self, epoch: int) -> list[int]:
        """This replica's indices of `epoch`, in order."""
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        per = len(self)
        total = per * self.num_replicas
        if self.drop_last:
            order = order[:total]
        elif order and total > len(order):
            order = (order * math.ceil(total / len(order)))[:total]
        return order[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        start, self.offset = self.offset, 0
        return iter(self.indices(self.epoch)[start:])


__all__ = ["ResumableSampler"]
