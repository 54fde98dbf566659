"""Copying a snapshot's tensors into its slot: now, on a side CUDA stream, or through device buffers.

Why a module of its own: the slot format (snapshot_io) is what a restore trusts and checks; how the bytes
get there is where the speed is, and where the GPU's habits matter. With `defer` (snapshot_io.plan), the
large tensors that only the optimizer step changes (parameters, optimizer state) are copied later: GPU
tensors on a side CUDA stream, host tensors by the writer thread; forward and backward of the next step
overlap the copy, and the optimizer step waits for it (see CheckpointManager). With a `DeviceStaging` as
well, the side stream first copies the deferred GPU tensors into buffers on their own device (at memory
speed, a few ms per GB): the optimizer step then waits for that device-to-device copy only, and the
device->host copy (bound by PCIe) may run over several of the following steps - launched by the writer
thread one piece at a time, so that the training's own device->host copies (`loss.item()`) never queue
behind it (`_to_host`). The buffers cost as much device memory as the tensors they hold.

The checksum threads (slot_checksum.ChunkSums) sum each tensor's bytes as soon as its copy has landed.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hyperpodrun.state.codec.safe_codec import TensorRef
from hyperpodrun.state.slots.slot_checksum import ChunkSums
from hyperpodrun.state.slots.snapshot_io import HEADER_LEN, Staged, aligned


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


def free_bytes(device: Any) -> int:
    """Memory a GPU has for new tensors: free to the driver plus cached but unused by torch's allocator, less a
    tenth of the device for the training's own peaks (0 where CUDA cannot say). Whether staging buffers fit,
    and whether a survivor may hold the previous generation's tensors while objects are built again."""
    import torch
    try:
        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - total // 10
    except RuntimeError:
        return 0


def _dst(view: memoryview, staged: Staged, ref: TensorRef) -> Any:
    import torch
    start = HEADER_LEN + aligned(len(staged.meta)) + ref.offset
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
    staged.sums = ChunkSums(view, HEADER_LEN + aligned(len(staged.meta)), staged.data_len, background=True)
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


_COPY_STREAMS: dict[Any, Any] = {}


def _copy_stream(device: Any) -> Any:
    """The stream of the staging buffers' device->host copies on `device` (one per device and process).

    Not the side stream the staging copy ran on: every save() queues its fingerprint there, behind the training's
    work so far, and a piece queued after it waits for the step in progress - one piece per step (seen on an
    H200: a 6.4 GB snapshot still incomplete 60 steps later, so a SIGKILL found no slot). The copy stream waits
    for the staging copy only."""
    import torch
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _to_host(view: memoryview, staged: Staged) -> None:
    """Copy the staging buffers to the slot (in the writer thread), PIECE bytes at a time, each piece
    launched once the one before has landed.

    Why paced: a GPU's copy engine serves the device->host copies given to it in order, and one that the
    training makes itself - `loss.item()`, a `.cpu()`, a copy into pinned memory - waits behind all those
    already queued. Measured on an H200 (scripts/bench/gpu/gpu_copy_engine.py): with 6.7 GB queued at once a
    15 ms step that ends in `.item()` took 0.121 s (the whole copy); with two 64 MiB pieces in flight still
    0.122 s; with one at a time 0.016 s, the copy at 54 GB/s instead of 55. The buffers are ours (the next
    save waits for this one), so nothing the training does waits for this copy."""
    if not staged.to_host:
        return
    import torch
    start = HEADER_LEN + aligned(len(staged.meta))
    event = torch.cuda.Event()
    waited: set[Any] = set()
    for i, _side, buf, ref in staged.to_host:
        flat = buf.view(-1).view(torch.uint8)
        at = start + ref.offset
        stream = _copy_stream(buf.device)
        if buf.device not in waited:
            waited.add(buf.device)
            stream.wait_event(staged.staged_events[buf.device])
        with torch.cuda.stream(stream):
            for o in range(0, ref.nbytes, PIECE):
                n = min(PIECE, ref.nbytes - o)
                torch.frombuffer(view[at + o:at + o + n], dtype=torch.uint8).copy_(flat[o:o + n], non_blocking=True)
                event.record(stream)
                event.synchronize()
        _copied(staged, i)
    staged.cuda_event = event


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


__all__ = ["SideStream", "DeviceStaging", "free_bytes", "copy_now", "finish_copies", "data_final", "PIECE"]
