"""The checksum helpers are kept for the process (slot_checksum._Helpers): snapshot after snapshot they are
reused, not started again, and a forked child - a zygote's worker, a user's DataLoader process - gets its own
instead of waiting for the parent's, which do not exist there."""
from __future__ import annotations

import os
import time
import zlib

from hyperpodrun.runtime import slot_checksum
from hyperpodrun.runtime.slot_checksum import ChunkSums


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
