"""Reading a slot back (hyperpodrun/state/slots/pinned_read.py): the mapping is read-only and populated, a
snapshot decodes from it and restores exactly, and without CUDA nothing is pinned (the pageable copy)."""
from __future__ import annotations

import os

import pytest
import torch

from hyperpodrun.state.slots import snapshot_copy
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots.pinned_read import DeviceReadable, buffer_address, map_readonly
from hyperpodrun.state.state_dicts import like


def write_slot(path: str, step: int, payload: dict) -> None:
    staged = io.plan(step, payload, set(), defer=False)
    slot = io.SlotFile(path)
    view = slot.prepare(staged, pin=False)
    snapshot_copy.copy_now(view, staged, snapshot_copy.SideStream())
    io.seal(view, staged)
    del view
    slot.close()


def test_a_slot_maps_read_only_and_restores_exactly(tmp_path):
    path = str(tmp_path / "slot0")
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "b": torch.arange(10, dtype=torch.int64), "n": 7}
    write_slot(path, 5, state)
    slot = DeviceReadable(path, pin=True)   # no CUDA here: mapped, not pinned
    try:
        assert not slot.pinned
        with pytest.raises(TypeError):
            slot.map[0:1] = b"x"                    # nothing can write the slot through it
        step, payload = io.decode(slot.map, "slot", verify=True, copy=False)
        current = {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64), "n": 0}
        got = like(payload, current, None, non_blocking=slot.pinned)
    finally:
        payload = None
        slot.close()
    assert step == 5 and got["n"] == 7
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert got["w"].data_ptr() != 0 and not got["w"].is_pinned()


def test_the_mapping_is_never_opened_through_a_symlink(tmp_path):
    target = tmp_path / "real"
    target.write_bytes(b"\0" * 4096)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(OSError):
        map_readonly(str(tmp_path / "link"))


def test_the_address_of_a_read_only_mapping_is_its_first_byte(tmp_path):
    (tmp_path / "f").write_bytes(b"abc" * 1000)
    m = map_readonly(str(tmp_path / "f"), populate=True)
    import ctypes
    assert ctypes.string_at(buffer_address(m), 3) == b"abc"
    m.close()


def test_a_prepinned_mapping_is_used_only_while_the_file_is_the_one_mapped(tmp_path):
    """The bookkeeping of prepin (a standby's slots; the registration itself needs a GPU): a mapping is
    handed over while the file has the inode and size it was mapped with, never after it was replaced."""
    import mmap
    from hyperpodrun.state.slots import pinned_read
    path = str(tmp_path / "slot0")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 8192)
    st = os.stat(path)
    fd = os.open(path, os.O_RDWR)
    entry = pinned_read.Pinned(st.st_ino, st.st_size, mmap.mmap(fd, st.st_size), 0)
    os.close(fd)
    pinned_read._PREPINNED[path] = entry
    try:
        assert pinned_read.prepinned(path) is entry
        assert pinned_read.prepin(path) is True          # unchanged: kept, not mapped again
        (tmp_path / "new").write_bytes(b"\0" * 8192)
        os.replace(str(tmp_path / "new"), path)          # the slot rewritten as a new file (a peer's copy)
        assert pinned_read.prepinned(path) is None       # another inode: never read through the old mapping
        assert pinned_read.take(path) is None
    finally:
        pinned_read.unpin_all()
    assert not pinned_read._PREPINNED


def test_a_standby_lets_go_of_a_slot_that_is_gone(tmp_path):
    """prepin_dir (a waiting standby's re-check) drops the mapping of a slot file that was removed, so the
    removed file's pages are not held pinned; files still there keep theirs."""
    import mmap
    from hyperpodrun.state.slots import pinned_read
    entries = {}
    for name in ("slot0", "slot1"):
        path = str(tmp_path / name)
        with open(path, "wb") as fh:
            fh.write(b"\0" * 4096)
        fd = os.open(path, os.O_RDWR)
        st = os.fstat(fd)
        entries[name] = pinned_read.Pinned(st.st_ino, st.st_size, mmap.mmap(fd, st.st_size), 0)
        os.close(fd)
        pinned_read._PREPINNED[path] = entries[name]
    try:
        os.unlink(tmp_path / "slot1")
        pinned_read.prepin_dir(str(tmp_path))
        assert pinned_read.prepinned(str(tmp_path / "slot0")) is entries["slot0"]
        assert str(tmp_path / "slot1") not in pinned_read._PREPINNED
    finally:
        pinned_read.unpin_all()


