"""Which committed step the ranks restore after a restart, and where each rank gets it from.

Every rank lists what it holds (`Inventory`: steps in its own shared memory, on the disk fallback, and the
copies it keeps of other ranks' slots); the lists are gathered on every rank (restore_inventory.py: MACed
under the workers' key and bounded; a refused one counts as holding nothing) and `plan_restore` - a pure
function, the same on every rank - picks the newest step that every rank can get from memory (its own, a
replica peer's, a peer copy on another node), else the newest it can get from memory or disk, and which
transfers bring it to the ranks that do not hold it. No such step: StateLostError (exit code 75), never a
silent restart from step 0. CheckpointManager.restore (hyperpodrun/state/checkpoint.py) carries it out.
"""
from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Optional, Sequence

from hyperpodrun.errors import ProtocolError, SnapshotCorrupt, StateLostError
from hyperpodrun.state.restore import replicas
from hyperpodrun.state.slots import snapshot_io as io
from hyperpodrun.state.slots.pinned_read import map_readonly, prepinned
from hyperpodrun.state.restore.restore_inventory import Gathered, Inventory, gather  # noqa: F401 (re-exported)

log = logging.getLogger("hyperpodrun.runtime")


@dataclass(frozen=True)
class RestorePlan:
    """The step to restore and how every rank gets it."""

    step: int
    #: (donor, receiver, kind) transfers; kind "replica" or "peer" (replicas.plan_transfers)
    pairs: list[tuple[int, int, str]]
    #: where the step comes from, for the report: "replica", "peer", "memory" or "disk"
    source: str
    #: steps to train again: the step the fault interrupted (the latest any rank reached) minus the one
    #: restored, at least 0 (where no rank knows it: the newest step any rank saved minus the one restored)
    lost_steps: int


