"""CheckpointManager: per-step state snapshots that survive the process, restored at the committed step.

    cm = CheckpointManager()

    @HPWrapper(checkpoint_manager=cm)
    def main(caller=None):
        dist.init_process_group(...)
        model, opt = build()                     # DDP / FSDP2 wrapping before restore()
        state = {"model": model, "opt": opt}
        start = cm.restore(state) or 0          # None on a fresh start
        for step in range(start, steps):
            caller.progress(step)
            train_step(batch(step))              # data indexed by step
            cm.save(step + 1, state)             # after optimizer/scheduler/scaler steps

`step` counts completed optimizer steps (= the index of the next batch). `save` copies the state dicts
and the RNG states (python, numpy, torch CPU/CUDA) into one of two slot files in host shared memory
(double buffer: the previous step stays valid while the next is written; a slot counts only once it is
completely written, so the state survives the death of the process at any instant). `restore` agrees
with every rank on the newest step all of them can get - from their own memory, from a replica peer's
memory, or from the disk fallback - loads it (DTensor shards, ZeRO shards, DDP's bucket layout
included) and sets the RNG before any data iterator draws seeds. If some rank's state survives nowhere,
`StateLostError` ends the job with exit code 75 - never a silent restart from step 0.

Files (shm_runs.py): `<shm>/hyperpodrun-<uid>/<run id>.<owner pid>/rank<r>/slot{0,1}`, directories 0700
and files 0600 created with safe_fs (a directory another user created first fails the job with
UnsafePathError; nothing is read from it). Every slot carries a checksum; its metadata is in the
safe_codec encoding (reading a slot runs no code). `close(success=True)` removes this rank's slots (the
last process of the run removes the run directory); stale runs (owner gone) are removed at start.
"""
from __future__ import annotations

import atexit
import logging
import operator
import weakref
import os
import shutil
import threading
import time
from typing import Any, Mapping, Optional, Sequence, Union

from hyperpodrun import env as E
from hyperpodrun.launch import settings
from hyperpodrun.errors import (ApiTypeError, ApiValueError, ProtocolError, SnapshotCorrupt, StateLostError,
                                StateMismatchError, UnsupportedStateError)
from hyperpodrun.state.restore import replicas
from hyperpodrun.state.slots import shm_runs
from hyperpodrun.state.restore import wire_auth
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots import snapshot_copy as copying
from hyperpodrun.state.ddp_layout import LayoutKeeper
from hyperpodrun.state.restore.peer_copy import PeerCopies, peer_of
from hyperpodrun.state.slots.slot_verify import VerifyAlongside
from hyperpodrun.state.slots.pinned_read import DeviceReadable
from hyperpodrun.state.restore.restore_plan import Inventory, find_snapshots, gather, map_private, plan_restore
from hyperpodrun.state.live_state import LiveState
from hyperpodrun.state.snapshot_budget import MAX_INTERVAL, OverheadBudget
from hyperpodrun.state.state_dicts import (device_of, fix_optimizer_dtensors, like, load_state_dict_into, local_ptr,
                                             rng_state, saved_where, set_rng_state, state_dict_of, tensors_in)
from hyperpodrun.safe_fs import private_dir

log = logging.getLogger("hyperpodrun.runtime")


def _check_state(state: Any, call: str) -> None:
    if not isinstance(state, Mapping):
        raise ApiTypeError(f"CheckpointManager.{call}(state=...): state must be a dict of names to objects with "
                           f"state_dict()/load_state_dict() (model, optimizer, ...) or values, not "
                           f"{type(state).__name__}")


