"""The CheckpointManager's core (hyperpodrun/state/checkpoint.py): its configuration and state, its wiring to
the wrapped function's call, its slot files and directory.

Why apart from saving (saving.py) and restoring (restoring.py): each side is read on its own, and both build
on what is here; CheckpointManager (checkpoint.py) is the three together.
"""
from __future__ import annotations

import atexit
import logging
import weakref
import os
import shutil
from typing import Any, Mapping, Optional, Sequence, Union

from hyperpodrun import env as E
from hyperpodrun.launch import settings
from hyperpodrun.errors import ApiTypeError, ApiValueError
from hyperpodrun.state.slots import shm_runs
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots import snapshot_copy as copying
from hyperpodrun.state.ddp_layout import LayoutKeeper
from hyperpodrun.state.durable.stores import open_store
from hyperpodrun.state.durable.tier import DurableTier
from hyperpodrun.state.restore.peer_copy import PeerCopies, peer_of
from hyperpodrun.state.restore.parallel_layout import DEFAULT_ORDER, ParallelLayout
from hyperpodrun.state.live_state import LiveState
from hyperpodrun.state.snapshot_budget import MAX_INTERVAL, OverheadBudget
from hyperpodrun.state.state_dicts import tensors_in
from hyperpodrun.safe_fs import private_dir

log = logging.getLogger("hyperpodrun.runtime")


def _check_state(state: Any, call: str) -> None:
    if not isinstance(state, Mapping):
        raise ApiTypeError(f"CheckpointManager.{call}(state=...): state must be a dict of names to objects with "
                           f"state_dict()/load_state_dict() (model, optimizer, ...) or values, not "
                           f"{type(state).__name__}")

