"""MMAPDataLoader in one process: resume at a restored step from the cache and the loader's state (never by
re-reading batches), sources that cannot resume, the size bound, degraded reading (size cap, unwritable
dir, a real tiny tmpfs), waiting limits, epochs."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hyperpodrun.data import CacheResumeMMAPConfig, MMAPDataLoader, ResumableSampler
from hyperpodrun.data import loader as loader_mod
from hyperpodrun.data.errors import CacheTimeoutError, DataStateLostError

sys.path.insert(0, os.path.dirname(__file__))
from conftest import wait_until  # noqa: E402

BATCH = 4


class Counting(Dataset):
    """Sample i is a deterministic function of i; `reads` lists every index read."""

    def __init__(self, n: int = 96, width: int = 32) -> None:
        self.n, self.width, self.reads = n, width, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads.append(i)
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(self.width, generator=g), "i": i}


class Stateful:
    """A loader with the StatefulDataLoader protocol: 6 batches per epoch, state = position in the epoch."""

    def __init__(self) -> None:
        self.pos, self.epoch, self.made = 0, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self):
        while self.pos < 6:
            key = (self.epoch, self.pos)
            self.made.append(key)
            self.pos += 1
            yield torch.tensor([self.epoch * 100 + key[1]], dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@pytest.fixture(autouse=True)
def fresh_process_state():
    loader_mod._WARNED = False
    yield
    loader_mod.shutdown()


def config(tmp_path, **kw) -> CacheResumeMMAPConfig:
    kw.setdefault("prefetch_length", 4)
    kw.setdefault("lookback_length", 2)
    kw.setdefault("wait_timeout", 30)
    return CacheResumeMMAPConfig(cache_dir=str(tmp_path / "cache"), **kw)


def sampler_loader(ds: Dataset, seed: int = 3) -> DataLoader:
    return DataLoader(ds, batch_size=BATCH, sampler=ResumableSampler(ds, seed=seed))


def reference(steps: int, ds_factory=Counting) -> list[torch.Tensor]:
    """What a bare DataLoader yields over `steps` steps (epochs: set_epoch + iterate again)."""
    ds = ds_factory()
    dl = sampler_loader(ds)
    out, epoch = [], 0
    while len(out) < steps:
        dl.sampler.set_epoch(epoch)
        out += [b["x"].clone() for b in dl]
        epoch += 1
    return out[:steps]


def usage(directory: str) -> tuple[int, int, int]:
    """(batch files, their bytes, the largest) in a group directory right now."""
    sizes = []
    for entry in os.scandir(directory):
        if entry.name.endswith(".batch"):
            try:
                sizes.append(entry.stat().st_size)
            except FileNotFoundError:   # deleted by the producer meanwhile
                pass
    return len(sizes), sum(sizes), max(sizes, default=0)


def wait_cached(mm: MMAPDataLoader, last: int, timeout: float = 30) -> None:
    """Wait until the producer wrote batch `last` (as it does while a real step computes)."""
    wait_until(lambda: os.path.exists(os.path.join(mm.group_dir, f"b{last:012d}.batch")), timeout,
               message=f"batch {last} cached")


def consume_until(mm: MMAPDataLoader, start: int, upto: int, ahead: int = 3) -> list[torch.Tensor]:
    """Iterate from `start` and abandon the stream (as a fault does) after step `upto`, once the producer
    filled the window (`ahead` batches past it)."""
    got = []
    for step, batch in mm.iter_from(start):
        got.append(batch["x"].clone() if isinstance(batch, dict) else batch.clone())
        if step == upto:
            wait_cached(mm, upto + ahead)
            break
    return got


def test_resume_in_process_reads_cache_then_continues_from_index_not_by_replay(tmp_path):
    ref = reference(40)
    ds = Counting()
    first = MMAPDataLoader(sampler_loader(ds), config(tmp_path))
    assert [torch.equal(a, b) for a, b in zip(consume_until(first, 0, 10), ref)] == [True] * 11
    # a restart: the wrapped function runs again, builds a new loader and resumes at the restored step 9
    ds.reads.clear()
    again = MMAPDataLoader(sampler_loader(ds), config(tmp_path))
    got = [(s, b["x"].clone()) for s, b in again.iter_from(9, stop=30)]
    assert [s for s, _ in got] == list(range(9, 30))
    assert all(torch.equal(b, ref[s]) for s, b in got), "a resumed batch differs from the fault-free one"
    assert again.stats["cached"] == 21 and again.stats["direct"] == 0
    # batches 9..13 were in the cache (lookback + prefetch): the new producer positioned the stream at 14
    assert again.producer.seeks == [(14, "index")]
    first_read = min(ds.reads)
    assert ds.reads[:BATCH] == [int(i) for i in ResumableSampler(ds, seed=3).indices(0)[14 * BATCH:15 * BATCH]], \
        f"the restarted producer read samples of earlier batches again: {ds.reads[:8]} (min {first_read})"


def test_stateful_loader_resumes_from_the_state_stored_with_the_batch(tmp_path):
    ref = [int(b) for e in range(5) for b in [e * 100 + k for k in range(6)]]
    src = Stateful()
    first = MMAPDataLoader(src, config(tmp_path))
    assert [int(b) for b in consume_until(first, 0, 10)] == ref[:11]
    src2 = Stateful()
    again = MMAPDataLoader(src2, config(tmp_path))
    got = [(s, int(b)) for s, b in again.iter_from(9, stop=25)]
    assert got == [(s, ref[s]) for s in range(9, 25)]
    assert again.producer.seeks[0] == (14, "state")
    assert src2.made[0] == (2, 2), f"the resumed loader made {src2.made[:3]} first, not batch 14 = epoch 2 #2"


def test_plain_iterable_serves_the_cache_then_fails_clearly_or_replays(tmp_path):
    batches = [torch.full((3,), float(i)) for i in range(30)]
    first = MMAPDataLoader(batches, config(tmp_path), epochs=1)
    consume_until(first, 0, 10)
    again = MMAPDataLoader(list(batches), config(tmp_path), epochs=1)
    seen = []
    with pytest.raises(DataStateLostError) as info:
        for step, batch in again.iter_from(9):
            seen.append(step)
            assert torch.equal(batch, batches[step])
    assert seen == [9, 10, 11, 12, 13], "the cached window was not served before the error"
    assert "step 14" in str(info.value) and "ResumableSampler" in str(info.value) and "replay" in str(info.value)
    loader_mod.shutdown()
    replay = MMAPDataLoader(list(batches), config(tmp_path, resume="replay"), epochs=1)
    got = [(s, b) for s, b in replay.iter_from(9)]
    assert [s for s, _ in got] == list(range(9, 30))
    assert all(torch.equal(b, batches[s]) for s, b in got)
    assert replay.producer.seeks[0][1] == "replay"


def test_cache_stays_within_its_bound_over_200_steps_and_is_removed_at_the_end(tmp_path):
    ds = Counting(n=64, width=256)
    cfg = config(tmp_path, prefetch_length=5, lookback_length=3)
    mm = MMAPDataLoader(sampler_loader(ds), cfg)
    ref = reference(200, lambda: Counting(n=64, width=256))
    max_files = max_bytes = one = 0
    for step, batch in mm.iter_from(0, stop=200):
        assert torch.equal(batch["x"], ref[step])
        files, size, biggest = usage(mm.group_dir)
        max_files, max_bytes, one = max(max_files, files), max(max_bytes, size), max(one, biggest)
    assert 2 <= max_files <= cfg.window, max_files
    assert max_bytes <= cfg.window * one
    assert mm.producer.max_files <= cfg.window
    loader_mod.shutdown()
    assert not os.path.exists(cfg.cache_dir), os.listdir(cfg.cache_dir)


def test_unfinished_stream_keeps_its_files_for_a_restart(tmp_path):
    mm = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path))
    consume_until(mm, 0, 5)
    group = mm.group_dir
    loader_mod.shutdown()
    assert any(f.endswith(".batch") for f in os.listdir(group)), "an interrupted stream lost its cache at exit"


def test_size_cap_degrades_to_direct_reading_with_one_warning(tmp_path, caplog):
    ref = reference(30)
    caplog.set_level(logging.INFO, logger="hyperpodrun.data")
    tiny = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path, max_bytes=64))
    got = [(s, b["x"].clone()) for s, b in tiny.iter_from(0, stop=30)]
    assert all(torch.equal(b, ref[s]) for s, b in got) and len(got) == 30
    assert tiny.stats["direct"] == 30
    # a cap of three batches: the cache works until the window needs a fourth, then the rest is direct
    mid = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path / "mid", max_bytes=3 * 1100), name="mid")
    got = [(s, b["x"].clone()) for s, b in mid.iter_from(0, stop=30)]
    assert all(torch.equal(b, ref[s]) for s, b in got) and len(got) == 30
    assert mid.stats["cached"] >= 1 and mid.stats["direct"] >= 1, mid.stats
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "MMAP data cache off" in r.message]
    assert len(warnings) == 1, [r.message for r in warnings]
    assert "max_bytes" in warnings[0].message


def test_unwritable_cache_dir_degrades_without_creating_anything(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    cfg = CacheResumeMMAPConfig(cache_dir=str(blocker / "cache"))
    mm = MMAPDataLoader(sampler_loader(Counting()), cfg)
    ref = reference(12)
    got = [(s, b["x"]) for s, b in mm.iter_from(0, stop=12)]
    assert all(torch.equal(b, ref[s]) for s, b in got)
    assert [r.levelno for r in caplog.records if "MMAP data cache off" in r.message] == [logging.WARNING]
    assert os.listdir(tmp_path) == ["not-a-dir"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_tiny_tmpfs_gives_enospc_and_direct_reading_not_sigbus(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("tmpfs mount not permitted here")
    try:
        ds = lambda: Counting(width=1024)            # ~16 KiB per batch: the tmpfs holds three, not a window
        ref = reference(30, ds)
        code = f"""
