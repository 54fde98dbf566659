"""The CheckpointManager's save side: certifying the live state at every save() call, and the snapshots
copied into a slot behind the training within the overhead budget (hyperpodrun/state/checkpoint.py).
"""
from __future__ import annotations

import operator
import weakref
import os
import time
from typing import Any, Mapping

from hyperpodrun.errors import ApiValueError, UnsupportedStateError
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots import snapshot_copy as copying
from hyperpodrun.state.live_state import LiveState
from hyperpodrun.state.state_dicts import local_ptr, rng_state, saved_where, state_dict_of, tensors_in

from hyperpodrun.state.manager_core import ManagerCore, _check_state, _file_key, _has_cuda_tensors, _weakrefable, log


class Saving(ManagerCore):
    """save() and the snapshots it takes."""

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot `state` as the state after `step` completed optimizer steps.

        A restart request that arrives meanwhile lands once the snapshot is taken (never half-way).
        """
        _check_state(state, "save")
        try:
            step = operator.index(step) if not isinstance(step, bool) else -1   # ints, numpy ints, 0-d tensors
        except TypeError:
            step = -1 if not isinstance(step, str) else step
        if not isinstance(step, int) or step < 0:
            raise ApiValueError(f"CheckpointManager.save(step={step!r}): step must be the number of completed "
                                "optimizer steps, an int >= 0 (call save(step + 1, state) after optimizer.step())")
        self._send_durable_notes()
        interrupter = getattr(self._session, "interrupter", None)
        if interrupter is None:
            self._save(step, state)
            return
        with interrupter.critical():
            self._save(step, state)

    @property
    def snapshot_interval(self) -> int:
        """Every how many save() calls a GPU state is snapshotted, as the overhead budget sets it now (1 for a
        host state, or with max_overhead=None)."""
        return self._budget.interval if self._budgeted else 1

    @property
    def retrain_bound(self) -> int:
        """The most steps a SIGKILL of a rank whose state has no live replica retrains, as measured so far: the
        snapshot interval plus twice the save() calls a snapshot was seen in flight (see snapshot_budget)."""
        return self._budget.retrain_bound if self._budgeted else 1

    @property
    def _budgeted(self) -> bool:
        return bool(self._on_gpu) and self.max_overhead is not None and self._offloaded

    @property
    def _offloaded(self) -> bool:
        """Whether snapshots are copied behind the training (see enable_offload)."""
        return bool(self._on_gpu) if self.enable_offload is None else (self.enable_offload or bool(self._on_gpu))

    def _save(self, step: int, state: Mapping[str, Any], force: bool = False) -> None:
        import torch
        began = self._budget.call_started()
        if self._on_gpu is None:
            self._on_gpu = _has_cuda_tensors(state)
        world = self._world()
        self._check_layout(world)
        payload: dict[str, Any] = {"step": step, "rng": rng_state(), "state": {},
                                   "ddp_layouts": self._layouts.collect(), "layout": self.layout.fingerprint(world)}
        self._saved_objects = [weakref.ref(o) for o in state.values() if _weakrefable(o)]
        for name, obj in state.items():
            if hasattr(obj, "state_dict") and callable(obj.state_dict):
                payload["state"][name] = ("sd", state_dict_of(obj))
            else:
                payload["state"][name] = ("value", obj)
        if self.reuse_live:
            # certified at every call: values fingerprinted behind the training, on the device
            calibrating = bool(self._on_gpu) and self._budgeted and self._calibrations < 2
            self._live = LiveState(step, payload, self._streams if self._on_gpu else None, timed=calibrating)
            self._live_generation = getattr(self._caller, "iteration", 0)
            if self._on_gpu:
                self._install_step_barrier()
                if calibrating:
                    self._calibrate(self._live)
        busy = self._writer.busy()
        # the interval counts from the previous snapshot's seal, not its start: `interval` steps with no snapshot
        # in flight follow each one, so its cost never takes every step and the step without one stays measured
        # (counted from the start, a snapshot in flight for longer than the interval kept every step busy)
        self._since_sealed += 1
        if not force and self._budgeted and (busy or self._since_sealed < self._budget.interval):
            self._since_snapshot += 1                # coalesced (in flight) or not due: certified only
            self._budget.certified(time.perf_counter() - began)
            self._budget.call_ended(busy)
            return
        self._since_snapshot = 0
        self._snapshot(step, state, payload)
        self._budget.call_ended(self._writer.busy())

    def _calibrate(self, live: LiveState) -> None:
        """What certifying a save() costs the device: its fingerprint timed alone, at this process's first two
        calls (the host waits for it: nothing else is queued behind it then). Why not at every call: beside
        the next step's kernels its time stretches (9-16 ms seen for 6.4 GB on an H200) while what it adds to
        the step is about its time alone (~1.3 ms there)."""
        self._calibrations += 1
        for event in live.print.events.values():
            event.synchronize()
        took = live.print.device_seconds()
        if took is not None:
            self._budget.certify_measured(took)

    def _snapshot(self, step: int, state: Mapping[str, Any], payload: dict) -> None:
        """Copy `payload` into a slot (see save)."""
        import torch
        self._writer.wait()                         # one snapshot in flight at a time
        stable: set[int] = set()
        for name, obj in state.items():
            kind, sd = payload["state"][name]
            if kind != "sd":
                continue
            if isinstance(obj, torch.optim.Optimizer):        # changed only by the optimizer step
                stable.update(local_ptr(t) for t in tensors_in(sd))
            elif isinstance(obj, torch.nn.Module):
                stable.update(local_ptr(p) for p in obj.parameters())
        offload = self._offloaded
        if self._budgeted:
            payload["cadence"] = self._budget.export()   # a replacement starts from these (OverheadBudget.seed)
        try:
            staged = io.plan(step, payload, stable, offload)
        except UnsupportedStateError as exc:
            raise saved_where(exc, payload) from None
        on_device = any(getattr(src, "is_cuda", False) for src, _ref, _deferred in staged.tensors)
        if offload and not self._staging_decided:
            self._staging_decided = True
            if _room_for_staging(staged):
                self._staging = copying.DeviceStaging()
        path = self._next_slot()
        self._sealed.pop(path, None)                # rewritten from here on
        self._slot_steps.pop(path, None)
        self._staged_step = None                    # the staging buffers are about to be overwritten
        slot = self._files.setdefault(path, io.SlotFile(path))
        t_prepare = time.perf_counter()
        view = slot.prepare(staged, pin=torch.cuda.is_available() and torch.cuda.is_initialized())
        # mapping and registering a slot (0.3-0.6 s for 6.4 GB) is once per slot and process, not a snapshot's
        # cost: left out of what the budget counts (else the interval starts at its cap)
        if slot.mapped_now and offload:     # the other slot too, now rather than inside a later step
            other = next(p for p in self._slot_paths() if p != path)
            self._files.setdefault(other, io.SlotFile(other)).reserve(len(view), pin=slot.pinned)
        setup_s = time.perf_counter() - t_prepare if slot.mapped_now else 0.0
        if self._budgeted:
            self._budget.snapshot_began(counted=not setup_s)
        copying.copy_now(view, staged, self._streams, self._staging if offload else None)

        session = self._session
        generation = getattr(self._caller, "iteration", 0)
        verdict: dict[str, bool] = {}      # "final": what the copies read was complete when an abort began
        self._inflight = (staged, verdict)
        if getattr(session, "restart_seen", -1) > generation:
            # a save made after the restart was requested (it lands once the save is done): host tensors
            # are final - a failed collective raises before a save - but device ones may hold work an abort cut
            verdict["final"] = not on_device

        def no_restart_since() -> bool:
            # a restart since this save drops it unless its data was final before the first abort: then the
            # copy holds the committed state whatever the abort does to the work queued after it (a survivor
            # and a raising rank keep the step they completed: nothing lost, nothing copied back)
            return getattr(session, "restart_seen", -1) <= generation or verdict.get("final", False)

        def copied() -> bool:
            if copying.finish_copies(view, staged, no_restart_since):
                return True
            log.info("snapshot of step %d dropped: a restart was requested before it was complete", step)
            self._inflight = None
            return False
        staging_used = bool(staged.staged_events)
        if offload and self.enable_offload is False and staging_used:
            for event in staged.staged_events.values():   # enable_offload=False: return once captured
                event.synchronize()

        def sealed() -> None:
            self._inflight = None
            self._since_sealed = 0
            io.seal(view, staged)
            self.last_saved = step
            self._sealed[path] = (step, _file_key(path))
            self._slot_steps[path] = step
            if staging_used:
                self._staged_step = step
            if self._budgeted:
                self._budget.in_flight(self._since_snapshot)
                self._report_interval()
            if self._peers is not None:
                self._peers.send(step, path)
            if self._durable is not None and self.fallback_every and step % self.fallback_every == 0:
                # behind the training; skipped (never waited for) while the previous one is still written
                self._durable.submit(step, path, self.rank, int(os.environ.get("WORLD_SIZE", 1)))
        if offload:
            self._install_step_barrier()
            self._writer.start(copied, sealed)
        elif copied():
            sealed()

    def _report_interval(self) -> None:
        interval, bound = self._budget.interval, self._budget.retrain_bound
        if (interval, bound) != self._reported:
            self._reported = (interval, bound)
            log.info("rank %d: snapshots every %d step(s) (a snapshot costs %.1f ms, a step %.1f ms, budget %.1f %%); "
                     "every save() certifies the live state; a SIGKILL without a live replica retrains at most %d "
                     "step(s)", self.rank, interval, 1e3 * (self._budget.snapshot_s or 0),
                     1e3 * (self._budget.step_s or 0), 100 * (self.max_overhead or 0), bound)

    def _judge_inflight(self) -> None:
        """Called when an abort begins (before it touches a communicator): whether the snapshot still being
        copied read finished data. Judged once per snapshot: the first abort decides."""
        inflight = self._inflight
        if inflight is not None and "final" not in inflight[1]:
            inflight[1]["final"] = copying.data_final(inflight[0])
        live = self._live
        if live is not None and self._live_generation >= getattr(self._caller, "iteration", 0) \
                and not live.final():
            self._live = None      # its values were still being computed: whatever the abort left is no step
        elif live is not None and not live.release_if_short():
            log.info("rank %d: the saved tensors are let go (no room beside objects built again); only objects "
                     "that still hold them keep their state", self.rank)

    def _install_step_barrier(self) -> None:
        """The optimizer step changes what an offloaded snapshot copies: it waits for the copy first (not for
        the checksum, which reads the slot and may overlap the step)."""
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self._hook = register_optimizer_step_pre_hook(lambda *_a: self._before_optimizer_step())

    def _before_optimizer_step(self) -> None:
        """Without staging: wait until the copy in flight is done. With it: wait for the host tensors' copy
        only, and make the device's compute stream wait (on the device, the host runs on) for the staging
        copies; the device->host copy goes on behind the step."""
        import torch
        live = self._live
        if live is not None:        # the fingerprint reads the values first (on the device, the host runs on)
            for device in list(live.print.events):
                live.wait_on(device)
        inflight = self._inflight
        if self._staging is None or inflight is None or not inflight[0].staged_events:
            self._writer.wait_copied()
            return
        staged = inflight[0]
        staged.host_copied.wait()
        for device, event in list(staged.staged_events.items()):
            torch.cuda.current_stream(device).wait_event(event)


def _room_for_staging(staged: io.Staged) -> bool:
    """Whether every device holding deferred tensors of `staged` has room for a copy of them: free to the
    driver plus cached but unused by torch, less a tenth of the device for the training's own peaks."""
    need: dict[Any, int] = {}
    for src, ref, deferred in staged.tensors:
        if deferred and getattr(src, "is_cuda", False):
            need[src.device] = need.get(src.device, 0) + ref.nbytes
    if not need:
        return False
    for device, nbytes in need.items():
        room = copying.free_bytes(device)
        if room < nbytes:
            log.info("no device staging on %s: %.1f GiB of state, %.1f GiB free", device, nbytes / 2**30,
                     room / 2**30)
            return False
    log.info("snapshots staged on the device (%.1f GiB of device buffers)", sum(need.values()) / 2**30)
    return True
