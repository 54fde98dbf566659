"""The NVML monitor: a helper thread of the agent that watches the node's GPUs and posts `GpuEvent`s.

It owns no job state (docs/ARCHITECTURE.md, "The agent"): it only turns NVML observations into events for
the agent's loop, which classifies them (agent/health/xid.py) and acts (agent/health/gpu_health.py). What it watches:
- XID events: blocks in nvmlEventSetWait with a short timeout (so it can stop), one event per XID;
- every `interval` seconds, per GPU: the volatile uncorrectable ECC counter (an increase is an event), row
  remapping pending/failed (one event each, when it first appears), clocks event reasons (one throttle event
  when a thermal or power reason starts; the episode ends after `quiet_s` without it, so a GPU that keeps
  touching its power limit is reported once, not at every poll);
- a GPU that stops answering: NVML_ERROR_GPU_IS_LOST at once, any other query error `lost_after` polls in a
  row; it is then reported once as `lost` and no longer polled.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from hyperpodrun.agent.health.nvml_backend import Backend, DeviceQueryError
from hyperpodrun.agent.health.xid import THROTTLE_MASK, GpuEvent, throttle_reasons

log = logging.getLogger("hyperpodrun.agent")

#: longest single wait for an XID event: bounds how long stop() waits for the thread
WAIT_SLICE_S = 0.5


class NvmlMonitor:
    """Watches the GPUs of `backend`; `post(("gpu", GpuEvent))` for everything worth the loop's attention."""

    def __init__(self, backend: Backend, post: Callable[[tuple[str, Any]], None], interval: float = 5.0,
                 quiet_s: float = 30.0, lost_after: int = 3) -> None:
        self.backend = backend
        self.post = post
        self.interval = interval
        self.quiet_s = quiet_s
        self.lost_after = lost_after
        self.devices = [d.index for d in backend.devices()]
        self.registered: list[int] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ecc: dict[int, Optional[int]] = {}
        self._remap_seen: dict[int, set[str]] = {i: set() for i in self.devices}
        self._throttle_bits: dict[int, int] = {i: 0 for i in self.devices}        # reasons of the open episode
        self._throttle_last: dict[int, float] = {i: 0.0 for i in self.devices}    # last poll that saw them
        self._errors: dict[int, int] = {i: 0 for i in self.devices}
        self.lost: set[int] = set()
        self._baselined = False

    @property
    def native_id(self) -> Optional[int]:
        """The thread's OS id (for measuring its CPU time in /proc/self/task/<id>/stat)."""
        return self._thread.native_id if self._thread is not None else None

    # ------------------------------------------------------------------ lifecycle
    def baseline(self) -> None:
        """Register for XID events and read every GPU once, in the caller's thread; what is already wrong is
        posted now (the agent handles it before it starts any worker)."""
        self.registered = self.backend.register_xid()
        for idx in self.devices:
            self._check_device(idx, time.monotonic(), first=True)
        self._baselined = True

    def start(self) -> None:
        """Start the thread (after `baseline()`, which runs here if it has not yet)."""
        if not self._baselined:
            self.baseline()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-nvml", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = WAIT_SLICE_S + 1.0) -> bool:
        """Stop the thread; True when it ended (the backend may then be closed)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_poll = time.monotonic() + self.interval
        while not self._stop.is_set():
            try:
                wait = min(WAIT_SLICE_S, max(0.0, next_poll - time.monotonic()))
                if self.registered:
                    got = self.backend.wait_xid(wait)
                    if got is not None:
                        self._emit(GpuEvent("xid", got[0], xid=got[1]))
                else:
                    self._stop.wait(wait)
                now = time.monotonic()
                if now >= next_poll:
                    self.poll(now)
                    next_poll = now + self.interval
            except Exception as exc:  # never let the monitor die silently: report, back off, go on
                log.debug("NVML monitor error", exc_info=True)
                self._emit(GpuEvent("monitor_error", None, detail=f"{type(exc).__name__}: {exc}"))
                self._stop.wait(self.interval)

    def poll(self, now: float) -> None:
        """One round of the polled signals over every GPU still answering."""
        self.polls += 1
        for idx in self.devices:
            if idx not in self.lost:
                self._check_device(idx, now)

    def _emit(self, ev: GpuEvent) -> None:
        self.post(("gpu", ev))

    def _check_device(self, idx: int, now: float, first: bool = False) -> None:
        try:
            ecc = self.backend.ecc_uncorrected(idx)
            remap = self.backend.remap_state(idx)
            reasons = self.backend.clock_event_reasons(idx)
        except DeviceQueryError as exc:
            self._errors[idx] += 1
            if exc.lost or self._errors[idx] >= self.lost_after:
                self.lost.add(idx)
                self._emit(GpuEvent("lost", idx, detail=exc.detail))
            else:
                log.debug("GPU %d: NVML query failed (%s), %d in a row", idx, exc.detail, self._errors[idx])
            return
        self._errors[idx] = 0
        self._check_ecc(idx, ecc, first)
        if remap is not None:
            for flag, kind in zip(remap, ("remap_pending", "remap_failure")):
                if flag and kind not in self._remap_seen[idx]:
                    self._remap_seen[idx].add(kind)
                    self._emit(GpuEvent(kind, idx))
        if reasons is not None:
            self._check_throttle(idx, reasons, now)

    def _check_ecc(self, idx: int, ecc: Optional[int], first: bool) -> None:
        if ecc is None:
            return
        before = self._ecc.get(idx)
        self._ecc[idx] = ecc
        if first or before is None:
            if ecc > 0:
                self._emit(GpuEvent("ecc_at_start", idx, count=ecc))
        elif ecc > before:
            self._emit(GpuEvent("ecc", idx, count=ecc - before))

    def _check_throttle(self, idx: int, bits: int, now: float) -> None:
        relevant = bits & THROTTLE_MASK
        if relevant:
            new = relevant & ~self._throttle_bits[idx]
            self._throttle_last[idx] = now
            if new:   # a reason that was not part of the open episode: report it (once)
                self._throttle_bits[idx] |= relevant
                self._emit(GpuEvent("throttle", idx, count=new))
        elif self._throttle_bits[idx] and now - self._throttle_last[idx] >= self.quiet_s:
            log.info("GPU %d: clocks no longer throttled (%s)", idx,
                     ", ".join(throttle_reasons(self._throttle_bits[idx])[1]))
            self._throttle_bits[idx] = 0