class CheckpointManager:
    """Snapshots of each rank's training state in memory that outlives the process.

    enable_checksum: accepted for compatibility; every slot carries a checksum (CRC32) and a slot that does
        not match is never restored, whatever this says.
    enable_offload: None (default): True for a state on a GPU, False for a host state. True: the copy is
        taken off the training step - `save` returns at once, the copy runs while the next forward/backward
        runs (GPU tensors by DMA on a side CUDA stream), and the next optimizer step waits for it (only for
        the device-to-device staging copy when staged). False: `save` returns once the state is captured -
        for a host state once the slot is complete; for a GPU state once it is in the device staging buffers
        (or the slot, without staging): the device->host copy, longer than a step for a large state, never
        holds up the step either way. A fault before a copy completes falls back to the snapshot before it.
    stage_on_device: None (default): on for a GPU state when the device has room for a copy of it (decided
        at the first snapshot: what is free to the driver and to torch's caching allocator, minus a tenth of
        the device, must hold the state). The deferred GPU tensors are copied first into buffers on their own
        GPU (device-to-device, ~2 TB/s) and from there to the host slot, one piece at a time behind the
        training: the next optimizer step waits only for the first copy. Costs device memory equal to the
        parameters and optimizer state (the buffers are kept between saves). True: always (a GPU state);
        False: never.
    max_overhead: for a GPU state (whose snapshots are copied behind the training), the share of the step
        time that snapshots may cost (default 0.02). Every save() call certifies the live state (a value
        fingerprint, on the device: an exception or a peer's death retrains nothing), but the copy that
        survives the process's death is taken only every `snapshot_interval` calls, the interval following
        from this budget and the costs measured at run time (hyperpodrun/state/snapshot_budget.py); a
        snapshot still in flight is never waited for (the call is coalesced). `retrain_bound` is what a SIGKILL
        of a rank without a live replica can cost, in steps. None: every call is a snapshot (each waits for
        the one before).
    fallback_dir / fallback_every: also write every N-th snapshot to disk, asynchronously and atomically,
        for the case where shared memory is lost too.
    replica_groups / num_distributed_optimizer_instances: ranks that hold identical state (a rank that
        lost its snapshots gets them from a replica peer). Derived from DDP modules when not given.
    peer_copy: with several nodes, also copy every slot to a rank on another node (default: on when the
        job spans several nodes), so that the loss of a node does not lose the state of its ranks.
    shm_dir: where the slots live (a tmpfs; default /dev/shm, or HYPERPODRUN_SHM_DIR).
    reuse_live: a surviving rank whose objects still hold the values of the restored step keeps them as they
        are instead of copying the state back, whatever wraps them (hyperpodrun/state/live_state.py; the
        values are compared by fingerprint, hyperpodrun/state/fingerprint.py says what it can miss).
        False for scripts that permute or flip the signs of their state's elements between saves.
    """

    def __init__(self, enable_checksum: bool = False, enable_offload: Optional[bool] = None,
                 fallback_dir: Optional[str] = None, fallback_every: Optional[int] = None,
                 shm_dir: Optional[str] = None, replica_groups: Optional[Sequence[Sequence[int]]] = None,
                 num_distributed_optimizer_instances: Optional[int] = None,
                 peer_copy: Optional[bool] = None, reuse_live: bool = True, stage_on_device: Optional[bool] = None,
                 max_overhead: Optional[float] = 0.02) -> None:
        if replica_groups is not None and num_distributed_optimizer_instances is not None:
            raise ApiValueError("CheckpointManager: give replica_groups= or num_distributed_optimizer_instances=, "
                                "not both")
        if num_distributed_optimizer_instances is not None and num_distributed_optimizer_instances < 1:
            raise ApiValueError(f"CheckpointManager(num_distributed_optimizer_instances="
                                f"{num_distributed_optimizer_instances}): must be >= 1 (2 or more for redundancy)")
        if fallback_every is not None and fallback_every < 1:
            raise ApiValueError(f"CheckpointManager(fallback_every={fallback_every}): must be >= 1")
        if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                         or not 0 < max_overhead < 1):
            raise ApiValueError(f"CheckpointManager(max_overhead={max_overhead!r}): a share of the step time "
                                "between 0 and 1 (e.g. 0.02), or None to snapshot at every save()")
        if fallback_every is not None and not fallback_dir:
            raise ApiValueError("CheckpointManager(fallback_every=...) needs fallback_dir= (where to write)")
        self.enable_checksum = enable_checksum
        self.enable_offload = enable_offload
        self.fallback_dir = fallback_dir
        self.fallback_every = fallback_every or (1 if fallback_dir else None)
        self.shm_dir = shm_dir or settings.current().shm_dir
        self.replica_groups = [list(g) for g in replica_groups] if replica_groups is not None else None
        self.num_instances = num_distributed_optimizer_instances
        self._session: Any = None
        self._caller: Any = None
        self._fallback: Optional[threading.Thread] = None
        self._writer = io.SlotWriter()
        self._files: dict[str, io.SlotFile] = {}
        self._streams = copying.SideStream()
        self.stage_on_device = stage_on_device
        self._staging: Optional[copying.DeviceStaging] = copying.DeviceStaging() if stage_on_device else None
        self._staging_decided = stage_on_device is not None
        self.max_overhead = max_overhead
        self._budget = OverheadBudget(max_overhead)
        self._on_gpu: Optional[bool] = None           # whether the state has CUDA tensors (first save)
        self._since_snapshot = 0                      # save() calls since the last snapshot began
        self._calibrations = 0                        # save() calls whose fingerprint was timed alone
        # save() calls since the last snapshot was sealed (none yet: the first call is due - until a snapshot is
        # sealed, a SIGKILL sends the rank back to step 0)
        self._since_sealed = MAX_INTERVAL
        #: slot path -> (step, the file's identity and times once sealed), for slots this process sealed
        self._sealed: dict[str, tuple[int, Optional[tuple]]] = {}
        self._slot_steps: dict[str, int] = {}         # slot path -> the step it holds, as far as known
        self._staged_step: Optional[int] = None       # the step the device staging buffers hold, once sealed
        self._hook: Any = None
        self._layouts = LayoutKeeper()
        self.last_saved: Optional[int] = None
        self._first_iteration: Optional[int] = None   # the generation this process first ran the function in
        self._saved_objects: list[weakref.ref] = []     # the state objects of the last save (not kept alive)
        self.peer_copy = peer_copy
        self.reuse_live = reuse_live
        self._live: Optional[LiveState] = None          # the newest save() call, as the objects still hold it
        self._live_generation = 0                       # the generation that save() call was made in
        self._reported: Optional[tuple[int, int]] = None   # the interval and bound last logged
        #: how this rank's last restore() got its state: "live" (its own objects, nothing copied), "shm",
        #: "replica", "peer", "disk", or None (a fresh start)
        self.restored_from: Optional[str] = None
        #: seconds each phase of the last restore() took (find, plan, transfer, open, load; in that order),
        #: also in its log line: where a slow recovery spends its time
        self.restore_phases: dict[str, float] = {}
        self._peers: Optional[PeerCopies] = None
        self._exit_hook = False
        self._inflight: Optional[tuple[io.Staged, dict[str, bool]]] = None   # the snapshot being copied

    # ------------------------------------------------------------------ wiring
    @property
    def caller(self) -> Any:
        """The `caller` (CallWrapper) of the wrapped function's current call, once HPWrapper has attached this
        manager (None before): where this generation sits, and its `progress(step)`."""
        return self._caller

    def attach(self, caller: Any, session: Any) -> None:
        """Wire this manager to the wrapped function's current call; HPWrapper calls it at every (re-)entry,
        before the function runs (`session`: the process's control session, None outside
        --inprocess-restart)."""
        self._caller, self._session = caller, session
        on_abort = getattr(session, "on_abort", None)
        if callable(on_abort):
            on_abort(self._judge_inflight)
        if self._first_iteration is None:
            self._first_iteration = int(getattr(caller, "iteration", 0))
        self._layouts.reset()
        world = int(os.environ.get("WORLD_SIZE", 1))
        peer = peer_of(self.rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if peer is not None and self.peer_copy is not False and session is not None:
            self._ensure_dir()          # the receiver keeps copies under the run directory
            if self._peers is None:
                self._peers = PeerCopies(os.path.dirname(self.slot_dir()), self.rank)
            self._peers.rank = self.rank      # an elastic job renumbers the ranks
            self._peers.serve(caller.store, os.environ.get("MASTER_ADDR", "127.0.0.1"))
            self._peers.connect(caller.store, peer)

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def slot_dir(self) -> str:
        """This process's slot directory on this node (shm_runs.slot_dir)."""
        return shm_runs.slot_dir(int(os.environ.get("LOCAL_RANK", "0")), shm_dir=self.shm_dir)

    def _ensure_dir(self) -> str:
        """Create (or join) the run directory and this rank's slot directory, ours alone (safe_fs); the
        first time in a process, other runs' stale directories are removed. Raises UnsafePathError."""
        d = self.slot_dir()
        shm_runs.open_run(os.path.dirname(os.path.dirname(d)), what="snapshots")
        private_dir(d)
        if not self._exit_hook and not _launched():   # a plain `python train.py`: nothing restarts it
            atexit.register(self.close, True)
            self._exit_hook = True
        return d

    def close(self, success: bool = True) -> None:
        """This rank is done: wait for the snapshot in flight and unmap the slots; with `success` (the job
        completed: HPWrapper calls this once every rank finished) remove this rank's slots, and the run
        directory (peer copies included) when no other process of the run uses it any more."""
        self.wait()
        for slot in self._files.values():
            slot.close()
        self._files.clear()
        self._sealed.clear()
        self._slot_steps.clear()
        if self._staging is not None:
            self._staging.release()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        d = self.slot_dir()
        try:
            if success:
                shutil.rmtree(d, ignore_errors=True)
            run = shm_runs.open_runs().get(os.path.dirname(d))
            if run is not None:
                run.release(remove=lambda _path: success)
        except OSError as exc:
            log.warning("snapshots in %s not removed: %s", d, exc)
        else:
            if success:
                log.info("snapshots of rank %d removed (%s)", self.rank, d)

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
        payload: dict[str, Any] = {"step": step, "rng": rng_state(), "state": {},
                                   "ddp_layouts": self._layouts.collect()}
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
            if self.fallback_dir and self.fallback_every and step % self.fallback_every == 0:
                self._write_fallback(step, path)
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

    def _write_fallback(self, step: int, slot: str) -> None:
        if self._fallback is not None:
            self._fallback.join()   # one write in flight at a time; a slow disk slows saving, never corrupts
        blob = bytes(map_private(slot))   # a private copy: the slot is rewritten two saves later

        def write() -> None:
            d = os.path.join(self.fallback_dir or ".", f"rank{self.rank}")
            try:
                os.makedirs(d, mode=0o700, exist_ok=True)
                io.write_atomic(os.path.join(d, f"step{step:012d}.snap"), blob, durable=True)
                for old in sorted(f for f in os.listdir(d) if f.endswith(".snap"))[:-2]:
                    os.unlink(os.path.join(d, old))
            except OSError as exc:
                log.error("fallback checkpoint of step %d not written: %s", step, exc)
        self._fallback = threading.Thread(target=write, name="hyperpodrun-fallback", daemon=True)
        self._fallback.start()

    # ------------------------------------------------------------------ restore
    def _groups(self, state: Mapping[str, Any], world: int) -> list[list[int]]:
        if self.replica_groups is not None:
            return replicas.validate_groups(self.replica_groups, world)
        if self.num_instances is not None:
            return replicas.instance_groups(world, self.num_instances)
        return replicas.derived_groups(state, world) or [[r] for r in range(world)]

    def restore(self, state: Mapping[str, Any]) -> Optional[int]:
        """Load the newest step every rank can get into `state`; returns it, or None on a fresh start.

        A rank gets a step from its own shared memory, else from a replica peer's memory, else from the
        disk fallback (hyperpodrun/state/restore/restore_plan.py). Raises StateLostError (exit code 75) when some
        rank's state survives nowhere.
        """
        import torch.distributed as dist
        _check_state(state, "restore")
        self.wait()
        self.restored_from = None
        phases = self.restore_phases = {}
        mark = [time.monotonic()]

        def phase(name: str) -> None:     # the time since the previous mark, added to `name`
            now = time.monotonic()
            phases[name] = round(phases.get(name, 0.0) + now - mark[0], 4)
            mark[0] = now
        if getattr(self._caller, "world_size_changed", False):
            return self._restore_resized(state)
        self._budget.restarted()
        # a survivor whose objects still hold the values of its last save() call keeps them (live_state.py)
        live = self._live.payload_for(self._live.step, state) if self._live is not None else None
        live_step = self._live.step if self._live is not None and live is not None else None
        # the slots this process sealed itself, in the 0700 directory it made and holds, not written since
        # (the same inode, size and times as when sealed): their checksum was summed as they were written, and
        # only this uid - which could as well write into this process - can change them; they are read
        # without summing them again
        trusted = {path: step for path, (step, key) in self._sealed.items()
                   if os.path.dirname(path) == self.slot_dir() and key is not None and key == _file_key(path)}
        unverified: set[str] = set()
        deferred: set[str] = set()     # the newest slot not sealed here: summed beside its copy (slot_verify.py)
        shm = find_snapshots(self._ensure_dir(), trusted, unverified, deferred)
        self._slot_steps = {path: found for found, path in shm.items()}
        disk = find_snapshots(os.path.join(self.fallback_dir, f"rank{self.rank}")) if self.fallback_dir else {}
        copies = self._peers.held() if self._peers is not None else {}
        at = getattr(self._session, "step", None)
        mine: Inventory = {"shm": sorted(shm), "disk": sorted(disk), "latest": self.last_saved,
                           "copies": {src: sorted(steps) for src, steps in copies.items()},
                           "never_committed": self._first_iteration == 0 and self.last_saved is None,
                           "live": live_step, "at": at if isinstance(at, int) else None}
        phase("find")
        channel = wire_auth.current(getattr(self._caller, "iteration", None))
        gathered = gather(mine, channel)
        plan = plan_restore(gathered.inventories, lambda world: self._groups(state, world), gathered.refused)
        if plan is not None:
            gathered.check_receivers(plan.pairs)
        phase("plan")
        if plan is None:
            alive = [o for o in (ref() for ref in self._saved_objects) if o is not None]
            kept = [name for name, obj in state.items() if any(o is obj for o in alive)]
            if kept and (shm or self.last_saved is not None):
                raise StateLostError(
                    f"rank {self.rank}: the job starts again from the beginning (a fault came before every rank "
                    f"had completed its first snapshot), but {kept} are the objects this rank already trained "
                    "(built outside the wrapped function) and cannot be rewound; build them inside the function, "
                    "or save(0, state) before the first step")
            return None
        step = plan.step

        def blob_for(receiver: int, kind: str) -> bytes:
            return bytes(map_private(shm[step] if kind == "replica" else copies[receiver][step]))

        def live_for(receiver: int, kind: str) -> Optional[dict]:   # my objects, still at `step` (live_state.py)
            ok = kind == "replica" and live is not None and live_step == step
            return self._snapshot_of_live(live) if ok and live is not None else None
        data: Any = None
        streamed: Optional[dict] = None
        self.restored_via = None
        if plan.pairs and dist.is_available() and dist.is_initialized():
            from hyperpodrun.state.restore import replica_stream
            got = replica_stream.exchange(plan.pairs, self.rank, live_for, blob_for, replica_stream.placement(state),
                                          channel, step)
            if got is not None:
                self.restored_via = got.via
                if got.payload is not None:
                    streamed = got.payload
                else:
                    data = got.blob if isinstance(got.blob, bytearray) else bytearray(got.blob)
                    self._keep(step, got.blob)
        phase("transfer")
        if live is not None and live_step == step:
            self._load_live(live, state)
            self.restored_from = "live"
            if self._live is not None and self._live.handed_over:
                self._live.release()   # the objects hold the values now; the old generation's tensors may go
        elif streamed is not None:
            self._live = None
            if streamed["step"] != step:
                raise StateLostError(f"rank {self.rank}: its replica peer sent step {streamed['step']}, not {step}")
            # the received tensors are this rank's own, on its device: loaded like a decoded snapshot (device
            # copies into same-shaped tensors in place, stream-ordered), then saved as this rank's own slot
            self._load(streamed, state, non_blocking=True)
            streamed = None
            self.restored_from = "replica"
            self._save(step, state, force=True)
        else:
            self._live = None
            source = "replica" if data is not None else ("shm" if step in shm else "disk")
            path = shm.get(step) or disk[step] if data is None else ""
            own = self._files.get(path) if data is None and trusted.get(path) == step else None
            # our own slot or fallback file was checked by find_snapshots just now (unless unverified); a slot
            # this process sealed is read through the mapping its saves write (registered with CUDA: DMA)
            verified = data is None and path not in unverified
            slot = DeviceReadable(path, pin=_has_cuda_tensors(state), mapped=own.mapping if own else None) \
                if data is None else None
            what = f"snapshot of step {step}"
            alone_again = False
            alongside = VerifyAlongside(slot.map, what, step) if slot is not None and path in deferred else None
            try:
                try:
                    _, payload = io.decode(slot.map if slot is not None else data, what,
                                           verify=not verified and alongside is None, copy=False)
                    # "map": the slot was mapped (and registered) for this restore - no mapping of this
                    # process's nor a standby's prepinned one to read through (restore_phases says which)
                    phase("open" if slot is None or slot.mapped_ahead else "map")
                    self._load(payload, state, non_blocking=slot is not None and slot.pinned)   # copies out of it
                    if alongside is not None:
                        alongside.result()
                        phase("checksum")
                except SnapshotCorrupt as exc:
                    if alongside is None:
                        raise StateLostError(f"rank {self.rank}: {exc}; no intact copy of its state at step "
                                             f"{step}") from exc
                    # what was copied out is overwritten by the next restore, which no longer sees the slot: at
                    # once when this rank is alone, else in the next round (its peers planned with this step)
                    self._drop_slot(path)
                    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                        log.error("rank %d: %s; the slot was removed, restoring without it", self.rank, exc)
                        alone_again = True
                    else:
                        raise SnapshotCorrupt(f"rank {self.rank}: {exc}; the slot was removed and the restore is "
                                              "tried again without it") from exc
            finally:
                payload = None
                if alongside is not None:
                    try:
                        alongside.result()
                    except BaseException:
                        pass
                if slot is not None:
                    slot.close()
            if alone_again:
                return self.restore(state)
            self.restored_from = source
        phase("load")
        self._forget_newer(step)
        self.last_saved = step
        if self._session is not None and self.rank == 0:
            from hyperpodrun import protocol as P
            self._session.send(P.Restored(rank=self.rank, pid=os.getpid(), generation=self._caller.iteration,
                                          step=step, lost_steps=plan.lost_steps, source=plan.source))
        handed = self.restored_from == "live" and self._live is not None and self._live.handed_over
        log.info("restored step %d (%d step(s) to train again); this rank's state: %s; %s", step, plan.lost_steps,
                 ("the previous generation's tensors, unchanged since that save (no host copy)" if handed else
                  "its own objects, unchanged since that save") if self.restored_from == "live" else
                 f"copied from {self.restored_from}" + {"live": " (live tensors)", "slot": " (slot bytes)"}.get(
                     self.restored_via or "", ""), ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
        return step

    def _restore_resized(self, state: Mapping[str, Any]) -> Optional[int]:
        """Restore after an elastic job shrank or grew: every rank takes the newest step any rank holds in
        memory - its own, or a replica's. Only state that every rank holds whole (DDP) can be restored at
        another world size; sharded state (FSDP, ZeRO, explicit replica groups) is refused (StateLostError)."""
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        prev = getattr(self._caller, "previous_world_size", None)
        self._live = None
        shm = find_snapshots(self._ensure_dir())
        self._slot_steps = {path: found for found, path in shm.items()}
        channel = wire_auth.current(getattr(self._caller, "iteration", None))
        gathered = gather({"shm": sorted(shm), "disk": [], "latest": self.last_saved, "copies": {},
                           "never_committed": False, "live": None, "at": None}, channel)
        everyone = gathered.inventories
        steps = set().union(*(set(e["shm"]) for e in everyone))
        if not steps:
            if gathered.refused:
                raise ProtocolError(f"the restore inventories of rank(s) {sorted(gathered.refused)} were refused and "
                                    "no other rank holds a snapshot; tried again next round")
            return None
        groups = replicas.derived_groups(state, world) if world > 1 else [[0]]
        if self.replica_groups is not None or self.num_instances is not None or groups is None or \
                sorted(groups[0]) != list(range(world)):
            raise StateLostError(
                f"rank {self.rank}: the job's world size changed from {prev} to {world} (an elastic job shrank or "
                "grew), and CheckpointManager restores at another world size only state that every rank holds "
                "whole (DDP over all ranks); this state is sharded or has explicit replica groups. Run the job at "
                "a fixed size (--nnodes N), or re-shard it yourself when caller.world_size_changed (e.g. with "
                "torch.distributed.checkpoint)")
        step = max(steps)
        holds = [set(e["shm"]) for e in everyone]
        pairs = replicas.plan_transfers([list(range(world))], holds, step)
        gathered.check_receivers(pairs)
        data: Any = None
        if pairs:
            received = replicas.transfer(pairs, self.rank, lambda receiver, kind: bytes(map_private(shm[step])),
                                         channel, step)
            if received is not None:
                data = bytearray(received)
        if data is None:
            data = map_private(shm[step])
        try:
            _, payload = io.decode(data, f"snapshot of step {step}", verify=pairs != [] and step not in shm,
                                   copy=False)
        except SnapshotCorrupt as exc:
            raise StateLostError(f"rank {self.rank}: {exc}; no intact copy of the state at step {step}") from exc
        self._load(payload, state)
        for other in [s for s in shm if s != step]:   # the old world's snapshots must not be restored later
            self._drop_slot(shm[other])
        self.last_saved = None
        self._save(step, state, force=True)   # this rank's snapshot at the new world size (its own slot again)
        self.wait()
        latest = max((e["latest"] for e in everyone if e["latest"] is not None), default=step)
        if self._session is not None and self.rank == 0:
            from hyperpodrun import protocol as P
            self._session.send(P.Restored(rank=self.rank, pid=os.getpid(), generation=self._caller.iteration,
                                          step=step, lost_steps=max(0, latest - step), source="resized"))
        self.restored_from = "resized"
        log.info("restored step %d at world size %d (was %s)", step, world, prev)
        return step

    def _next_slot(self) -> str:
        """The slot the next snapshot goes to: the one not holding the newest snapshot known (with snapshots
        every k steps, alternating by the step's parity would overwrite the newest one when k is even)."""
        return min(self._slot_paths(), key=lambda p: self._slot_steps.get(p, -1))

    def _forget_newer(self, step: int) -> None:
        """Drop this rank's slots holding a step newer than the one the job restored: that history was abandoned.
        Kept, the next snapshot would overwrite the restored step's slot instead (_next_slot takes the lowest),
        and a later restore could plan with a step of the old history that the other ranks never had."""
        for path, held in list(self._slot_steps.items()):
            if held > step:
                log.debug("rank %d: dropping %s (step %d, past the restored step %d)", self.rank, path, held, step)
                self._drop_slot(path)

    def _slot_paths(self) -> list[str]:
        d = self._ensure_dir()
        return [os.path.join(d, "slot0"), os.path.join(d, "slot1")]

    def _drop_slot(self, path: str) -> None:
        self._sealed.pop(path, None)
        self._slot_steps.pop(path, None)
        stale = self._files.pop(path, None)
        if stale is not None:
            stale.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _keep(self, step: int, blob: Union[bytes, bytearray]) -> None:
        """Store a snapshot received from a peer as this rank's own slot, so it is held in memory again."""
        path = self._next_slot()
        self._sealed.pop(path, None)
        stale = self._files.pop(path, None)
        if stale is not None:
            stale.close()
        io.write_atomic(path, blob)
        self._slot_steps[path] = step

    def _load(self, payload: Mapping[str, Any], state: Mapping[str, Any], non_blocking: bool = False) -> None:
        """Put a decoded snapshot into `state`; non_blocking: its tensors are views of a pinned mapping, device
        copies are queued (the mapping's close() waits for them)."""
        import torch
        for name, obj in state.items():
            if name not in payload["state"]:
                raise StateMismatchError(f"snapshot has no entry {name!r}; the state dict given to save() and "
                                         "restore() must have the same keys")
            kind, saved = payload["state"][name]
            if kind == "sd":
                load_state_dict_into(obj, like(saved, state_dict_of(obj), device_of(obj), non_blocking))
                if isinstance(obj, torch.optim.Optimizer):
                    fix_optimizer_dtensors(obj)
            elif isinstance(state, dict):
                state[name] = like(saved, None)
        if payload.get("ddp_layouts"):
            self._layouts.restore(payload["ddp_layouts"])
        set_rng_state(payload["rng"])
        if self._budget.seed(payload.get("cadence")):
            # the restored step is in a slot already: the next snapshot is due after the predecessor's interval,
            # not at this process's first save() (which would map a slot inside the first step after recovery)
            self._since_snapshot = self._since_sealed = 0

    def _load_live(self, payload: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Put back what a save kept outside the tensors (hyper-parameters, values, RNG). The tensors hold the
        values of that save: a module that holds exactly them is left as it is; an object built again gets them
        from the previous generation's tensors (an optimizer's state handed over, parameters copied on their
        device)."""
        import torch
        for name, obj in state.items():
            kind, saved, keep = payload["state"][name]
            if kind == "sd":
                if not (keep and isinstance(obj, torch.nn.Module)):
                    load_state_dict_into(obj, saved)
                    if isinstance(obj, torch.optim.Optimizer):
                        fix_optimizer_dtensors(obj)
            elif isinstance(state, dict):
                state[name] = saved
        if payload.get("ddp_layouts"):
            self._layouts.restore(payload["ddp_layouts"])
        set_rng_state(payload["rng"])

    def wait(self) -> None:
        """Block until the snapshot in flight and the fallback write have finished."""
        self._writer.wait()
        if self._fallback is not None:
            self._fallback.join()

    #: how a restore() that copied this rank's state from a replica peer (restored_from == "replica") got it:
    #: "live" - the peer's own tensors, still at that step, sent over the process group (GPU to GPU on NCCL;
    #: hyperpodrun/state/restore/replica_stream.py) - or "slot" - the bytes of the peer's snapshot slot (a peer whose
    #: objects moved on or were built again, reuse_live=False, a copy held on another node); None otherwise
    restored_via: Optional[str] = None

    @staticmethod
    def _snapshot_of_live(live: Mapping[str, Any]) -> dict:
        """A LiveState payload (entries (kind, value, tensors only)) as a snapshot payload (kind, value)."""
        return {**live, "state": {name: (kind, saved) for name, (kind, saved, _only) in live["state"].items()}}


def _has_cuda_tensors(state: Mapping[str, Any]) -> bool:
    """Whether restoring `state` copies onto a GPU (then its slot is pinned for the copy)."""
    import torch
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            tensors: Any = obj.parameters()
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = (p for g in obj.param_groups for p in g["params"])
        else:
            tensors = tensors_in(obj)
        for t in tensors:
            return bool(getattr(t, "is_cuda", False))
    return False


def _file_key(path: str) -> Optional[tuple]:
    """A file's identity and times (inode, size, modification and change times): any write through the file
    system after this was taken changes it."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


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


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def _launched() -> bool:
    """Whether a launcher (hyperpodrun, torchrun) started this process, and may start it again."""
    return E.worker_context().launched


__all__ = ["CheckpointManager", "StateLostError", "SnapshotCorrupt", "UnsupportedStateError"]