def test_a_takeover_does_not_wait_for_a_registration_in_progress(tmp_path, monkeypatch):
    """A standby prepins in its own thread (Prepinner): stop() - the rank died, the standby takes over - returns
    while a registration is still under way, no file is started after it, and a restore that asks for the file
    being registered gets its mapping once the registration is done (never a half-registered one)."""
    import threading
    from hyperpodrun.state.slots import pinned_read
    for name in ("slot0", "slot1"):
        (tmp_path / name).write_bytes(b"\0" * 8192)
    entered, gate, calls = threading.Event(), threading.Event(), []

    def slow_register(m, read_only, what):          # cudaHostRegister of a large slot: one long blocking call
        calls.append(what)
        entered.set()
        assert gate.wait(30)
        return 1
    monkeypatch.setattr(pinned_read, "register", slow_register)
    monkeypatch.setattr(pinned_read, "release", lambda m, ptr: m.close())
    prepinner = pinned_read.Prepinner(str(tmp_path), every=0.01).start()
    try:
        assert entered.wait(30)
        prepinner.stop()
        assert prepinner._thread.is_alive()        # stop() did not wait for the registration
        got: list = []
        asker = threading.Thread(target=lambda: got.append(pinned_read.prepinned(str(tmp_path / "slot0"))))
        asker.start()
        asker.join(0.2)
        assert asker.is_alive() and not got        # waits for the file being registered
        gate.set()
        asker.join(30)
        prepinner._thread.join(30)
        assert not prepinner._thread.is_alive()
        assert got and got[0] is not None and got[0].ptr == 1
        assert calls == [str(tmp_path / "slot0")]  # slot1 was never started after stop()
        assert str(tmp_path / "slot1") not in pinned_read._PREPINNED
    finally:
        gate.set()
        pinned_read.unpin_all()


def _rss_of_mapping(addr: int) -> int:
    """kB of the mapping starting at `addr` that are in this process's page tables (/proc/self/smaps)."""
    with open("/proc/self/smaps") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == addr
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("mapping not found")


@pytest.fixture
def shm_file():
    import tempfile
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(d, "slot0")
    yield path
    if os.path.exists(path):
        os.unlink(path)
    os.rmdir(d)


def test_populating_fills_the_page_tables_of_a_mapping(shm_file):
    """populate_without_gil does what MAP_POPULATE did: every page of the mapping is in the page tables, so a
    restore's read (or a device copy) takes no fault per page."""
    import mmap
    from hyperpodrun.state.slots import pinned_read
    size = 16 << 20
    with open(shm_file, "wb") as fh:
        fh.write(b"\1" * size)
    fd = os.open(shm_file, os.O_RDWR)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    os.close(fd)
    try:
        addr = buffer_address(m)
        assert _rss_of_mapping(addr) < size // 1024 // 2
        assert pinned_read.populate_without_gil(m, write=True)
        assert _rss_of_mapping(addr) == size // 1024
    finally:
        m.close()
    ro = map_readonly(shm_file, populate=True)     # the restore's read-only mapping, populated the same way
    try:
        assert _rss_of_mapping(buffer_address(ro)) == size // 1024
        assert ro[:4] == b"\1\1\1\1"
    finally:
        ro.close()


def test_populating_a_mapping_lets_the_other_threads_run(shm_file):
    """A standby's prepinning thread populates a slot while the rank it has become runs the script: the call
    must not hold the interpreter lock (Python's mmap holds it for a whole MAP_POPULATE, which stopped the
    script for as long). The main thread keeps running while another thread populates 512 MiB of fresh
    tmpfs pages: its longest pause is well under the call's duration."""
    import mmap
    import threading
    import time
    from hyperpodrun.state.slots import pinned_read
    size = 512 << 20
    fd = os.open(shm_file, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    os.close(fd)
    span: list[float] = []
    ok: list[bool] = []

    def populate() -> None:
        t0 = time.monotonic()
        ok.append(pinned_read.populate_without_gil(m, write=True))
        span.extend([t0, time.monotonic()])
    try:
        worker = threading.Thread(target=populate)
        ticks = [time.monotonic()]
        worker.start()
        while worker.is_alive():
            ticks.append(time.monotonic())
        worker.join()
        assert ok == [True]
        start, end = span
        inside = [t for t in ticks if start <= t <= end]
        gaps = [b - a for a, b in zip([start] + inside, inside + [end])]
        assert end - start > 0.02, "too quick to tell: the populate did no work"
        assert max(gaps) < (end - start) / 2, (max(gaps), end - start)
    finally:
        m.close()