class ManagerCore:
    """Configuration, wiring and slot files of a CheckpointManager (see CheckpointManager for the arguments)."""

    def __init__(self, enable_checksum: bool = False, enable_offload: Optional[bool] = None,
                 fallback_dir: Optional[str] = None, fallback_every: Optional[int] = None,
                 shm_dir: Optional[str] = None, replica_groups: Optional[Sequence[Sequence[int]]] = None,
                 num_distributed_optimizer_instances: Optional[int] = None,
                 peer_copy: Optional[bool] = None, reuse_live: bool = True, stage_on_device: Optional[bool] = None,
                 max_overhead: Optional[float] = 0.02, fallback_keep: int = 2,
                 tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 context_parallel_size: int = 1, rank_order: str = DEFAULT_ORDER) -> None:
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
        if isinstance(fallback_keep, bool) or not isinstance(fallback_keep, int) or fallback_keep < 1:
            raise ApiValueError(f"CheckpointManager(fallback_keep={fallback_keep!r}): the number of complete "
                                "fallback checkpoints to keep, an int >= 1")
        #: the durable tier (hyperpodrun/state/durable): checked now, so a store that cannot work ends the job
        #: before its first step
        self._durable: Optional[DurableTier] = DurableTier(open_store(fallback_dir), fallback_keep) \
            if fallback_dir else None
        self.enable_checksum = enable_checksum
        self.enable_offload = enable_offload
        self.fallback_dir = fallback_dir
        self.fallback_every = fallback_every or (1 if fallback_dir else None)
        self.shm_dir = shm_dir or settings.current().shm_dir
        self.replica_groups = [list(g) for g in replica_groups] if replica_groups is not None else None
        self.num_instances = num_distributed_optimizer_instances
        #: the parallel layout: the replica map of `num_distributed_optimizer_instances` and the fingerprint every
        #: snapshot carries (a restore under another layout is refused)
        self.layout = ParallelLayout(num_distributed_optimizer_instances, tensor_model_parallel_size,
                                     pipeline_model_parallel_size, context_parallel_size, rank_order)
        self._layout_checked: Optional[int] = None     # the world size the layout was last checked at
        # launched with a parallel layout: refuse one that cannot work before step 0 (the first save checks it
        # anyway). The default layout reads nothing here: a standby runs a script that builds its
        # CheckpointManager at the top ahead of its rank only while the top reads no rank variable (--standby-prerun)
        laid_out = (num_distributed_optimizer_instances or 1) > 1 or max(
            tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size) > 1
        if laid_out and os.environ.get("WORLD_SIZE", "").isdigit():
            self._check_layout(int(os.environ["WORLD_SIZE"]))
        self._session: Any = None
        self._caller: Any = None
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

    def _check_layout(self, world: int) -> None:
        """Refuse (ReplicaLayoutError) a layout that does not fit `world` ranks, or that puts both copies of a
        shard on one node (a node: LOCAL_WORLD_SIZE consecutive ranks, as hyperpodrun and torchrun number them)."""
        if self._layout_checked == world:
            return
        if self.num_instances is not None or self.layout.tp * self.layout.pp * self.layout.cp > 1:
            self.layout.data_parallel(world)
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if self.num_instances is not None and local.isdigit():
            self.layout.check_placement(world, int(local))
        self._layout_checked = world

    def use_layout(self, layout: ParallelLayout) -> None:
        """Take a training strategy's parallel layout (CheckpointlessMegatronStrategy calls this before the
        restore at fit start): its replica map (with 2 or more instances) and its fingerprint from now on.
        A layout given to this manager explicitly that differs is refused (ApiValueError), as are replica_groups
        beside a strategy's instances."""
        explicit = self.num_instances is not None or self.layout != ParallelLayout()
        if explicit and layout != self.layout:
            raise ApiValueError(f"CheckpointManager was given the layout {self.layout.fingerprint(self._world())} "
                                f"but the strategy trains with {layout.fingerprint(self._world())}; give it once")
        if self.replica_groups is not None and (layout.instances or 1) > 1:
            raise ApiValueError("CheckpointManager(replica_groups=...) and the strategy's "
                                "num_distributed_optimizer_instances both say where the replicas are; give one")
        self.layout = layout
        if (layout.instances or 1) > 1:
            self.num_instances = layout.instances
        self._layout_checked = None

    def _world(self) -> int:
        """The job's world size now (the process group's, once there is one)."""
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", 1))

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

    def _judge_inflight(self) -> None:
        """Called when an abort begins, before it touches a communicator: the save side (saving.py) judges the
        snapshot it has in flight."""

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def slot_dir(self) -> str:
        """This process's slot directory on this node (shm_runs.slot_dir)."""
        return shm_runs.slot_dir(E.real_local_rank(), shm_dir=self.shm_dir)

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

    def wait(self) -> None:
        """Block until the snapshot in flight and the fallback checkpoint being written have finished."""
        self._writer.wait()
        if self._durable is not None:
            self._durable.wait()

    def _send_durable_notes(self) -> None:
        """Tell the agent what the durable tier did since the last call (from the training thread: the control
        connection is not shared with the writer thread)."""
        if self._durable is None:
            return
        notes = self._durable.notes()
        if notes and self._session is not None:
            from hyperpodrun import protocol as P
            for outcome, step, detail in notes:
                self._session.send(P.Checkpointed(rank=self.rank, pid=os.getpid(), step=step, outcome=outcome,
                                                  detail=detail[:500]))

    #: how a restore() that copied this rank's state from a replica peer (restored_from == "replica") got it:
    #: "live" - the peer's own tensors, still at that step, sent over the process group (GPU to GPU on NCCL;
    #: hyperpodrun/state/restore/replica_stream.py) - or "slot" - the bytes of the peer's snapshot slot (a peer whose
    #: objects moved on or were built again, reuse_live=False, a copy held on another node); None otherwise
    restored_via: Optional[str] = None


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


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def _launched() -> bool:
    """Whether a launcher (hyperpodrun, torchrun) started this process, and may start it again."""
    return E.worker_context().launched
