"""The MMAP cache's batch file: round trips of nested batches, dtypes, odd tensors; zero-copy, copy-on-write
reads; space reserved before writing; corrupt files refused."""
from __future__ import annotations

import collections
import errno
import os

import pytest
import torch

from hyperpodrun.data import storage
from hyperpodrun.data.errors import CacheCorruptError, CacheFullError

Pair = collections.namedtuple("Pair", "left right")


def roundtrip(tmp_path, batch, extra=None):
    tmp, final = str(tmp_path / ".b.tmp"), str(tmp_path / "b.batch")
    storage.write_batch(tmp, batch, extra)
    storage.commit(tmp, final)
    assert not os.path.exists(tmp)
    return storage.read_batch(final)


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
                                   torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64])
def test_dtypes_round_trip_bitwise(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(5, 7, generator=g) * 100)
    t = src.to(dtype) if dtype != torch.complex64 else torch.complex(src, -src)
    out, _ = roundtrip(tmp_path, {"t": t, "scalar": t[0, 0].clone()})
    assert_same({"t": t, "scalar": t[0, 0].clone()}, out)


def test_nested_structures_and_python_leaves(tmp_path):
    batch = {
        "pair": Pair(torch.arange(3), [torch.ones(2, 2), ("text", 3, None, 2.5)]),
        "od": collections.OrderedDict(b=torch.zeros(1), a=b"raw"),
        "list": [torch.tensor(7), {"deep": (torch.tensor([True, False]),)}],
        "str": "hello", "none": None,
    }
    out, meta = roundtrip(tmp_path, batch, {"step": 4, "state": {"epoch": 1, "offset": 8}})
    assert_same(batch, out)
    assert meta["step"] == 4 and meta["state"] == {"epoch": 1, "offset": 8}


def test_non_contiguous_and_zero_size_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    batch = {"transposed": base.t(), "strided": base[:, ::2], "expanded": torch.ones(3, 1).expand(3, 5),
             "empty": torch.zeros(0, 3), "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
             "conj": torch.complex(base, base).conj()}
    out, _ = roundtrip(tmp_path, batch)
    for k, v in batch.items():
        assert out[k].shape == v.shape and out[k].dtype == v.dtype, k
        assert torch.equal(out[k], v.resolve_conj()), k
        assert out[k].is_contiguous(), k


def test_tensors_are_mapped_not_copied_and_copy_on_write(tmp_path):
    batch = {"x": torch.arange(4096, dtype=torch.int32)}
    out, _ = roundtrip(tmp_path, batch)
    x = out["x"]
    maps = open("/proc/self/maps").read()
    assert str(tmp_path / "b.batch") in maps, "the batch file is not mapped"
    with open("/proc/self/maps") as fh:
        mapped = [line for line in fh if str(tmp_path / "b.batch") in line]
    lo, hi = (int(v, 16) for v in mapped[0].split()[0].split("-"))
    assert lo <= x.data_ptr() < hi, "the tensor's memory is not the mapping"
    x.add_(1)                                           # writes go to this process's private pages
    again, _ = storage.read_batch(str(tmp_path / "b.batch"))
    assert torch.equal(again["x"], batch["x"]), "an in-place change reached the file"
    os.unlink(tmp_path / "b.batch")                     # the mapping outlives the file
    assert int(x[10]) == 11


def test_space_is_reserved_before_writing_and_enospc_leaves_no_file(tmp_path, monkeypatch):
    calls = []
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    tmp = str(tmp_path / ".b.tmp")
    with pytest.raises(OSError) as info:
        storage.write_batch(tmp, {"x": torch.ones(1000)})
    assert info.value.errno == errno.ENOSPC
    assert calls and calls[0] >= 4000
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(os, "posix_fallocate", real)

    def cap(size):
        raise CacheFullError(f"{size} bytes over the cap")
    with pytest.raises(CacheFullError) as info:
        storage.write_batch(tmp, {"x": torch.ones(1000)}, reserve=cap)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_written_file_is_fully_allocated(tmp_path):
    tmp = str(tmp_path / ".b.tmp")
    size = storage.write_batch(tmp, {"x": torch.ones(100_000)})
    st = os.stat(tmp)
    assert st.st_size == size
    assert st.st_blocks * 512 >= size, "the file is sparse: a page fault could need a new page"


def test_corrupt_files_are_refused(tmp_path):
    path = tmp_path / "b.batch"
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(CacheCorruptError):
        storage.read_batch(str(path))
    good = tmp_path / "good.batch"
    storage.write_batch(str(good), {"x": torch.ones(64)})
    data = good.read_bytes()
    path.write_bytes(data[:-32])                        # truncated
    with pytest.raises(CacheCorruptError):
        storage.read_batch(str(path))
    with pytest.raises(FileNotFoundError):
        storage.read_batch(str(tmp_path / "missing.batch"))
