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

Ahead of need (`prepin`, a standby: agent/workers/standby.py): mapping and registering a 6.4 GB slot costs 0.6 s
on an H200 host, more than the copy itself (0.12 s). A standby maps its local rank's slot files and
registers them while it waits; when it becomes the rank, the restore reads through those mappings
(`prepinned`) and the rank's first save writes through them (`take`, snapshot_io.SlotFile) - no mapping,
no registration on the critical path. A file that changed since (another inode or size) is mapped anew.
"""
from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger("hyperpodrun.runtime")

#: cudaHostRegisterReadOnly: the device only reads the memory (no copy-on-write, no write access needed)
_REGISTER_READ_ONLY = 0x08


def map_readonly(path: str, populate: bool = False) -> mmap.mmap:
    """A read-only shared mapping of a slot or fallback file, never opened through a symlink; `populate`:
    every page table entry filled now (for a file read whole), not one fault per page as it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if populate and _libc_populate is not None:
            m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            if populate_without_gil(m, write=False):
                return m
            m.close()
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


#: madvise(2) advice that fills a mapping's page tables (Linux >= 5.14): the same work as MAP_POPULATE
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23


def _find_madvise() -> Optional[Callable[..., int]]:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_libc_populate = _find_madvise()


def populate_without_gil(m: mmap.mmap, write: bool) -> bool:
    """Fill the page tables of mapping `m` (its pages read - or, `write`, made writable - now), in a call
    that lets other threads run: Python's mmap holds the interpreter lock for a whole MAP_POPULATE (0.3 s
    for a 6.4 GB slot, 3.5 s for 2 GB of fresh tmpfs pages), which stopped a standby's rank - the script it
    had just become - while its prepinning thread mapped a slot. A foreign call through ctypes releases
    the lock. False where the kernel has no MADV_POPULATE_* (before 5.14) or the call fails: the caller
    maps the way it did before."""
    if _libc_populate is None or not len(m):
        return False
    try:
        addr = buffer_address(m)
    except Exception:             # no torch to take the address with: the old way
        return False
    return _libc_populate(addr, len(m), _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) == 0


def buffer_address(buf: Any) -> int:
    """The address of a (possibly read-only) buffer's first byte."""
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "the given buffer is not writable": we only take its address
        return int(torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr())


