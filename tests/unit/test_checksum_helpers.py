"""The checksum helpers are kept for the process (slot_checksum._Helpers): snapshot after snapshot they are
reused, not started again, and a forked child - a zygote's worker, a user's DataLoader process - gets its own
instead of waiting for the parent's, which do not exist there."""
from __future__ import annotations

import os
import time
import zlib

from hyperpodrun.state.slots import slot_checksum
from hyperpodrun.state.slots.slot_checksum import ChunkSums


def sums_of(data: memoryview, threads: int) -> list[int]:
    sums = ChunkSums(data, 0, len(data), chunk=4096, threads=threads).start()
    sums.advance(len(data))
    return sums.result()


def test_helpers_are_reused_across_snapshots():
    data = memoryview(os.urandom(64 * 4096))
    want = [zlib.crc32(data[i:i + 4096]) for i in range(0, len(data), 4096)]
    assert sums_of(data, 4) == want
    made = slot_checksum._HELPERS.threads
    for _ in range(20):
        assert sums_of(data, 4) == want
    assert made >= 3 and slot_checksum._HELPERS.threads == made   # result() returns with its helpers idle


def test_a_forked_child_sums_with_helpers_of_its_own():
    data = memoryview(os.urandom(32 * 4096))
    want = [zlib.crc32(data[i:i + 4096]) for i in range(0, len(data), 4096)]
    assert sums_of(data, 4) == want                 # the parent's helpers exist
    pid = os.fork()
    if pid == 0:                                    # the child: the parent's helper threads are not here
        code = 1
        try:
            code = 0 if sums_of(data, 4) == want and slot_checksum._HELPERS.threads == 3 else 3
        finally:
            os._exit(code)
    end = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child never finished its checksum (it waited for absent helpers)")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_snapshot_is_summed_at_idle_priority_and_a_restore_check_at_normal():
    """Summing a snapshot beside the training must leave the CPUs to it (idle scheduling class: the helpers take
    only time nothing else wants); a restore waits for its check, so that one runs at normal priority."""
    import threading

    def policies(pool: "slot_checksum._Helpers", background: bool) -> set[int]:
        seen: set[int] = set()
        lock = threading.Lock()
        data = memoryview(os.urandom(64 * 4096))

        class Spy(ChunkSums):
            def _work(self) -> None:
                if threading.current_thread() is not threading.main_thread():
                    with lock:
                        seen.add(os.sched_getscheduler(0))
                super()._work()
        sums = Spy(data, 0, len(data), chunk=4096, threads=4, background=background).start()
        sums.advance(len(data))
        assert sums.result() == [zlib.crc32(data[i:i + 4096]) for i in range(0, len(data), 4096)]
        return seen

    assert policies(slot_checksum._BACKGROUND, True) == {os.SCHED_IDLE}
    assert policies(slot_checksum._HELPERS, False) == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER   # the caller (the writer thread, here the test) is untouched
