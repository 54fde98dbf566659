"""The batch file: one batch, its tensors stored raw so that a reader maps them back without copying.

Layout (little-endian):

    [0, 32)       magic "HPRMMAP2", meta length m, data start d, file size (u64 each)
    [32, 32+m)    meta: {"tree": the batch with every tensor replaced by a TensorRef (offset from d, dtype,
                  shape, nbytes), **extra} (extra: step, epoch, loader state, ...), in the safe_codec
                  encoding - reading it never runs code named by the file (no pickle)
    [d, size)     each tensor's bytes, C-contiguous, at 64-byte aligned offsets (d is aligned too)

Writing: the whole file size is reserved with `os.posix_fallocate` before one byte is written, so a
full tmpfs answers ENOSPC there (a write into a mapping of a sparse tmpfs file would be a SIGBUS instead);
the bytes go in with pwrite under a temporary name (created 0600, O_EXCL) and the file appears under its
final name by an atomic rename (`commit`), so a reader sees a complete file or none (fsync is not needed
on a tmpfs).

Reading: the file is opened without following symlinks and mapped MAP_PRIVATE (copy-on-write); each
tensor is `torch.frombuffer` over the mapping: no copy; the pages are the tmpfs pages. The tensors are
writable: an in-place operation copies only the pages it touches into this process's private memory, the
file and other readers never see it. The mapping lives as long as any tensor of the batch (the file may
be deleted meanwhile).

Tensors come back contiguous, on the CPU, without autograd history (strides, device and requires_grad
are not kept). Other leaves and containers: what safe_codec carries (None, bool, int, float, complex,
str, bytes, numpy arrays and scalars, dict, OrderedDict, list, tuple, set, namedtuple, Enum, ...). A
batch holding anything else (a sparse or quantized tensor, an object of your own) is refused when
written (UnsupportedStateError naming the type): the loader then reads the wrapped loader directly.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any, Callable, Optional

import torch

from hyperpodrun.state.codec import safe_codec
from hyperpodrun.state.codec.safe_codec import CodecError, TensorRef, UnsupportedStateError
from hyperpodrun.data.errors import CacheCorruptError

MAGIC = b"HPRMMAP2"
_HEADER = struct.Struct("<8sQQQ")
ALIGN = 64


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None) if name.replace("torch.", "").isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CacheCorruptError(f"unknown dtype {name!r} in a batch file")
    return dtype


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and not getattr(t, "is_nested", False)


class _Collect:
    """Tensors of a batch in file order, each at a 64-byte aligned offset from the data start."""

    def __init__(self) -> None:
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.pos = 0

    def __call__(self, obj: torch.Tensor) -> TensorRef:
        if not _plain(obj):
            raise UnsupportedStateError(type(obj), [], f"a {obj.layout} tensor (only dense tensors are cached)")
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        n = t.numel() * t.element_size()
        ref = TensorRef(self.pos, str(t.dtype).removeprefix("torch."), tuple(t.shape), n)
        self.tensors.append((t, self.pos))
        self.pos = _align(self.pos + n)
        return ref


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
    collect = _Collect()
    try:
        blob = safe_codec.dumps({**(extra or {}), "tree": batch}, collect)
    except UnsupportedStateError as exc:
        if exc.path[:1] == ["tree"]:
            exc.root, exc.path = "batch", exc.path[1:]
        else:
            exc.root = "batch meta"
        raise
    data_start = _align(_HEADER.size + len(blob))
    size = data_start + collect.pos
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if reserve is not None:
            reserve(size)
        os.posix_fallocate(fd, 0, size)   # ENOSPC here on a full tmpfs, never SIGBUS later
        _pwrite_all(fd, _HEADER.pack(MAGIC, len(blob), data_start, size) + blob, 0)
        for t, offset in collect.tensors:
            if t.numel():
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


def _map(path: str) -> tuple[Any, int]:
    """A private, writable (copy-on-write) mapping of a batch file and its size; never through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise CacheCorruptError(f"{path}: {size} bytes, shorter than a header")
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE), size
    finally:
        os.close(fd)


def _decode(mm: Any, size: int, path: str, clone: bool) -> dict:
    """The meta of a mapped batch file with its tensors: views of the mapping, or copies with `clone`."""
    meta_len, data_start = _header(mm, size, path)

    def make(ref: TensorRef) -> torch.Tensor:
        dtype = _dtype(ref.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in ref.shape:
            count *= d
        if count * itemsize != ref.nbytes or ref.offset % ALIGN:
            raise CacheCorruptError(f"{path}: a tensor of {ref.shape} {ref.dtype} with {ref.nbytes} bytes")
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        offset = data_start + ref.offset
        if offset + ref.nbytes > size:
            raise CacheCorruptError(f"{path}: a tensor lies past the end of the file")
        t = torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(ref.shape)
        return t.clone() if clone else t

    try:
        meta = safe_codec.loads(memoryview(mm)[_HEADER.size:_HEADER.size + meta_len], make)
    except CodecError as exc:
        raise CacheCorruptError(f"{path}: {exc}") from None
    if not isinstance(meta, dict) or "tree" not in meta:
        raise CacheCorruptError(f"{path}: no batch in the meta")
    return meta


def read_meta(path: str) -> dict:
    """The meta of a batch file (the loader state, step, epoch), its tensors copied; without the batch."""
    mm, size = _map(path)
    meta = _decode(mm, size, path, clone=True)
    meta.pop("tree", None)
    return meta


def read_batch(path: str) -> tuple[Any, dict]:
    """Map a batch file: (the batch, its meta without the tree). Raises FileNotFoundError when absent."""
    mm, size = _map(path)
    meta = _decode(mm, size, path, clone=False)
    return meta.pop("tree"), meta


__all__ = ["write_batch", "commit", "read_batch", "read_meta", "MAGIC", "ALIGN"]
