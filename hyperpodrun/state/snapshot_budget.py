"""How often a GPU state is snapshotted when save() is called after every step: an overhead budget.

Why: the product note, the README and the Lightning and Hugging Face callbacks call `save()` after every
optimizer step. Copying a 6.4 GB state to the host takes longer than a 0.09 s step (PCIe, ~55 GB/s), and a
snapshot every step would cost 10-100 % of the step. Every save() call still certifies the live state (a
fingerprint: live_state.py) - an exception, a hang or a peer's death retrains nothing - but the copy that
survives the process's own death (SIGKILL, a lost GPU) is taken only every `interval` calls, with `interval`
the smallest that keeps the measured cost within `max_overhead` of the step:

    cycle    = ceil(snapshot cost / (AIM * max_overhead * step - certify cost))
    interval = max(2, cycle - steps a snapshot is in flight)         (at most MAX_INTERVAL)

Counted from the previous snapshot's seal (CheckpointManager): a cycle is the steps a snapshot is in flight plus
the steps after it without one, so a snapshot's cost is spread over both, and the step without a snapshot in
flight - the baseline of every cost here - keeps being measured (at least one such step a cycle).

What is measured, end to end rather than piece by piece (the pieces - host time, waits, the copy engine, the
checksum threads, the memory bandwidth they share - interact, and a model of them hid a 3x cost once):
- step: the time between save() calls with no snapshot in flight - the median of the last 16 (a pause for an
  evaluation, a data stall, an outlier, does not move it);
- snapshot cost: what the steps from a snapshot's save() call to its seal took beyond that many steps without
  one - the median over the last 8 snapshots; a snapshot that first mapped a slot (a one-time cost per slot
  and process) is not counted;
- certify cost: the device time of the fingerprint every save() computes, timed alone at a process's first
  calls (its host time hides behind the device's work in a GPU-bound step; its device time does not).
AIM (0.8): the interval is set for four fifths of the budget, not all of it - the costs are medians of noisy
steps, and a budget aimed at exactly is exceeded about half the time. All follow the job (a larger model, a slower step, a busy host). A snapshot still in flight when the next one
is due is not waited for: that call only certifies (coalesced).

What it bounds: a SIGKILL of a rank that has no surviving replica retrains at most `interval` + twice the steps
a snapshot is in flight (`retrain_bound`: the sealed snapshot restored was taken that long before its seal,
and the next one may be in flight when the kill comes); with a live replica (DDP, HSDP's replicate dimension,
optimizer instances) the replacement gets the replica's live tensors and retrains nothing.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any, Optional

#: the interval never grows past this many steps, whatever the measured costs say
MAX_INTERVAL = 64
_ALPHA = 0.3   # weight of a new measurement in the running means
#: the share of max_overhead the interval is set for (see the module doc)
AIM = 0.8


class OverheadBudget:
    """What snapshots cost and the interval it implies (see the module doc)."""

    def __init__(self, max_overhead: Optional[float]) -> None:
        self.max_overhead = max_overhead
        self._clean: deque[float] = deque(maxlen=16)    # steps with no snapshot in flight
        self._costs: deque[float] = deque(maxlen=8)     # each snapshot's cost beyond that many clean steps
        self.certify_s: Optional[float] = None          # device time of a save()'s fingerprint, timed alone
        self.call_s: Optional[float] = None             # host time of a save() that only certifies (reported)
        self.in_flight_steps = 0                        # the most save() calls a snapshot was seen in flight
        self.mean_in_flight: Optional[float] = None
        # until something is measured: a step without a snapshot in flight after each (what is measured against);
        # without a budget, every call
        self.interval = 1 if max_overhead is None else 2
        self._last_call: Optional[float] = None
        self._busy = False
        self._open: Optional[list] = None               # the snapshot being costed: [excess so far, counted]

    @property
    def step_s(self) -> Optional[float]:
        """The step with no snapshot in flight (median of the last ones measured)."""
        return statistics.median(self._clean) if self._clean else None

    @property
    def snapshot_s(self) -> Optional[float]:
        """What one snapshot costs the training (median of the last ones measured)."""
        return statistics.median(self._costs) if self._costs else None

    def call_started(self) -> float:
        """A save() call begins: the time since the previous one is a step (restarts reset it)."""
        now = time.perf_counter()
        if self._last_call is not None:
            took = now - self._last_call
            if self._busy:
                if self._open is not None and self.step_s is not None:
                    self._open[0] += took - self.step_s
            else:
                self._close()
                self._clean.append(took)
                if self._costs or self.certify_s is not None:
                    self._update()
        self._last_call = now
        return now

    def call_ended(self, in_flight: bool) -> None:
        """A save() call returns, with a snapshot in flight or not: the step that follows runs beside it."""
        self._busy = in_flight

    def snapshot_began(self, counted: bool = True) -> None:
        """This save() call takes a snapshot: the steps until one runs without it are its cost. `counted`
        False: it mapped a slot (a one-time cost, not what a snapshot costs)."""
        self._close()
        self._open = [0.0, counted]

    def _close(self) -> None:
        if self._open is not None:
            excess, counted = self._open
            self._open = None
            if counted and self.step_s is not None:
                self._costs.append(max(0.0, excess))
            self._update()

    def restarted(self) -> None:
        """The wrapped function runs again: the time until the next save() is no step, and the snapshot being
        costed is not (its steps were cut short)."""
        self._last_call = None
        self._open = None

    def certified(self, host_s: float) -> None:
        """A save() call that only certified took `host_s` of the host (reported; hidden behind the device's
        work in a GPU-bound step)."""
        self.call_s = _mean(self.call_s, host_s)

    def certify_measured(self, device_s: float) -> None:
        """A save()'s fingerprint took `device_s` of the device, timed alone (the least seen counts)."""
        self.certify_s = device_s if self.certify_s is None else min(self.certify_s, device_s)
        self._update()

    def in_flight(self, calls: int) -> None:
        """A snapshot was sealed `calls` save() calls after its own."""
        self.in_flight_steps = max(self.in_flight_steps, calls)
        self.mean_in_flight = _mean(self.mean_in_flight, float(max(1, calls)))

    def _update(self) -> None:
        step, cost = self.step_s, self.snapshot_s
        if self.max_overhead is None or step is None:
            return
        room = AIM * self.max_overhead * step - (self.certify_s or 0.0)
        if room <= 0:                   # certifying alone spends the budget: known before any snapshot is costed
            self.interval = MAX_INTERVAL
            return
        if cost is None:
            return
        cycle = math.ceil(cost / room)                  # steps to spread one snapshot's cost over
        self.interval = max(2, min(MAX_INTERVAL, cycle - math.floor(self.mean_in_flight or 0.0)))

    #: what a snapshot carries (`export`) and a replacement process starts from (`seed`)
    CARRIED = ("step_s", "snapshot_s", "certify_s", "mean_in_flight")

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
        if self._costs or not isinstance(measured, dict):
            return False
        sane = {k: float(v) for k in self.CARRIED if isinstance(v := measured.get(k), (int, float))
                and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e6}
        if not sane:
            return False
        if "step_s" in sane and not self._clean:
            self._clean.append(sane["step_s"])
        if "snapshot_s" in sane:
            self._costs.append(sane["snapshot_s"])
        if self.certify_s is None and "certify_s" in sane:
            self.certify_s = sane["certify_s"]
        if self.mean_in_flight is None and "mean_in_flight" in sane:
            self.mean_in_flight = sane["mean_in_flight"]
        self._update()
        return True

    @property
    def retrain_bound(self) -> int:
        """The most steps a SIGKILL without a surviving replica retrains, as measured so far."""
        return self.interval + 2 * self.in_flight_steps


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


__all__ = ["OverheadBudget", "MAX_INTERVAL"]