def map_private(path: str) -> mmap.mmap:
    """A private (copy-on-write) mapping of a slot or fallback file, never opened through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def find_snapshots(directory: str, trusted: Optional[Mapping[str, int]] = None,
                   unverified: Optional[set[str]] = None, deferred: Optional[set[str]] = None) -> dict[int, str]:
    """step -> path of every complete, intact snapshot in `directory` (bad ones are skipped, loudly).

    trusted: path -> step of slots this process sealed itself and still holds; only their header is read
    (a restore that then reads their data verifies it: SnapshotIO.decode(verify=True)).
    unverified: given, the slots are taken newest first and only until one is intact (or trusted) is a
    checksum summed; each older complete slot gets its header read and its path added to the set - whoever
    reads it then verifies it (its step is there for the plan, and is seldom the one restored: the summing of
    a 6.4 GB slot that nobody reads cost 0.3-0.5 s per restore).
    deferred: given, the newest slot is not summed here either: its header is read and its path added; whoever
    restores it sums it while copying out of it (slot_verify.py) and drops it when the sum fails."""
    found: dict[int, str] = {}
    if not os.path.isdir(directory):
        return found
    headers: list[tuple[int, str]] = []
    for name in os.listdir(directory):
        if name.endswith(".tmp"):
            continue
        path = os.path.join(directory, name)
        try:
            headers.append((io.header(map_readonly(path), path)[0], path))
        except (SnapshotCorrupt, OSError, ValueError) as exc:
            log.error("ignoring snapshot %s", exc)
    settled = False
    for step, path in sorted(headers, reverse=True):
        try:
            if trusted and path in trusted:
                if step != trusted[path]:
                    raise SnapshotCorrupt(f"{path}: holds step {step}, not the step {trusted[path]} sealed there")
            elif settled and unverified is not None:
                unverified.add(path)
            elif deferred is not None:
                deferred.add(path)
            else:
                pre = prepinned(path)      # a standby's mapping, already populated; else read whole: no fault per page
                step = io.verify(pre.map if pre is not None else map_readonly(path, populate=True), path)
        except (SnapshotCorrupt, OSError, ValueError) as exc:
            log.error("ignoring snapshot %s", exc)
            continue
        found[step] = path
        settled = True
    return found


def plan_restore(everyone: Sequence[Inventory], groups_of: Callable[[int], list[list[int]]],
                 refused: Collection[int] = ()) -> Optional[RestorePlan]:
    """The plan for the gathered inventories (rank r's at index r), or None for a fresh start: no rank holds
    anything, or some rank that has run since the job started never completed a snapshot (then no step was
    committed by every rank). `groups_of(world)`: the replica groups (asked only when there is something to restore).
    Raises StateLostError naming the ranks whose state at the newest step survives nowhere.

    refused: ranks whose inventory was refused (restore_inventory.py; their entries hold nothing). What they
    hold is not known, so where the plan would need it - a state that then survives nowhere, or a fresh start
    that their state might contradict - it raises ProtocolError (retried in the next round) naming them,
    never StateLostError or a silent start from step 0: a bad inventory is its sender's fault."""
    live = [e.get("live") for e in everyone]
    bad = sorted(set(refused))
    if not any(e["shm"] or e["disk"] or v is not None for e, v in zip(everyone, live)):
        if bad:
            raise ProtocolError(f"the restore inventories of rank(s) {bad} were refused and no other rank holds a "
                                "snapshot: whether this is a fresh start is not known; tried again next round")
        return None
    everyone_live = live[0] is not None and all(v == live[0] for v in live)
    fresh = [r for r, e in enumerate(everyone) if e.get("never_committed")]
    # a fault during the first snapshot: nothing was committed job-wide - unless the durable tier holds a
    # checkpoint (a job started again after it was lost whole: its ranks are all fresh, its state is there)
    if fresh and not everyone_live and not any(e["disk"] for e in everyone):
        log.warning("rank(s) %s have not completed a snapshot since the job started: no step was committed by "
                    "every rank yet, so training starts again from the beginning", fresh)
        return None
    world = len(everyone)
    groups = groups_of(world)
    # a rank's own objects at a step count as memory that holds it (a replica donor sends its live tensors)
    mem = [set(e["shm"]) | ({v} if v is not None else set()) for e, v in zip(everyone, live)]
    on_disk = [set(e["disk"]) for e in everyone]
    held = {h: {int(src): set(steps) for src, steps in e["copies"].items()} for h, e in enumerate(everyone)}

    def in_memory(r: int, s: int) -> bool:
        return any(s in mem[p] for p in replicas.group_of(groups, r)) or \
            any(s in c.get(r, ()) for c in held.values())
    steps: set[int] = set().union(*mem, *on_disk)
    from_memory = [s for s in steps if all(in_memory(r, s) for r in range(world))]
    anywhere = [s for s in steps if all(in_memory(r, s) or s in on_disk[r] for r in range(world))]
    if not anywhere:
        newest = max(steps)
        missing = [r for r in range(world) if not (in_memory(r, newest) or newest in on_disk[r])]
        if bad:
            raise ProtocolError(f"the state of rank(s) {missing} at step {newest} is held by no rank whose restore "
                                f"inventory was accepted; rank(s) {bad} sent one that was refused (see the log); "
                                "tried again next round")
        raise StateLostError(
            f"the state of rank(s) {missing} at step {newest} survives nowhere (no snapshot in shared memory, "
            f"none on a replica peer, no fallback checkpoint); configure CheckpointManager(fallback_dir=...) "
            f"or replicas (replica_groups= / num_distributed_optimizer_instances=) to survive this")
    step = max(from_memory) if from_memory else max(anywhere)
    pairs = replicas.plan_transfers(groups, mem, step, held)
    source = pairs[0][2] if pairs else ("memory" if from_memory else "disk")
    if all(v == step for v in live):
        source = "memory"
    reached = [at for at in (e.get("at") for e in everyone) if at is not None]
    latest = max((e["latest"] for e in everyone if e["latest"] is not None), default=step)
    return RestorePlan(step, pairs, source, max(0, (max(reached) if reached else latest) - step))
