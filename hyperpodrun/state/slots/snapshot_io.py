"""Snapshot slots: state laid out raw in a file in shared memory, written in place, valid once complete.

Why this format: a snapshot is taken after every optimizer step, so its cost is the cost of copying the
state once. Tensors are therefore copied straight into a memory-mapped slot file (for GPU tensors by DMA
into the mapping, registered with CUDA as pinned memory) - no serialisation pass, no second copy.
Everything that is not a tensor (the structure of the state dicts, hyper-parameters, RNG states) goes
into a small metadata block in the safe_codec encoding: reading a slot never runs code named by its
bytes (no pickle), whoever wrote them.

Copying the tensors in, now or behind the training (on a side CUDA stream, through device buffers): see
snapshot_copy.

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
from typing import Any, Callable, Optional, Union

from hyperpodrun.errors import SnapshotCorrupt
from hyperpodrun.state.slots import pinned_read
from hyperpodrun.state.codec import safe_codec
from hyperpodrun.state.codec.safe_codec import CodecError, TensorRef
from hyperpodrun.state.slots.slot_checksum import CHUNK, ChunkSums, chunk_crcs
from hyperpodrun.safe_fs import open_private

log = logging.getLogger("hyperpodrun.runtime")

MAGIC = b"HPRSNAP3"
HEADER = struct.Struct("<8sqIBxxxQQI")  # magic, step, crc, complete flag, meta len, data len, chunk size
_SUMMED = struct.Struct("<qQQI")        # the header fields the checksum covers
HEADER_LEN = 64
ALIGN = 64
#: bytes a slot file is made larger than its first snapshot needs (see SlotFile.prepare)
META_SLACK = 64 << 10


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
    #: per device, (start, end) events around the staging copy: its device time counts against the budget
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
        staged.data_len += aligned(nbytes)
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
        #: whether the last prepare() mapped (and registered) the file: a one-time cost, not a snapshot's
        self.mapped_now = False

    def prepare(self, staged: Staged, pin: bool) -> memoryview:
        """Size and map the file for `staged` and mark it incomplete; returns the whole mapping."""
        self.mapped_now = self._map_for(HEADER_LEN + aligned(len(staged.meta)) + staged.data_len, pin, keep=False)
        assert self._map is not None
        self._map[:HEADER_LEN] = b"\0" * HEADER_LEN             # incomplete until written again
        return memoryview(self._map)

    def reserve(self, size: int, pin: bool) -> bool:
        """Map (and register) the file ahead of the snapshot that will be written into it, leaving what it holds
        as it is - the other slot of a rank, which may hold the newest sealed snapshot. Returns whether it mapped
        now. Why: mapping and registering a 6.4 GB slot stalls the training for seconds (3.4 s seen on an
        H200 host); done for both slots at the first snapshot, no later step pays it."""
        if self._map is not None and size <= self._size:
            return False
        try:
            held = os.stat(self.path).st_size
        except FileNotFoundError:
            held = 0
        if held:
            # a file that holds something is never written here, not even truncated to its own size: that moves
            # its times, and a slot sealed by this process whose times moved counts as changed since (skipped at
            # a restore - seen as a step that survived nowhere). Too small: mapped when a snapshot is written to it.
            return self._map_for(size, pin, keep=True) if held >= size + META_SLACK else False
        return self._map_for(size, pin, keep=True)

    def _map_for(self, size: int, pin: bool, keep: bool) -> bool:
        if self._map is None and pin:
            pre = pinned_read.take(self.path)   # mapped and registered ahead by the standby this rank was
            if pre is not None and pre.size >= size:
                self._map, self._size, self._registered = pre.map, pre.size, pre.ptr
            elif pre is not None:
                pinned_read.unpin(pre)
        if self._map is not None and size <= self._size:
            return False
        self.close()
        # room for metadata that grows (the numbers in it change length from one snapshot to the next):
        # mapping and registering a 6.4 GB slot again stalled the step 0.6-3 s each time it grew past the end
        size += META_SLACK
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            held = os.fstat(fd).st_size if keep else 0
            if held >= size:
                size = held                          # kept as it is (reserve): mapped, not written
            else:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)      # a full tmpfs fails here (ENOSPC), not later (SIGBUS)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._size = size
        if pin:
            self._registered = pinned_read.register(self._map, read_only=False, what=f"snapshot slot {self.path}")
        return True

    def close(self) -> None:
        if self._map is not None:
            pinned_read.release(self._map, self._registered)
            self._registered = None
            self._map = None

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    @property
    def mapping(self) -> Optional[tuple[mmap.mmap, bool]]:
        """(the mapping, whether it is registered with CUDA) while the file is mapped, else None."""
        return (self._map, self._registered is not None) if self._map is not None else None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(view: memoryview, step: int, meta_len: int, data_len: int, chunk: int = CHUNK,
             crcs: Optional[list[int]] = None) -> int:
    """The checksum of a slot laid out in `view` (see the module doc); `crcs`: its data chunks' CRC32s
    when they are known already (summed during the copy)."""
    if crcs is None:
        crcs = chunk_crcs(view, HEADER_LEN + aligned(meta_len), data_len, chunk)
    crc = zlib.crc32(_SUMMED.pack(step, meta_len, data_len, chunk))
    crc = zlib.crc32(view[HEADER_LEN:HEADER_LEN + meta_len], crc)
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs), crc)


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
    if not (1 << 16) <= chunk <= (1 << 32) - 1 or len(data) < HEADER_LEN + aligned(meta_len) + data_len:
        raise SnapshotCorrupt(f"{what}: truncated or malformed (step {step})")
    return step, crc, meta_len, data_len, chunk


def data_end(data: Any, what: str) -> int:
    """Where a complete slot's checksummed bytes end (the file may be longer: META_SLACK)."""
    _step, _crc, meta_len, data_len, _chunk = header(data, what)
    return HEADER_LEN + aligned(meta_len) + data_len


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
    base = HEADER_LEN + aligned(meta_len)

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


def write_atomic(path: str, blob: Union[bytes, bytearray], durable: bool = False) -> None:
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

    def busy(self) -> bool:
        """Whether a snapshot is still being completed (copied, summed or sealed)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            log.error("a snapshot was not written: %s", err)
