"""Reading a snapshot back onto the GPU at DMA speed: a read-only mapping, populated and pinned.

Why: a rank that must copy its state back (a replacement, a survivor whose objects moved past the
committed step) used to read its slot through a private copy-on-write mapping - one page fault per 4 KiB
as the copy went, and a pageable host->device copy that the driver stages through its own buffers: about
3 GB/s for a 6.4 GB state on an H200 host, 2.2 s. Here the slot is mapped shared and read-only with its
page tables filled in one call (MAP_POPULATE: the pages are already in the tmpfs, nothing is read from a
disk), registered with CUDA as read-only pinned memory, and the tensors are copied with `non_blocking`
straight from it by DMA. The mapping stays registered until every copy has completed (`close()`
synchronizes first). Where registration fails (no CUDA, a driver without read-only registration, a locked
memory limit) the copy is the pageable one, as before, with one log line saying why.

Reading never writes: the mapping is PROT_READ, so a tensor view of it that something tried to write
would fault rather than change the slot - restore copies everything out of it (state_dicts.like).
"""
from __future__ import annotations

import logging
import mmap
import os
import warnings
from typing import Any, Optional

log = logging.getLogger("hyperpodrun.runtime")

#: cudaHostRegisterReadOnly: the device only reads the memory (no copy-on-write, no write access needed)
_REGISTER_READ_ONLY = 0x08


def map_readonly(path: str, populate: bool = False) -> mmap.mmap:
    """A read-only shared mapping of a slot or fallback file, never opened through a symlink; `populate`:
    every page table entry filled now (for a file read whole), not one fault per page as it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def buffer_address(buf: Any) -> int:
    """The address of a (possibly read-only) buffer's first byte."""
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "the given buffer is not writable": we only take its address
        return int(torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr())


class DeviceReadable:
    """A slot file mapped for a restore; pinned for DMA when `pin` (the state has CUDA tensors)."""

    def __init__(self, path: str, pin: bool) -> None:
        self.map = map_readonly(path, populate=True)
        self._registered: Optional[int] = None
        if pin and len(self.map):
            self._register()

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    def _register(self) -> None:
        try:
            import torch
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return
            ptr = buffer_address(self.map)
            err = torch.cuda.cudart().cudaHostRegister(ptr, len(self.map), _REGISTER_READ_ONLY)
            if int(err) == 0:
                self._registered = ptr
            else:
                log.info("restore reads its slot unpinned (cudaHostRegister: error %s): a pageable copy", int(err))
        except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
            log.info("restore reads its slot unpinned (%s): a pageable copy", exc)

    def close(self) -> None:
        """Wait for the copies out of the mapping, then unpin it (the mapping goes with its last view)."""
        if self._registered is not None:
            import torch
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        try:
            self.map.close()
        except BufferError:      # a view is still alive; the mapping is freed with it
            pass


__all__ = ["DeviceReadable", "map_readonly", "buffer_address"]