def register(m: mmap.mmap, read_only: bool, what: str) -> Optional[int]:
    """Register the whole mapping with CUDA as pinned memory (`read_only`: the device only reads it); its
    address, or None - with one log line naming `what` and why - where CUDA is not there or says no."""
    try:
        import torch
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        ptr = buffer_address(m)
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, len(m), _REGISTER_READ_ONLY if read_only else 0))
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
        log.info("%s not pinned (%s): its device copies are pageable ones", what, exc)
        return None
    if err != 0:
        _clear_cuda_error()
        log.info("%s not pinned (cudaHostRegister: error %d): its device copies are pageable ones", what, err)
        return None
    return ptr


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves its error as the runtime's last error, which the next torch call that
    checks it would raise (an unrelated `empty_like`, seen on a slot in a disk-backed directory): take it off."""
    import torch
    cudart = torch.cuda.cudart()
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is not None:
        get_last()
        return
    for _ in range(2):     # the first kernel launch check reads (and clears) the pending error
        try:
            torch.empty(1, device="cuda").fill_(0)
            return
        except RuntimeError:
            continue


@dataclass
class Pinned:
    """A slot file mapped shared (read-write: its rank's saves write it) and registered with CUDA."""

    ino: int
    size: int
    map: mmap.mmap
    ptr: int


_PREPINNED: dict[str, Pinned] = {}
#: held while a file is being prepinned: a standby prepins in a thread of its own (Prepinner), and the rank it
#: has become asks for a prepinned mapping (`prepinned`, `take`) only once that file's registration is done
_LOCK = threading.RLock()


def release(m: mmap.mmap, ptr: Optional[int]) -> None:
    """Unregister `ptr` from CUDA (when there is one) and close the mapping - freed with its last view when a
    view is still alive."""
    if ptr:
        try:
            import torch
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception as exc:   # no CUDA any more (a torch without it raises AssertionError)
            log.debug("cudaHostUnregister: %s", exc)
    try:
        m.close()
    except BufferError:
        pass


def unpin(p: Pinned) -> None:
    """Unregister and close a prepinned mapping (its owner is done with it)."""
    release(p.map, p.ptr)


def _current(path: str) -> Optional[os.stat_result]:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None


def prepin(path: str) -> bool:
    """Map and register `path` now for a restore or save later in this process; True when it is (again)
    prepinned. A file gone or changed since its last prepin is dropped or mapped anew."""
    with _LOCK:
        return _prepin(path)


def _prepin(path: str) -> bool:
    st = _current(path)
    old = _PREPINNED.get(path)
    if old is not None and st is not None and (old.ino, old.size) == (st.st_ino, st.st_size):
        return True
    if old is not None:
        unpin(_PREPINNED.pop(path))
    if st is None or st.st_size == 0:
        return False
    from hyperpodrun.safe_fs import open_private
    try:
        fd = open_private(path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
            if not populate_without_gil(m, write=True):   # the old way: holding the interpreter lock
                m.close()
                m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        log.info("could not prepin %s: %s", path, exc)
        return False
    ptr = register(m, read_only=False, what=path)
    if ptr is None:
        m.close()
        return False
    _PREPINNED[path] = Pinned(st.st_ino, st.st_size, m, ptr)
    return True


def prepin_dir(directory: str, stop: Callable[[], bool] = lambda: False) -> None:
    """Prepin every slot file in `directory` (a standby's rank's slots, re-checked while it waits); the ones
    that are gone are let go (their pages are freed only when nobody maps them). `stop()` is asked before
    each file: True ends the pass."""
    try:
        names = [n for n in os.listdir(directory) if not n.endswith(".tmp")]
    except OSError:
        names = []
    paths = {os.path.join(directory, n) for n in names}
    with _LOCK:
        for path in [p for p in _PREPINNED if os.path.dirname(p) == directory and p not in paths]:
            unpin(_PREPINNED.pop(path))
    for path in sorted(paths):
        if stop():
            return
        prepin(path)


class Prepinner:
    """Keeps a directory's slot files prepinned from a thread of its own, re-checked every `every` seconds.

    Why a thread: registering a 6.4 GB slot is one blocking call of ~0.3 s (and its populate as much). A
    standby that did it in its own loop made a rank that died meanwhile wait for the call to end before it
    could take over. Now the takeover goes on at once (`stop()` ends the passes; the file being registered
    is finished), and the rank's restore waits only if it needs that very file (`prepinned` takes the lock)."""

    def __init__(self, directory: str, every: float) -> None:
        self._directory, self._every = directory, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-prepin", daemon=True)

    def start(self) -> "Prepinner":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                prepin_dir(self._directory, self._stop.is_set)
            except Exception as exc:     # a standby without its prepins still takes over (mapping then)
                log.info("prepinning %s: %s", self._directory, exc)
            self._stop.wait(self._every)

    def stop(self) -> None:
        """No new pass and no new file from now on (returns at once)."""
        self._stop.set()


def prepinned(path: str) -> Optional[Pinned]:
    """The prepinned mapping of `path` if the file is still the one mapped (same inode and size); waits
    while a file is being prepinned."""
    with _LOCK:
        p = _PREPINNED.get(path)
    st = _current(path)
    if p is None or st is None or (p.ino, p.size) != (st.st_ino, st.st_size):
        return None
    return p


def take(path: str) -> Optional[Pinned]:
    """Hand a valid prepinned mapping of `path` over to its new owner (who unregisters and closes it)."""
    with _LOCK:
        p = prepinned(path)
        if p is not None:
            del _PREPINNED[path]
        return p


def unpin_all() -> None:
    with _LOCK:
        for path in list(_PREPINNED):
            unpin(_PREPINNED.pop(path))


class DeviceReadable:
    """A slot file mapped for a restore; pinned for DMA when `pin` (the state has CUDA tensors): through its
    prepinned mapping where there is one, else mapped and registered now. `mapped`: (mapping, registered) of
    a slot this process holds mapped already (the one its saves write: snapshot_io.SlotFile) - read through
    it, neither mapped nor registered again (registering 6.4 GB costs 0.3-0.6 s)."""

    def __init__(self, path: str, pin: bool, mapped: Optional[tuple[Any, bool]] = None) -> None:
        self._registered: Optional[int] = None
        self._pin = pin
        if mapped is not None:
            self._borrowed, self._borrowed_pinned = True, bool(mapped[1]) and pin
            self.map = mapped[0]
            return
        pre = prepinned(path) if pin else None
        self._borrowed = self._borrowed_pinned = pre is not None
        self.map = pre.map if pre is not None else map_readonly(path, populate=True)
        if pin and pre is None and len(self.map):
            self._registered = register(self.map, read_only=True, what=f"the restore's slot {path}")

    @property
    def pinned(self) -> bool:
        return self._registered is not None or self._borrowed_pinned

    @property
    def mapped_ahead(self) -> bool:
        """Whether the mapping was there already (this process's own, or a standby's prepinned one): nothing
        was mapped or registered for this restore."""
        return self._borrowed

    def close(self) -> None:
        """Wait for the copies out of the mapping, then unpin it (the mapping goes with its last view)."""
        if self._borrowed:          # the mapping stays for this rank's saves (take, SlotFile)
            if self._borrowed_pinned:
                import torch
                torch.cuda.synchronize()
            return
        if self._registered is not None:
            import torch
            torch.cuda.synchronize()
        release(self.map, self._registered)
        self._registered = None


__all__ = ["DeviceReadable", "map_readonly", "populate_without_gil", "buffer_address", "prepin", "prepinned", "take", "unpin", "unpin_all", "release", "register",
           "prepin_dir", "Prepinner",
           "Pinned"]
