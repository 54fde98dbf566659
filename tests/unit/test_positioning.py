"""torch's own samplers resumed at any step by the MMAP cache's Source (hyperpodrun/data/positioning.py):
the batches from a seek are the ones a run without a restart reads there, and the order is the one plain
PyTorch yields wherever the sampler has a generator of its own."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from hyperpodrun.data.positioning import make_resumable
from hyperpodrun.data.source import Source

N, BATCH, EPOCHS = 40, 4, 3   # 10 batches per epoch (5 per replica of two)


def loader(kind: str) -> DataLoader:
    data = list(range(N))
    if kind == "distributed":
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=7))
    if kind == "sequential":
        return DataLoader(data, batch_size=BATCH, sampler=SequentialSampler(data))
    if kind == "shuffle-generator":   # the generator is shared by the sampler and the loader's base seed
        return DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(11))
    if kind == "sampler-generator":
        return DataLoader(data, batch_size=BATCH,
                          sampler=RandomSampler(data, generator=torch.Generator().manual_seed(12)))
    assert kind == "shuffle"           # no generator: seeded from torch.initial_seed() and the epoch
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def stream(source: Source, start: int, count: int) -> list[list[int]]:
    source.seek(start, lambda _k: None)
    out = []
    for _ in range(count):
        item = source.next()
        assert item is not None
        out.append(item[0].tolist())
    return out


KINDS = ["distributed", "sequential", "shuffle-generator", "sampler-generator", "shuffle"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_seek_reads_what_an_uninterrupted_run_reads(kind):
    per_epoch = len(loader(kind))
    total = per_epoch * EPOCHS
    reference = stream(Source(loader(kind), epochs=EPOCHS), 0, total)
    for start in (1, per_epoch - 1, per_epoch, per_epoch + 3, 2 * per_epoch + 1):
        fresh = Source(loader(kind), epochs=EPOCHS)   # a new process: nothing read before
        assert fresh.kind == "sampler"
        assert stream(fresh, start, total - start) == reference[start:], f"{kind}: seek to {start}"
    again = Source(loader(kind), epochs=EPOCHS)       # the same loader positioned twice, backwards too
    assert stream(again, 2 * per_epoch + 2, 3) == reference[2 * per_epoch + 2:2 * per_epoch + 5]
    assert stream(again, 3, 4) == reference[3:7]


@pytest.mark.parametrize("kind", ["distributed", "shuffle-generator", "sampler-generator", "sequential"])
def test_the_order_is_plain_pytorchs(kind):
    plain = loader(kind)
    expected = []
    for epoch in range(EPOCHS):
        if isinstance(plain.sampler, DistributedSampler):
            plain.sampler.set_epoch(epoch)
        expected += [b.tolist() for b in plain]
    assert stream(Source(loader(kind), epochs=EPOCHS), 0, len(expected)) == expected


def test_a_sampler_with_its_own_iteration_is_left_alone():
    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(range(len(self.data_source) - 1, -1, -1))
    dl = DataLoader(list(range(8)), batch_size=2, sampler=Reversed(list(range(8))))
    assert not make_resumable(dl.sampler)
    assert Source(dl).kind == "plain"
    assert [b.tolist() for b in dl] == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_a_resumable_sampler_stays_the_same_object_of_a_subclass():
    sampler = DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    assert make_resumable(sampler) and make_resumable(sampler)
    assert isinstance(sampler, DistributedSampler) and type(sampler).__mro__[1] is DistributedSampler
    sampler.resume_from(1, 2)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler)[2:] == first
