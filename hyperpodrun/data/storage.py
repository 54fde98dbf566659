"""The batch file: one batch, its tensors stored raw so that a reader maps them back without copying.

Layout (little-endian):

    [0, 32)       magic "HPRMMAP1", meta length m, data start d, file size (u64 each)
    [32, 32+m)    meta: a pickle of {"tree": the batch with every tensor replaced by a _TensorRef,
                  "tensors": [(offset from d, nbytes)], **extra} (extra: step, epoch, loader state, ...)
    [d, size)     each tensor's bytes, C-contiguous, at 64-byte aligned offsets (d is aligned too)

Writing: the whole file size is reserved with `os.posix_fallocate` before one byte is written, so a
full tmpfs answers ENOSPC there (a write into a mapping of a sparse tmpfs file would be a SIGBUS instead);
the bytes go in with pwrite under a temporary name and the file appears under its final name by an
atomic rename (`commit`), so a reader sees a complete file or none (fsync is not needed on a tmpfs).

Reading: the file is mapped MAP_PRIVATE (copy-on-write) and each tensor is `torch.frombuffer` over the
mapping: no copy; the pages are the tmpfs pages. The tensors are writable: an in-place operation copies
only the pages it touches into this process's private memory, the file and other readers never see it.
The mapping lives as long as any tensor of the batch (the file may be deleted meanwhile).

Tensors come back contiguous, on the CPU, without autograd history (strides, device and requires_grad
are not kept); tensors that are not plain strided CPU-able tensors (sparse, quantized, nested) and every
other leaf are pickled. Containers rebuilt around the tensors: dict, OrderedDict, list, tuple,
namedtuple; anything else is pickled whole (correct, but its tensors are copied).
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hyperpodrun.data.errors import CacheCorruptError

MAGIC = b"HPRMMAP1"
_HEADER = struct.Struct("<8sQQQ")
ALIGN = 64


@dataclass(frozen=True)
class _TensorRef:
    """Where a tensor of the batch lives in the file (index into meta["tensors"])."""

    index: int
    dtype: str
    shape: tuple


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise CacheCorruptError(f"unknown dtype {name!r} in a batch file")
    return dtype


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and not getattr(t, "is_nested", False)


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The batch with its tensors replaced by _TensorRef (tensors appended, CPU and contiguous)."""
    if isinstance(obj, torch.Tensor) and _plain(obj):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        tensors.append(t)
        return _TensorRef(len(tensors) - 1, str(t.dtype), tuple(t.shape))
    kind = type(obj)
    if kind in (dict, collections.OrderedDict):
        return kind((k, _flatten(v, tensors)) for k, v in obj.items())
    if kind is list:
        return [_flatten(v, tensors) for v in obj]
    if kind is tuple:
        return tuple(_flatten(v, tensors) for v in obj)
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):   # namedtuple
        return kind(*(_flatten(v, tensors) for v in obj))
    return obj


def _unflatten(obj: Any, make: Callable[[_TensorRef], torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return make(obj)
    kind = type(obj)
    if kind in (dict, collections.OrderedDict):
        return kind((k, _unflatten(v, make)) for k, v in obj.items())
    if kind is list:
        return [_unflatten(v, make) for v in obj]
    if kind is tuple:
        return tuple(_unflatten(v, make) for v in obj)
    if isinstance(obj, tuple) and hasattr(kind, "_fields"):
        return kind(*(_unflatten(v, make) for v in obj))
    return obj


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a bytes-like object (no copy; `t` must outlive it)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_batch(tmp_path: str, batch: Any, extra: Optional[dict] = None,
                reserve: Optional[Callable[[int], None]] = None) -> int:
    """Write `batch` (and `extra` in its meta) to the new file `tmp_path`; returns the file size.

    `reserve(size)` runs before the space is allocated (the caller's size cap: it raises CacheFullError).
    On any error the file is removed and the error raised (OSError ENOSPC for a full tmpfs).
    """
    tensors: list[torch.Tensor] = []
    tree = _flatten(batch, tensors)
    layout, pos = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        layout.append((pos, n))
        pos = _align(pos + n)
    blob = pickle.dumps({"tree": tree, "tensors": layout, **(extra or {})}, protocol=pickle.HIGHEST_PROTOCOL)
    data_start = _align(_HEADER.size + len(blob))
    size = data_start + pos
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if reserve is not None:
            reserve(size)
        os.posix_fallocate(fd, 0, size)   # ENOSPC here on a full tmpfs, never SIGBUS later
        _pwrite_all(fd, _HEADER.pack(MAGIC, len(blob), data_start, size) + blob, 0)
        for t, (offset, n) in zip(tensors, layout):
            if n:
                _pwrite_all(fd, _bytes_of(t), data_start + offset)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    os.close(fd)
    return size


def commit(tmp_path: str, final_path: str) -> None:
    """Make a written file visible under its final name (atomic on one file system)."""
    os.rename(tmp_path, final_path)


def _header(buf: Any, size: int, path: str) -> tuple[int, int]:
    """(meta length, data start) of a batch file of `size` bytes whose first bytes are in `buf`."""
    if size < _HEADER.size:
        raise CacheCorruptError(f"{path}: {size} bytes, shorter than a header")
    magic, meta_len, data_start, total = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CacheCorruptError(f"{path}: not a batch file of this version (magic {magic!r})")
    if total != size or _HEADER.size + meta_len > data_start or data_start > size:
        raise CacheCorruptError(f"{path}: {size} bytes, the header says {total} (meta {meta_len}, data {data_start})")
    return meta_len, data_start


def read_meta(path: str) -> dict:
    """The meta of a batch file without mapping its tensors (the loader state, step, epoch)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(_HEADER.size)
        meta_len, _ = _header(head, size, path)
        meta = pickle.loads(fh.read(meta_len))
    meta.pop("tree", None)
    return meta


def read_batch(path: str) -> tuple[Any, dict]:
    """Map a batch file: (the batch, its meta without the tree). Raises FileNotFoundError when absent."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise CacheCorruptError(f"{path}: {size} bytes, shorter than a header")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    meta_len, data_start = _header(mm, size, path)
    meta = pickle.loads(mm[_HEADER.size:_HEADER.size + meta_len])
    layout = meta["tensors"]

    def make(ref: _TensorRef) -> torch.Tensor:
        offset, nbytes = layout[ref.index]
        offset += data_start
        dtype = _dtype(ref.dtype)
        if nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if offset + nbytes > size:
            raise CacheCorruptError(f"{path}: tensor {ref.index} lies past the end of the file")
        itemsize = torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(mm, dtype=dtype, count=nbytes // itemsize, offset=offset).view(ref.shape)

    batch = _unflatten(meta.pop("tree"), make)
    return batch, meta


__all__ = ["write_batch", "commit", "read_batch", "read_meta", "MAGIC", "ALIGN"]
