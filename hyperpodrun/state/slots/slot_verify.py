"""A slot's checksum summed beside its copy to the device, instead of before it.

Why: a replacement rank (a standby that took over a killed rank) restores from the slot its predecessor
sealed. It did not write that slot, so it must sum it (6.4 GB: 0.21 s on 16 threads of an H200 host) - and
summing before copying put that sum on the critical path of every SIGKILL recovery, although a sealed slot
that fails its checksum is rare (a bit flip, or another process of this uid writing into our 0700
directory). So the newest slot is taken on its header (restore_plan.find_snapshots(deferred=...)), its
tensors are copied out of it while helper threads sum it, and the restore waits for the sum before it
returns. A slot that fails is removed and the restore raises SnapshotCorrupt: the generation fails like any
exception, and the next round's restore no longer sees that slot (it takes an older one, a peer's copy, or
the fallback), so what was copied out of it is always overwritten before a step runs.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from hyperpodrun.errors import SnapshotCorrupt
from hyperpodrun.state.slots import snapshot_io as io


class VerifyAlongside:
    """Sum the slot in `view` (its bytes, read-only) in a thread of its own, from now until result()."""

    def __init__(self, view: Any, what: str, step: int) -> None:
        self._view, self._what, self._step = view, what, step
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            step = io.verify(self._view, self._what)
            if step != self._step:
                raise SnapshotCorrupt(f"{self._what}: holds step {step}, not {self._step}")
        except BaseException as exc:   # handed to the restoring thread, which raises it
            self._error = exc
        finally:
            self._view = None

    def result(self) -> None:
        """Wait for the sum; SnapshotCorrupt (or what the sum raised) when the slot is not intact."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


__all__ = ["VerifyAlongside"]
