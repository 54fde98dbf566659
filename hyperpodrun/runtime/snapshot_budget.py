"""How often a GPU state is snapshotted when save() is called after every step: an overhead budget.

Why: the product note, the README and the Lightning and Hugging Face callbacks call `save()` after every
optimizer step. Copying a 6.4 GB state takes the host ~5-7 ms of Python and launches and the device a
staging copy, and its device->host copy (PCIe, ~55 GB/s) takes longer than a 0.09 s step: a snapshot every
step costs 10-100 % of the step. Every save() call still certifies the live state (a fingerprint: live_state.py)
- an exception, a hang or a peer's death retrains nothing - but the copy that survives the process's own
death (SIGKILL, a lost GPU) is taken only every `interval` calls, with `interval` the smallest that keeps the
measured cost within `max_overhead` of the measured step:

    interval = max(1, ceil((snapshot cost - call cost) / (max_overhead * step - call cost) - steps in flight))

counted from the previous snapshot's seal (CheckpointManager): a cycle is the steps a snapshot is in flight
plus `interval` steps without one, so the cost of one snapshot is spread over both, and the step without a
snapshot in flight - the baseline every cost here is measured against - keeps being measured;

snapshot cost: the host time of a save() that snapshots plus the time the next optimizer step waited for its
copy, plus the device time of its staging copy, plus what the steps run while it is in flight lose to it (its
device->host copy and checksum share the host's and the device's bandwidth with the training: the steps with
a snapshot in flight against those without, times the steps it is in flight); call cost: the host time of a
save() that only certifies; step: the time between save() calls without a snapshot in flight. All are running means of what this process measured, so the interval follows
the job (a larger model, a slower step, a busy host). A snapshot still in flight when the next one is due is
not waited for: that call only certifies (coalesced).

What it bounds: a SIGKILL of a rank that has no surviving replica retrains at most `interval` + twice the steps
a snapshot is in flight (`retrain_bound`: the sealed snapshot restored was taken that long before the seal,
and the next one may be in flight when the kill comes); with a live replica (DDP, HSDP's replicate dimension, optimizer
instances) the replacement gets the replica's live tensors and retrains nothing.
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

#: the interval never grows past this many steps, whatever the measured costs say
MAX_INTERVAL = 64
_ALPHA = 0.3   # weight of a new measurement in the running means


class OverheadBudget:
    """Running means of what snapshots cost and the interval they imply (see the module doc)."""

    def __init__(self, max_overhead: Optional[float]) -> None:
        self.max_overhead = max_overhead
        self.step_s: Optional[float] = None       # time between save() calls, no snapshot in flight
        self.busy_step_s: Optional[float] = None  # the same with a snapshot in flight
        self.call_s: Optional[float] = None       # host time of a save() that only certifies
        self.snapshot_s: Optional[float] = None   # host + waited + staging time of a snapshot
        self.in_flight_steps = 0                  # the most save() calls a snapshot was seen in flight
        self.mean_in_flight: Optional[float] = None
        self.interval = 1
        self._last_call: Optional[float] = None
        self._busy = False

    def call_started(self) -> float:
        """A save() call begins: the time since the previous one is a step (restarts reset it)."""
        now = time.perf_counter()
        if self._last_call is not None:
            if self._busy:
                self.busy_step_s = _mean(self.busy_step_s, now - self._last_call)
            else:
                self.step_s = _mean(self.step_s, now - self._last_call)
        self._last_call = now
        return now

    def call_ended(self, in_flight: bool) -> None:
        """A save() call returns, with a snapshot in flight or not: the step that follows runs beside it."""
        self._busy = in_flight

    def restarted(self) -> None:
        """The wrapped function runs again: the time until the next save() is no step."""
        self._last_call = None

    def certified(self, host_s: float) -> None:
        self.call_s = _mean(self.call_s, host_s)

    def snapshot_cost(self, seconds: float) -> None:
        """What one snapshot cost the step: its save()'s host time, the optimizer step's wait for its copy,
        its staging copy on the device."""
        self.snapshot_s = _mean(self.snapshot_s, seconds)
        self._update()

    def in_flight(self, calls: int) -> None:
        """A snapshot was sealed `calls` save() calls after its own."""
        self.in_flight_steps = max(self.in_flight_steps, calls)
        self.mean_in_flight = _mean(self.mean_in_flight, float(max(1, calls)))

    def _update(self) -> None:
        step = self.step_s if self.step_s is not None else self.busy_step_s
        if self.max_overhead is None or step is None or self.snapshot_s is None:
            return
        base = self.call_s or 0.0
        room = self.max_overhead * step - base
        beside = 0.0     # what the steps beside a snapshot in flight lose to it, once both kinds were measured
        if self.step_s is not None and self.busy_step_s is not None:
            beside = max(0.0, self.busy_step_s - self.step_s) * (self.mean_in_flight or 1.0)
        extra = max(0.0, self.snapshot_s + beside - base)
        if room <= 0:
            self.interval = MAX_INTERVAL
        else:
            cycle = math.ceil(extra / room)         # steps to spread one snapshot's cost over
            self.interval = max(1, min(MAX_INTERVAL, cycle - math.floor(self.mean_in_flight or 0.0)))

    #: the running means a snapshot carries (`export`) and a replacement process starts from (`seed`)
    CARRIED = ("step_s", "busy_step_s", "call_s", "snapshot_s", "mean_in_flight")

    def export(self) -> dict[str, float]:
        """What this process measured, to be written into a snapshot: a process that restores from it starts
        with its predecessor's cadence instead of measuring from nothing."""
        return {k: float(v) for k in self.CARRIED if (v := getattr(self, k)) is not None}

    def seed(self, measured: Any) -> bool:
        """Start from a predecessor's measurements (`export` of the process whose snapshot was restored) where
        this process has none yet. Why: a fresh process's first save() would otherwise snapshot at once - and
        a replacement's first snapshot maps and registers a slot of its own (0.3-0.6 s for 6.4 GB) inside its
        first step after the restore, the step a recovery is timed to. Values that are not finite
        non-negative numbers are ignored (the snapshot's bytes are checked, not trusted for sense).
        Returns whether anything was taken."""
        if self.snapshot_s is not None or not isinstance(measured, dict):
            return False
        taken = False
        for key in self.CARRIED:
            value = measured.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and 0 <= value < 1e6 and getattr(self, key) is None:
                setattr(self, key, float(value))
                taken = True
        if taken:
            self._update()
        return taken

    @property
    def retrain_bound(self) -> int:
        """The most steps a SIGKILL without a surviving replica retrains, as measured so far."""
        return self.interval + 2 * self.in_flight_steps


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


__all__ = ["OverheadBudget", "MAX_INTERVAL"]
