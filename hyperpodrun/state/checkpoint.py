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

from hyperpodrun.errors import SnapshotCorrupt, StateLostError, UnsupportedStateError
from hyperpodrun.state.restoring import Restoring


class CheckpointManager(Restoring):
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
    fallback_dir / fallback_every / fallback_keep: the durable tier (hyperpodrun/state/durable): every N-th
        snapshot is also written, behind the training, as a torch.distributed.checkpoint checkpoint to a
        directory (local disk, FSx/Lustre) or s3://bucket/prefix (pip install 'hyperpodrun[s3]'), the newest
        `fallback_keep` (default 2) complete ones kept; a job lost whole and started again resumes from the
        newest complete one. The store is checked here: one that cannot work raises CheckpointStoreError.
    replica_groups / num_distributed_optimizer_instances: ranks that hold identical state (a rank that
        lost its snapshots gets them from a replica peer). Derived from DDP modules when not given.
    tensor_model_parallel_size / pipeline_model_parallel_size / context_parallel_size / rank_order: the
        Megatron layout the `num_distributed_optimizer_instances` replica map follows (defaults 1, 1, 1 and
        Megatron's "tp-cp-ep-dp-pp", the first the fastest): the replicas of a shard are world / (PP * N) ranks
        apart (hyperpodrun/state/restore/parallel_layout.py). Every snapshot carries the layout's fingerprint; a
        restore under another layout is refused (ReplicaLayoutError), and so is - once the job has several
        nodes - a layout that puts both copies of a shard on one node (the message names a rank order that
        spreads them).
    peer_copy: with several nodes, also copy every slot to a rank on another node (default: on when the
        job spans several nodes), so that the loss of a node does not lose the state of its ranks.
    shm_dir: where the slots live (a tmpfs; default /dev/shm, or HYPERPODRUN_SHM_DIR).
    reuse_live: a surviving rank whose objects still hold the values of the restored step keeps them as they
        are instead of copying the state back, whatever wraps them (hyperpodrun/state/live_state.py; the
        values are compared by fingerprint, hyperpodrun/state/fingerprint.py says what it can miss).
        False for scripts that permute or flip the signs of their state's elements between saves.
    """


__all__ = ["CheckpointManager", "StateLostError", "SnapshotCorrupt", "UnsupportedStateError"]
