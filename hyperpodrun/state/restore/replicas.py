"""Replica layout and the transfer of a snapshot from a replica peer to a rank that lost its own.

Why: where the parallel layout holds every shard more than once (DDP, HSDP's replicate dimension, two or
more distributed-optimizer instances), a rank that lost its snapshot - its node's shared memory is gone -
does not need a disk checkpoint: a replica peer holds the same state at the same step. The layout is
derived from the DDP modules in use, or given explicitly (`replica_groups`, or
`num_distributed_optimizer_instances` as in the product note).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from hyperpodrun.errors import ReplicaLayoutError
from hyperpodrun.state.restore.parallel_layout import DEFAULT_ORDER, ParallelLayout

log = logging.getLogger("hyperpodrun.runtime")


def instance_groups(world: int, instances: int, tp: int = 1, pp: int = 1, cp: int = 1,
                    order: str = DEFAULT_ORDER) -> list[list[int]]:
    """Replica groups of `instances` distributed-optimizer instances over `world` ranks in Megatron's layout
    (parallel_layout.py): with tp = pp = cp = 1, instance i holds ranks [i*size, (i+1)*size) and rank p of
    every instance holds the same shard; with pipeline stages the replicas are world/(pp*instances) apart."""
    return ParallelLayout(instances, tp, pp, cp, order).groups(world)


def validate_groups(groups: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    """Check that explicit replica groups partition (part of) the ranks."""
    seen: set[int] = set()
    out = []
    for g in groups:
        g = sorted(int(r) for r in g)
        for r in g:
            if r < 0 or r >= world:
                raise ReplicaLayoutError(f"replica_groups names rank {r}, but the world has {world} ranks")
            if r in seen:
                raise ReplicaLayoutError(f"replica_groups lists rank {r} twice; each rank is in one group")
            seen.add(r)
        out.append(g)
    return out


def derived_groups(state: Mapping[str, Any], world: int) -> Optional[list[list[int]]]:
    """Replica groups implied by the state's modules: a DDP module replicates over its process group.

    Only when every module in `state` is a DDP module over the same group and no optimizer is sharded
    (ZeroRedundancyOptimizer): a model with sharded parts has no single replica layout to derive; give
    one explicitly.
    """
    import torch.distributed as dist
    from hyperpodrun.state.ddp_layout import is_ddp
    from hyperpodrun.state.state_dicts import is_zero
    if any(is_zero(o) for o in state.values()):
        return None
    modules = [m for m in state.values() if hasattr(m, "parameters") and hasattr(m, "state_dict")
               and not hasattr(m, "param_groups")]
    if not modules or not all(is_ddp(m) for m in modules):
        return None
    ranks: Optional[list[int]] = None
    for m in modules:
        try:
            r = sorted(dist.get_process_group_ranks(m.process_group))
        except (RuntimeError, ValueError, AttributeError):
            return None
        if ranks is not None and r != ranks:
            return None
        ranks = r
    if ranks is None or len(ranks) < 2:
        return None
    rest = [r for r in range(world) if r not in ranks]
    return [ranks] + [[r] for r in rest]


def group_of(groups: Iterable[Sequence[int]], rank: int) -> list[int]:
    for g in groups:
        if rank in g:
            return list(g)
    return [rank]


def plan_transfers(groups: list[list[int]], holds: Sequence[set[int]], step: int,
                   copies: Optional[Mapping[int, Mapping[int, set[int]]]] = None) -> list[tuple[int, int, str]]:
    """(donor, receiver, kind) for each rank without `step` in its own memory.

    kind "replica": the lowest replica peer holding the step sends its own slot; kind "peer": a rank on
    another node holding a copy of the receiver's slot (`copies[holder][receiver]`) sends that copy.
    """
    pairs = []
    for rank in range(len(holds)):
        if step in holds[rank]:
            continue
        donors = [p for p in group_of(groups, rank) if p != rank and step in holds[p]]
        if donors:
            pairs.append((min(donors), rank, "replica"))
            continue
        holders = [h for h, held in (copies or {}).items() if step in held.get(rank, set())]
        if holders:
            pairs.append((min(holders), rank, "peer"))
    return pairs


def transfer(pairs: list[tuple[int, int, str]], me: int, blob_for: Callable[[int, str], bytes],
             channel: Any = None, step: int = 0) -> Optional[bytearray]:
    """Send the slots I donate; return the slot I receive (if any).

    Every rank walks the same ordered list, so the point-to-point calls pair up without deadlock. The bytes
    go as replica_stream's slot path: MACed under the workers' key (`channel`, wire_auth.Channel; default:
    this process's) and bound to `step`, lengths capped before anything is allocated, no numpy.
    """
    from hyperpodrun.state.restore import replica_stream
    got = replica_stream.exchange(pairs, me, lambda receiver, kind: None, blob_for, {}, channel, step)
    if got is None:
        return None
    return got.blob if isinstance(got.blob, bytearray) else bytearray(got.blob)