import logging, sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_mmap_loader import Counting, sampler_loader
from hyperpodrun.data import CacheResumeMMAPConfig, MMAPDataLoader
mm = MMAPDataLoader(sampler_loader(Counting(width=1024)), CacheResumeMMAPConfig(cache_dir={str(mnt / 'c')!r},
                    prefetch_length=8, lookback_length=2))
torch.save([b["x"].clone() for _, b in mm.iter_from(0, stop=30)], {str(tmp_path / 'got.pt')!r})
print("stats", mm.stats, flush=True)
"""
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"rc={proc.returncode} (SIGBUS is -7)\n{proc.stderr[-3000:]}"
        got = torch.load(tmp_path / "got.pt")
        assert len(got) == 30 and all(torch.equal(a, b) for a, b in zip(got, ref))
        assert proc.stderr.count("MMAP data cache off") == 1, proc.stderr[-3000:]
        assert "No space left on device" in proc.stderr
        assert "'cached': 0" not in proc.stdout, "the tmpfs should have held the first batches"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_consumer_waits_no_longer_than_wait_timeout_for_a_stuck_producer(tmp_path):
    # another process holds the producer role of this group and never writes
    mm = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path, wait_timeout=0.5, share_key="g"))
    from hyperpodrun.data import housekeeping
    run = housekeeping.open_run(str(tmp_path / "cache"))
    group = os.path.join(run.path, "train.share-g")
    os.makedirs(group, mode=0o700, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"),
        os.path.join(group, "producer.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheTimeoutError) as info:
            next(mm.iter_from(0))
        assert "wait_timeout" in str(info.value)
    finally:
        holder.stdin.close()
        holder.wait(10)
    # the holder is gone: the lock is free, this process takes over and produces
    step, batch = next(mm.iter_from(0))
    assert step == 0 and torch.equal(batch["x"], reference(1)[0])
    assert mm.producer is not None


def test_epoch_iteration_and_state_dict(tmp_path):
    ref = reference(60)
    per_epoch = 96 // BATCH
    mm = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path))
    assert len(mm) == per_epoch
    first = [b["x"].clone() for b in mm]
    assert len(first) == per_epoch and all(torch.equal(a, b) for a, b in zip(first, ref))
    assert mm.state_dict() == {"step": per_epoch}
    resumed = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path))
    resumed.load_state_dict({"step": per_epoch + 5})
    rest = [b["x"].clone() for b in resumed]
    assert len(rest) == per_epoch - 5
    assert all(torch.equal(a, ref[per_epoch + 5 + k]) for k, a in enumerate(rest))


def test_disabled_cache_reads_directly_and_writes_nothing(tmp_path):
    mm = MMAPDataLoader(sampler_loader(Counting()), config(tmp_path, enabled=False))
    ref = reference(10)
    assert all(torch.equal(b["x"], ref[s]) for s, b in mm.iter_from(3, stop=10))
    assert not os.path.exists(tmp_path / "cache")


def test_resumable_sampler_shards_and_resumes():
    s = ResumableSampler(10, seed=1, num_replicas=3, rank=0)
    shards = [ResumableSampler(10, seed=1, num_replicas=3, rank=r).indices(2) for r in range(3)]
    assert all(len(x) == 4 for x in shards) and set(sum(shards, [])) == set(range(10))
    s.resume_from(2, 3)
    assert list(s) == shards[0][3:]
    assert list(s) == shards[0], "the offset applies to one iteration only"
    s.load_state_dict({"epoch": 5, "offset": 1})
    assert s.state_dict() == {"epoch": 5, "offset": 1}
    assert ResumableSampler(10, seed=1).indices(0) != ResumableSampler(10, seed=1).indices(1)
    with pytest.raises(ValueError):
        ResumableSampler(10, num_replicas=2, rank=2)


class FailsOnce(Counting):
    """Counting whose read of sample `at` raises once - as the interrupt of an in-process restart lands inside
    the loader's next(), after its sampler has moved past that batch."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.failed = at, False

    def __getitem__(self, i: int):
        if i == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("interrupted inside next()")
        return super().__getitem__(i)


def test_a_read_cut_short_inside_the_loader_resumes_at_the_right_batch(tmp_path):
    """Reading directly (the cache off): a next() cut short by an exception leaves the wrapped iterator one
    batch further than the stream's own count. The same stream asked again from that step must seek, not go
    on from where the iterator stopped (it served the batch of step k+1 as step k: a survivor of an
    in-process restart trained on the wrong batch)."""
    want = reference(12)
    order = [int(i) for i in sampler_loader(Counting()).sampler]   # the sample order of epoch 0
    ds = FailsOnce(at=order[5 * BATCH])                            # the first sample of step 5
    mm = MMAPDataLoader(sampler_loader(ds), config(tmp_path, max_bytes=100))   # too small: read directly
    got = []
    with pytest.raises(RuntimeError, match="interrupted inside next"):
        for step, batch in mm.iter_from(0):
            got.append((step, batch["x"].clone()))
    assert [s for s, _ in got] == [0, 1, 2, 3, 4]
    for step, batch in mm.iter_from(5, stop=12):                   # the restored step: 5
        got.append((step, batch["x"].clone()))
    assert [s for s, _ in got] == list(range(12))
    for step, x in got:
        assert torch.equal(x, want[step]), f"step {step}: another step's batch"
    mm.close()
