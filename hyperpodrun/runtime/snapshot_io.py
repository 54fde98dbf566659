"""Snapshot slots: state laid out raw in a file in shared memory, written in place, valid once complete.

Why this format: a snapshot is taken after every optimizer step, so its cost is the cost of copying the
state once. Tensors are therefore copied straight into a memory-mapped slot file (for GPU tensors by DMA
into the mapping, registered with CUDA as pinned memory) - no serialisation pass, no second copy.
Everything that is not a tensor (the structure of the state dicts, hyper-parameters, RNG states) goes
into a small metadata block in the safe_codec encoding: reading a slot never runs code named by its
bytes (no pickle), whoever wrote them.

With `defer`, the large tensors that only the optimizer step changes (parameters, optimizer state) are
copied later: GPU tensors on a side CUDA stream, host tensors by the writer thread; forward and backward
of the next step overlap the copy, and the optimizer step waits for it (see CheckpointManager). With a
`DeviceStaging` as well, the side stream first copies the deferred GPU tensors into buffers on their own
device (at memory speed, a few ms per GB) and then to the slot from those buffers: the optimizer step
then waits for the device-to-device copy only, and the device->host copy (bound by PCIe) may run over
several of the following steps - launched by the writer thread one piece at a time, so that the
training's own device->host copies (`loss.item()`) never queue behind it (`_to_host`). The buffers cost as
much device memory as the tensors they hold.

Layout: a 64-byte header (magic, step, checksum, complete flag, metadata length, data length, checksum
chunk size), the metadata block, then the tensor data (64-byte aligned). The header is marked incomplete
before a slot is rewritten and complete after everything else is written, so a process that dies
mid-write leaves a slot that is ignored; the other slot stays valid.

Integrity: every slot carries a checksum, always (no flag says otherwise): CRC32 of the header's fields,
the metadata and the CRC32s of the data region's 16 MiB chunks, summed by several threads while the
copy runs (slot_checksum.py). A slot whose checksum does not match is never restored.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hyperpodrun.errors import SnapshotCorrupt
from hyperpodrun.runtime import pinned_read, safe_codec
from hyperpodrun.runtime.safe_codec import CodecError, TensorRef
from hyperpodrun.runtime.slot_checksum import CHUNK, ChunkSums, chunk_crcs
from hyperpodrun.safe_fs import open_private

log = logging.getLogger("hyperpodrun.runtime")

MAGIC = b"HPRSNAP3"
HEADER = struct.Struct("<8sqIBxxxQQI")  # magic, step, crc, complete flag, meta len, data len, chunk size
_SUMMED = struct.Struct("<qQQI")        # the header fields the checksum covers
HEADER_LEN = 64
ALIGN = 64


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


@dataclass
class Staged:
    """A snapshot being written: its metadata and the copies still to be done."""

    step: int
    meta: bytes = b""
    tensors: list[tuple[Any, TensorRef, bool]] = field(default_factory=list)   # (source, ref, deferred)
    cuda_event: Any = None
    #: per device, an event recorded on the compute stream right before the copies: once it has completed,
    #: what the copies read is final (no pending kernel - an optimizer step, an all-reduce - still writes it)
    source_events: dict[Any, Any] = field(default_factory=dict)
    data_len: int = 0
    sums: Optional[ChunkSums] = None       # the data chunks' CRC32s, summed as the copies complete
    #: per device, an event recorded on the side stream once the deferred tensors are in their staging
    #: buffers (DeviceStaging): from then on the sources may change
    staged_events: dict[Any, Any] = field(default_factory=dict)
    #: (index, event recorded after its device->host copy) per deferred device tensor, in stream order: the
    #: checksum threads sum each tensor's bytes as soon as its copy is done, behind the DMA
    device_done: list[tuple[int, Any]] = field(default_factory=list)
    #: (index, side stream, staging buffer, ref) per staged device tensor: finish_copies takes them to the slot
    to_host: list[tuple[int, Any, Any, TensorRef]] = field(default_factory=list)
    #: set once the deferred host tensors are in the slot (finish_copies)
    host_copied: threading.Event = field(default_factory=threading.Event)
    copied: int = 0                        # tensors[:copied] are in the slot (a prefix: see _copied)
    done: set[int] = field(default_factory=set)


def plan(step: int, payload: Any, stable: set[int], defer: bool) -> Staged:
    """Encode `payload` with every tensor replaced by a TensorRef into the data region (the metadata).

    Raises safe_codec.UnsupportedStateError (a TypeError) for a value snapshots cannot hold."""
    import torch
    staged = Staged(step=step)

    def on_tensor(obj: Any) -> TensorRef:
        local = _local(obj).detach()
        if local.layout != torch.strided or local.is_quantized:
            raise safe_codec.UnsupportedStateError(type(obj), [], f"a {local.layout} tensor (only dense tensors)")
        if not local.is_contiguous():
            local = local.contiguous()
        nbytes = local.numel() * local.element_size()
        ref = TensorRef(staged.data_len, str(local.dtype).removeprefix("torch."), tuple(local.shape), nbytes)
        staged.data_len += _aligned(nbytes)
        staged.tensors.append((local, ref, defer and local.data_ptr() in stable and nbytes > 0))
        return ref
    staged.meta = safe_codec.dumps(payload, on_tensor)
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
        if self._map is None and pin:
            pre = pinned_read.take(self.path)   # mapped and registered ahead by the standby this rank was
            if pre is not None and pre.size >= size:
                self._map, self._size, self._registered = pre.map, pre.size, pre.ptr
            elif pre is not None:
                pinned_read.unpin(pre)
        if self._map is None or size > self._size:
            self.close()
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)      # a full tmpfs fails here (ENOSPC), not later (SIGBUS)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._size = size
            if pin:
                self._registered = pinned_read.register(self._map, read_only=False, what=f"snapshot slot {self.path}")
        assert self._map is not None
        self._map[:HEADER_LEN] = b"\0" * HEADER_LEN             # incomplete until written again
        return memoryview(self._map)

    def close(self) -> None:
        if self._map is not None:
            pinned_read.release(self._map, self._registered)
            self._registered = None
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


class DeviceStaging:
    """Buffers on the GPU that hold a snapshot's deferred device tensors while they are copied to the host.

    Kept from one save to the next (one buffer per deferred tensor, reused while its shape, dtype and
    device stay the same), so a steady training loop allocates them once. `release()` frees them."""

    def __init__(self) -> None:
        self._buffers: list[Any] = []

    def buffer(self, index: int, src: Any) -> Any:
        """The staging buffer for the `index`-th deferred device tensor of a save, shaped like `src`."""
        import torch
        while len(self._buffers) <= index:
            self._buffers.append(None)
        buf = self._buffers[index]
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.device != src.device:
            self._buffers[index] = buf = torch.empty_like(src, memory_format=torch.contiguous_format)
        return buf

    def trim(self, count: int) -> None:
        """Free the buffers past the first `count` (a save with fewer deferred device tensors)."""
        del self._buffers[count:]

    def release(self) -> None:
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)


def _dst(view: memoryview, staged: Staged, ref: TensorRef) -> Any:
    import torch
    start = HEADER_LEN + _aligned(len(staged.meta)) + ref.offset
    raw = torch.frombuffer(view[start:start + ref.nbytes], dtype=torch.uint8) if ref.nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(getattr(torch, ref.dtype)).view(ref.shape)


def _copied(staged: Staged, index: int) -> None:
    """Tensor `index` is in the slot: let the checksum threads sum what lies before the first tensor still
    being copied (tensors sit in the data region in list order)."""
    staged.done.add(index)
    while staged.copied in staged.done:
        staged.copied += 1
    if staged.sums is not None:
        end = staged.data_len if staged.copied >= len(staged.tensors) else staged.tensors[staged.copied][1].offset
        staged.sums.advance(end)


#: a staged snapshot's device->host copy goes in pieces of at most this size, one in flight at a time (see _to_host)
PIECE = 64 << 20


def copy_now(view: memoryview, staged: Staged, streams: SideStream, staging: Optional[DeviceStaging] = None) -> None:
    """Copy the tensors not deferred, and launch the deferred device copies on the side stream - into
    `staging`'s device buffers when given (one batched copy per device; finish_copies then takes them to the
    slot), else straight to the slot; the checksum threads start summing behind the copy.

    Per device, the side stream waits once for the compute stream, and the launches are grouped: this runs
    in the training thread while the GPU waits for it, so each per-tensor call costs the step."""
    import torch
    staged.sums = ChunkSums(view, HEADER_LEN + _aligned(len(staged.meta)), staged.data_len)
    by_device: dict[Any, list[int]] = {}
    try:
        for i, (src, ref, deferred) in enumerate(staged.tensors):
            if ref.nbytes == 0:
                _copied(staged, i)
            elif not deferred:
                _dst(view, staged, ref).copy_(src)
                _copied(staged, i)
            elif src.is_cuda:
                by_device.setdefault(src.device, []).append(i)
        if by_device:
            staged.sums.start()   # sum behind the DMA; host copies use torch's threads: summed after them
        n_staged = 0
        for device, indices in by_device.items():
            stream = streams.get(device)
            source = torch.cuda.Event()
            source.record(torch.cuda.current_stream(device))
            staged.source_events[device] = source
            stream.wait_event(source)
            srcs = [staged.tensors[i][0] for i in indices]
            with torch.cuda.stream(stream):
                if staging is not None:
                    bufs = [staging.buffer(n_staged + k, src) for k, src in enumerate(srcs)]
                    torch._foreach_copy_(bufs, srcs, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    staged.staged_events[device] = event
                    staged.to_host += [(i, stream, buf, staged.tensors[i][1]) for i, buf in zip(indices, bufs)]
                    n_staged += len(indices)
                else:
                    for i, src in zip(indices, srcs):
                        _dst(view, staged, staged.tensors[i][1]).copy_(src, non_blocking=True)
                        _record_done(staged, i, stream)
            for src in srcs:
                src.record_stream(stream)
        if staging is not None:
            staging.trim(n_staged)
    except BaseException:
        staged.sums.cancel()
        raise


def _record_done(staged: Staged, index: int, stream: Any) -> None:
    import torch
    event = torch.cuda.Event()
    event.record(stream)
    staged.device_done.append((index, event))
    staged.cuda_event = event


def _to_host(view: memoryview, staged: Staged) -> None:
    """Copy the staging buffers to the slot (in the writer thread), PIECE bytes at a time, each piece
    launched once the one before has landed.

    Why paced: a GPU's copy engine serves the device->host copies given to it in order, and one that the
    training makes itself - `loss.item()`, a `.cpu()`, a copy into pinned memory - waits behind all those
    already queued. Measured on an H200 (scripts/bench/gpu_copy_engine.py): with 6.7 GB queued at once a
    15 ms step that ends in `.item()` took 0.121 s (the whole copy); with two 64 MiB pieces in flight still
    0.122 s; with one at a time 0.016 s, the copy at 54 GB/s instead of 55. The buffers are ours (the next
    save waits for this one), so nothing the training does waits for this copy."""
    if not staged.to_host:
        return
    import torch
    start = HEADER_LEN + _aligned(len(staged.meta))
    event = torch.cuda.Event()
    for i, stream, buf, ref in staged.to_host:
        flat = buf.view(-1).view(torch.uint8)
        at = start + ref.offset
        with torch.cuda.stream(stream):
            for o in range(0, ref.nbytes, PIECE):
                n = min(PIECE, ref.nbytes - o)
                torch.frombuffer(view[at + o:at + o + n], dtype=torch.uint8).copy_(flat[o:o + n], non_blocking=True)
                event.record(stream)
                event.synchronize()
        _copied(staged, i)
    staged.cuda_event = event


def checksum(view: memoryview, step: int, meta_len: int, data_len: int, chunk: int = CHUNK,
             crcs: Optional[list[int]] = None) -> int:
    """The checksum of a slot laid out in `view` (see the module doc); `crcs`: its data chunks' CRC32s
    when they are known already (summed during the copy)."""
    if crcs is None:
        crcs = chunk_crcs(view, HEADER_LEN + _aligned(meta_len), data_len, chunk)
    crc = zlib.crc32(_SUMMED.pack(step, meta_len, data_len, chunk))
    crc = zlib.crc32(view[HEADER_LEN:HEADER_LEN + meta_len], crc)
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs), crc)


def finish_copies(view: memoryview, staged: Staged, valid: Callable[[], bool] = lambda: True) -> bool:
    """Finish the deferred copies; False (the slot stays incomplete, never used) when `valid()` says no.

    `valid` is asked once every copy has finished. The caller says False when a restart was requested
    meanwhile - on a GPU the host runs ahead of the device, and a copy that waited for work the restart
    then aborted holds garbage.
    """
    try:
        for i, (src, ref, deferred) in enumerate(staged.tensors):
            if deferred and not src.is_cuda and ref.nbytes:
                _dst(view, staged, ref).copy_(src)
                _copied(staged, i)
        staged.host_copied.set()
        for i, event in staged.device_done:
            event.synchronize()
            _copied(staged, i)
        _to_host(view, staged)
        if staged.cuda_event is not None:
            staged.cuda_event.synchronize()
        ok = bool(valid())
    except BaseException:
        ok = False
        raise
    finally:
        staged.host_copied.set()
        staged.tensors.clear()
        staged.device_done.clear()
        staged.to_host.clear()
        if not ok and staged.sums is not None:
            staged.sums.cancel()
    return ok


def data_final(staged: Staged) -> bool:
    """Whether everything the snapshot's copies read has been computed: host tensors always are; device
    tensors once the compute stream has passed the point where save() was called. A device that fails to
    answer counts as not final."""
    try:
        return all(bool(event.query()) for event in staged.source_events.values())
    except Exception:   # a broken CUDA context: the data cannot be trusted
        return False


def seal(view: memoryview, staged: Staged) -> None:
    """Write the metadata, the checksum and, last, the header that makes the slot valid."""
    view[HEADER_LEN:HEADER_LEN + len(staged.meta)] = staged.meta
    crcs = staged.sums.result() if staged.sums is not None else None
    crc = checksum(view, staged.step, len(staged.meta), staged.data_len, CHUNK, crcs)
    view[:HEADER.size] = HEADER.pack(MAGIC, staged.step, crc, 1, len(staged.meta), staged.data_len, CHUNK)


def header(data: Any, what: str) -> tuple[int, int, int, int, int]:
    """(step, crc, meta len, data len, chunk size) of a complete slot; SnapshotCorrupt otherwise."""
    if len(data) < HEADER_LEN:
        raise SnapshotCorrupt(f"{what}: not a snapshot")
    magic, step, crc, done, meta_len, data_len, chunk = HEADER.unpack(bytes(data[:HEADER.size]))
    if magic != MAGIC or not done:
        raise SnapshotCorrupt(f"{what}: incomplete or not a snapshot of this version")
    if not (1 << 16) <= chunk <= (1 << 32) - 1 or len(data) < HEADER_LEN + _aligned(meta_len) + data_len:
        raise SnapshotCorrupt(f"{what}: truncated or malformed (step {step})")
    return step, crc, meta_len, data_len, chunk


def verify(data: Any, what: str) -> int:
    """The step of a complete slot whose checksum matches and whose metadata is well-formed (decoded
    without building tensors); SnapshotCorrupt otherwise."""
    return _decode(data, what, True, None)[0]


def decode(data: Any, what: str, verify: bool = True, copy: bool = True) -> tuple[int, Any]:
    """(step, payload) of a slot's bytes; tensors copied out of `data`, or views of it with copy=False.

    verify=False only for bytes this process has just verified (the checksum is always in the slot)."""
    return _decode(data, what, verify, copy)


def ref_dtype(ref: TensorRef) -> Any:
    """The torch dtype of a tensor reference read back from metadata, checked against its byte count;
    CodecError for an unknown dtype or a size that does not match the shape."""
    import torch
    dtype = getattr(torch, ref.dtype, None) if ref.dtype.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown dtype {ref.dtype!r}")
    numel = 1
    for d in ref.shape:
        numel *= d
    if numel * torch.empty((), dtype=dtype).element_size() != ref.nbytes:
        raise CodecError(f"a tensor of {ref.shape} {ref.dtype} does not fit its {ref.nbytes} bytes")
    return dtype


def _decode(data: Any, what: str, verify: bool, copy: Optional[bool]) -> tuple[int, Any]:
    """decode; with copy=None every tensor reference is checked but no tensor is built (None in its place)."""
    import torch
    step, crc, meta_len, data_len, chunk = header(data, what)
    view = memoryview(data).cast("B")
    if verify and checksum(view, step, meta_len, data_len, chunk) != crc:
        raise SnapshotCorrupt(f"{what}: checksum mismatch (step {step})")
    base = HEADER_LEN + _aligned(meta_len)

    def load(ref: TensorRef) -> Any:
        try:
            dtype = ref_dtype(ref)
        except CodecError as exc:
            raise SnapshotCorrupt(f"{what}: {exc}") from None
        if ref.offset + ref.nbytes > data_len:
            raise SnapshotCorrupt(f"{what}: a tensor of {ref.shape} {ref.dtype} does not fit its bytes")
        if copy is None:
            return None
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        raw = torch.frombuffer(view[base + ref.offset:base + ref.offset + ref.nbytes], dtype=torch.uint8)
        t = raw.view(dtype).view(ref.shape)
        return t.clone() if copy else t
    try:
        with warnings.catch_warnings():   # views of a read-only mapping (pinned_read.py) are only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return step, safe_codec.loads(view[HEADER_LEN:HEADER_LEN + meta_len], load)
    except CodecError as exc:
        raise SnapshotCorrupt(f"{what}: {exc} (step {step})") from None


def write_atomic(path: str, blob: bytes, durable: bool = False) -> None:
    """Write `blob` as `path` through a temporary file (0600, never through a symlink) and a rename, so a
    reader sees the whole file or none; `durable`: fsync first (a disk, not a tmpfs)."""
    with os.fdopen(open_private(path + ".tmp"), "wb") as fh:
        fh.write(blob)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


class SlotWriter:
    """At most one snapshot completing in the background: the copy (`wait_copied`: the optimizer step
    waits for it) and then the checksum and header (`wait`: the next save and restore wait for all)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: Optional[BaseException] = None

    def start(self, copy: Callable[[], bool], seal: Callable[[], None]) -> None:
        self.wait()
        self._copied.clear()

        def run() -> None:
            try:
                ok = copy()
                self._copied.set()
                if ok:
                    seal()
            except BaseException as exc:  # reported at the next wait, in the training thread
                self._error = exc
            finally:
                self._copied.set()
        self._thread = threading.Thread(target=run, name="hyperpodrun-snapshot", daemon=True)
        self._thread.start()

    def wait_copied(self) -> None:
        self._copied.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            log.error("a snapshot was not written: %s", err)
