"""Snapshot slots: state laid out raw in a file in shared memory, written in place, valid once complete.

Why this format: a snapshot is taken after every optimizer step, so its cost is the cost of copying the
state once. Tensors are therefore copied straight into a memory-mapped slot file (for GPU tensors by DMA
into the mapping, registered with CUDA as pinned memory) - no serialisation pass, no second copy.
Everything that is not a tensor (the structure of the state dicts, hyper-parameters, RNG states) is
pickled into a small metadata block.

With `defer`, the large tensors that only the optimizer step changes (parameters, optimizer state) are
copied later: GPU tensors on a side CUDA stream, host tensors by the writer thread; forward and backward
of the next step overlap the copy, and the optimizer step waits for it (see CheckpointManager).

Layout: a 64-byte header (magic, step, CRC32 of everything after the header, checksum flag, complete
flag, metadata length, data length), the metadata block, then the tensor data (64-byte aligned). The
header is marked incomplete before a slot is rewritten and complete after everything else is written,
so a process that dies mid-write leaves a slot that is ignored; the other slot stays valid.
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

log = logging.getLogger("hyperpodrun.runtime")

MAGIC = b"HPRSNAP2"
HEADER = struct.Struct("<8sqIBBQQ")     # magic, step, crc, checksum flag, complete flag, meta len, data len
HEADER_LEN = 64
ALIGN = 64


class SnapshotCorrupt(ValueError):
    """A snapshot is incomplete or failed its checksum: it is ignored."""


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor's bytes sit in the data region."""

    offset: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _rebuild(like: Any, items: list) -> Any:
    """A list or tuple of the same type as `like` (namedtuples take their fields positionally)."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


@dataclass
class Staged:
    """A snapshot being written: its metadata and the copies still to be done."""

    step: int
    meta: bytes = b""
    tensors: list[tuple[Any, TensorRef, bool]] = field(default_factory=list)   # (source, ref, deferred)
    cuda_event: Any = None
    data_len: int = 0


def plan(step: int, payload: Any, stable: set[int], defer: bool) -> Staged:
    """Replace every tensor of `payload` by a TensorRef and pickle the result (the metadata)."""
    import torch
    staged = Staged(step=step)

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            local = _local(obj).detach()
            if not local.is_contiguous():
                local = local.contiguous()
            nbytes = local.numel() * local.element_size()
            ref = TensorRef(staged.data_len, str(local.dtype).removeprefix("torch."), tuple(local.shape), nbytes)
            staged.data_len += (nbytes + ALIGN - 1) // ALIGN * ALIGN
            staged.tensors.append((local, ref, defer and local.data_ptr() in stable and nbytes > 0))
            return ref
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return _rebuild(obj, [walk(v) for v in obj])
        return obj
    staged.meta = pickle.dumps(walk(payload), protocol=pickle.HIGHEST_PROTOCOL)
    return staged


class SlotFile:
    """One slot file, mapped once and reused by every save that lands in it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: Optional[mmap.mmap] = None
        self._size = 0
        self._registered: Optional[int] = None

    def prepare(self, staged: Staged, pin: bool) -> memoryview:
        """Size and map the file for `staged` and mark it incomplete; returns the whole mapping."""
        size = HEADER_LEN + _aligned(len(staged.meta)) + staged.data_len
        if self._map is None or size > self._size:
            self.close()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)      # a full tmpfs fails here (ENOSPC), not later (SIGBUS)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._size = size
            if pin:
                self._pin()
        assert self._map is not None
        self._map[:HEADER_LEN] = b"\0" * HEADER_LEN             # incomplete until written again
        return memoryview(self._map)

    def _pin(self) -> None:
        import ctypes
        import torch
        try:
            buf = (ctypes.c_char * self._size).from_buffer(self._map)
            ptr = ctypes.addressof(buf)
            del buf
            if torch.cuda.cudart().cudaHostRegister(ptr, self._size, 0) == 0:
                self._registered = ptr
        except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
            log.info("snapshot slot not pinned (%s): device copies will be synchronous", exc)

    def close(self) -> None:
        if self._map is not None:
            if self._registered is not None:
                import torch
                torch.cuda.cudart().cudaHostUnregister(self._registered)
                self._registered = None
            try:
                self._map.close()
            except BufferError:      # a view is still alive; the mapping is freed with it
                pass
            self._map = None

    @property
    def pinned(self) -> bool:
        return self._registered is not None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SideStream:
    """The CUDA stream deferred device copies run on."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def get(self, device: Any) -> Any:
        import torch
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def _dst(view: memoryview, staged: Staged, ref: TensorRef) -> Any:
    import torch
    start = HEADER_LEN + _aligned(len(staged.meta)) + ref.offset
    raw = torch.frombuffer(view[start:start + ref.nbytes], dtype=torch.uint8) if ref.nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(getattr(torch, ref.dtype)).view(ref.shape)


def copy_now(view: memoryview, staged: Staged, streams: SideStream) -> None:
    """Copy the tensors not deferred, and launch the deferred device copies on the side stream."""
    import torch
    for src, ref, deferred in staged.tensors:
        if ref.nbytes == 0:
            continue
        if not deferred:
            _dst(view, staged, ref).copy_(src)
        elif src.is_cuda:
            stream = streams.get(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                _dst(view, staged, ref).copy_(src, non_blocking=True)
                src.record_stream(stream)
            staged.cuda_event = torch.cuda.Event()
            staged.cuda_event.record(stream)


def complete(view: memoryview, staged: Staged, checksum: bool, valid: Callable[[], bool] = lambda: True) -> bool:
    """Finish the deferred copies, write the metadata and, last, the header that makes the slot valid.

    `valid` is asked once every copy has finished: False leaves the slot incomplete (never used). The
    caller says False when a restart was requested meanwhile - on a GPU the host runs ahead of the
    device, and a copy that waited for work the restart then aborted holds garbage.
    """
    for src, ref, deferred in staged.tensors:
        if deferred and not src.is_cuda and ref.nbytes:
            _dst(view, staged, ref).copy_(src)
    if staged.cuda_event is not None:
        staged.cuda_event.synchronize()
    if not valid():
        staged.tensors.clear()
        return False
    view[HEADER_LEN:HEADER_LEN + len(staged.meta)] = staged.meta
    end = HEADER_LEN + _aligned(len(staged.meta)) + staged.data_len
    crc = zlib.crc32(view[HEADER_LEN:end]) if checksum else 0
    view[:HEADER.size] = HEADER.pack(MAGIC, staged.step, crc, int(checksum), 1, len(staged.meta), staged.data_len)
    staged.tensors.clear()
    return True


def header(data: Any, what: str) -> tuple[int, int, int, int, int]:
    """(step, crc, checksum flag, meta len, data len) of a complete slot; SnapshotCorrupt otherwise."""
    if len(data) < HEADER_LEN:
        raise SnapshotCorrupt(f"{what}: not a snapshot")
    magic, step, crc, has_crc, done, meta_len, data_len = HEADER.unpack(bytes(data[:HEADER.size]))
    if magic != MAGIC or not done:
        raise SnapshotCorrupt(f"{what}: incomplete or not a snapshot")
    if len(data) < HEADER_LEN + _aligned(meta_len) + data_len:
        raise SnapshotCorrupt(f"{what}: truncated (step {step})")
    return step, crc, has_crc, meta_len, data_len


def decode(data: Any, what: str, verify: bool = True, copy: bool = True) -> tuple[int, Any]:
    """(step, payload) of a slot's bytes; tensors copied out of `data`, or views of it with copy=False."""
    import torch
    step, crc, has_crc, meta_len, data_len = header(data, what)
    view = memoryview(data)
    end = HEADER_LEN + _aligned(meta_len) + data_len
    if verify and has_crc and zlib.crc32(view[HEADER_LEN:end]) != crc:
        raise SnapshotCorrupt(f"{what}: checksum mismatch (step {step})")
    base = HEADER_LEN + _aligned(meta_len)

    def load(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            if obj.nbytes == 0:
                return torch.empty(obj.shape, dtype=getattr(torch, obj.dtype))
            raw = torch.frombuffer(view[base + obj.offset:base + obj.offset + obj.nbytes], dtype=torch.uint8)
            t = raw.view(getattr(torch, obj.dtype)).view(obj.shape)
            return t.clone() if copy else t
        if isinstance(obj, dict):
            return {k: load(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return _rebuild(obj, [load(v) for v in obj])
        return obj
    return step, load(pickle.loads(view[HEADER_LEN:HEADER_LEN + meta_len]))


class SlotWriter:
    """At most one snapshot completing in the background; `wait` is the barrier."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, job: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # reported at the next wait, in the training thread
                self._error = exc
        self._thread = threading.Thread(target=run, name="hyperpodrun-snapshot", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            log.error("a snapshot was not written: %s", err)


def verify(data: Any, what: str) -> int:
    """The step of a complete slot whose checksum (if it has one) matches; SnapshotCorrupt otherwise."""
    step, crc, has_crc, meta_len, data_len = header(data, what)
    end = HEADER_LEN + _aligned(meta_len) + data_len
    if has_crc and zlib.crc32(memoryview(data)[HEADER_LEN:end]) != crc:
        raise SnapshotCorrupt(f"{what}: checksum mismatch (step {step})")
    return step
