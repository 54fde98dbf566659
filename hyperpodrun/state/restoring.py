"""The CheckpointManager's restore side: the newest step every rank can get, agreed between the ranks, and
the state put back - kept live, streamed from a replica, or copied from a slot, a peer copy or the disk
(hyperpodrun/state/checkpoint.py).
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping, Optional

from hyperpodrun.errors import ProtocolError, ReplicaLayoutError, SnapshotCorrupt, StateLostError, StateMismatchError
from hyperpodrun.state.restore import replicas
from hyperpodrun.state.restore import wire_auth
from hyperpodrun.state.restore.parallel_layout import mismatch
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots.slot_verify import VerifyAlongside
from hyperpodrun.state.slots.pinned_read import DeviceReadable
from hyperpodrun.state.restore.restore_plan import Inventory, find_snapshots, gather, map_private, plan_restore
from hyperpodrun.state.state_dicts import (device_of, fix_optimizer_dtensors, like, load_state_dict_into,
                                           set_rng_state, state_dict_of)

from hyperpodrun.state.manager_core import _check_state, _file_key, _has_cuda_tensors, log
from hyperpodrun.state.saving import Saving


class Restoring(Saving):
    """restore() and what it loads."""

    # ------------------------------------------------------------------ restore
    def _groups(self, state: Mapping[str, Any], world: int) -> list[list[int]]:
        if self.replica_groups is not None:
            return replicas.validate_groups(self.replica_groups, world)
        if self.num_instances is not None:
            return self.layout.groups(world)
        return replicas.derived_groups(state, world) or [[r] for r in range(world)]

    def restore(self, state: Mapping[str, Any]) -> Optional[int]:
        """Load the newest step every rank can get into `state`; returns it, or None on a fresh start.

        A rank gets a step from its own shared memory, else from a replica peer's memory, else from the
        disk fallback (hyperpodrun/state/restore/restore_plan.py). Raises StateLostError (exit code 75) when some
        rank's state survives nowhere.
        """
        import torch.distributed as dist
        _check_state(state, "restore")
        self._writer.wait()      # not the durable tier's write: it reads its own copy, and may take minutes
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
        not_live = self._live.why_not if self._live is not None and live is None else ""
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
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
            int(os.environ.get("WORLD_SIZE", 1))
        copies = self._peers.held() if self._peers is not None else {}
        # the durable tier's complete checkpoints; the newest verified for this rank (fetched) when it holds
        # nothing in memory - a job lost whole and started again, a rank whose node is gone
        bare = not shm and live_step is None
        disk = dict.fromkeys(self._durable.steps(self.rank, world, verify=bare), "") \
            if self._durable is not None else {}
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
        location = ""
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
            if source == "disk" and self._durable is not None:
                try:   # rebuilt from the checkpoint's objects, every range and the slot checksum checked
                    data = self._durable.fetch(step, self.rank, world)
                except Exception as exc:
                    raise StateLostError(f"rank {self.rank}: the durable checkpoint {self._durable.where(step)} "
                                         f"cannot be read ({exc})") from exc
                location = self._durable.where(step)
            path = shm[step] if data is None else ""
            own = self._files.get(path) if data is None and trusted.get(path) == step else None
            # our own slot or fallback file was checked by find_snapshots just now (unless unverified); a slot
            # this process sealed is read through the mapping its saves write (registered with CUDA: DMA)
            # a durable checkpoint's snapshot was verified as it was rebuilt (DurableTier.fetch)
            verified = (data is None and path not in unverified) or bool(location)
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
                                          step=step, lost_steps=plan.lost_steps, source=plan.source,
                                          location=location))
        elif location and self.rank == 0:   # no agent to say it: the console line is the worker's own
            log.warning("resuming at step %d from the durable checkpoint %s", step, location)
        handed = self.restored_from == "live" and self._live is not None and self._live.handed_over
        log.info("restored step %d (%d step(s) to train again); this rank's state: %s; %s", step, plan.lost_steps,
                 ("the previous generation's tensors, unchanged since that save (no host copy)" if handed else
                  "its own objects, unchanged since that save") if self.restored_from == "live" else
                 f"copied from {self.restored_from}" + {"live": " (live tensors)", "slot": " (slot bytes)"}.get(
                     self.restored_via or "", "") + (f" (not kept live: {not_live})" if not_live and
                                                      self.restored_from != "live" else ""),
                 ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
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
        self._load(payload, state, same_layout=False)
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

    def _load(self, payload: Mapping[str, Any], state: Mapping[str, Any], non_blocking: bool = False,
              same_layout: bool = True) -> None:
        """Put a decoded snapshot into `state`; non_blocking: its tensors are views of a pinned mapping, device
        copies are queued (the mapping's close() waits for them). same_layout: refuse (ReplicaLayoutError) a
        snapshot taken under another parallel layout (parallel_layout.py) - off only where the world size
        changed on purpose (_restore_resized, which restores only state every rank holds whole)."""
        import torch
        refusal = mismatch(payload.get("layout"), self.layout.fingerprint(self._world())) if same_layout else None
        if refusal is not None:
            raise ReplicaLayoutError(f"rank {self.rank}: {refusal}")
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

    @staticmethod
    def _snapshot_of_live(live: Mapping[str, Any]) -> dict:
        """A LiveState payload (entries (kind, value, tensors only)) as a snapshot payload (kind, value)."""
        return {**live, "state": {name: (kind, saved) for name, (kind, saved, _only) in live["state"].items()}}
