"""Megatron's rank layout: which ranks hold the same distributed-optimizer shard, where they sit, and the
fingerprint a snapshot carries of it.

Why: with `num_distributed_optimizer_instances` = N, Megatron cuts each data-parallel group (data x context
parallel ranks of one tensor and pipeline position) into N contiguous instances; the optimizer state is sharded
within an instance, so the rank at position p of every instance holds the same shard - the replica a lost
rank's state comes back from. Which global ranks those are follows from Megatron's rank order
(`initialize_model_parallel(order="tp-cp-ep-dp-pp")`, the first dimension the fastest): with pipeline stages
the replicas of a shard are world / (PP * N) ranks apart, not world / N (that pairs different stages). A
snapshot restored under another layout would load another rank's part of the model without any error, so
every snapshot carries the layout's fingerprint and a restore under another one is refused.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Optional

from hyperpodrun.errors import ReplicaLayoutError

#: Megatron-core's default rank order (megatron.core.parallel_state.initialize_model_parallel)
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "cp", "ep", "dp", "pp")
log = logging.getLogger("hyperpodrun.runtime")


@dataclass(frozen=True)
class ParallelLayout:
    """A Megatron-style layout: `instances` optimizer instances over data x context parallel ranks, with
    tensor (`tp`), pipeline (`pp`) and context (`cp`) parallel sizes, ranks numbered in `order`."""

    instances: Optional[int] = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name, size in (("tensor_model_parallel_size", self.tp), ("pipeline_model_parallel_size", self.pp),
                           ("context_parallel_size", self.cp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ReplicaLayoutError(f"CheckpointManager({name}={size!r}): must be an int >= 1")
        dims = self.order.split("-")
        if sorted(d for d in dims if d != "ep") != sorted(d for d in _DIMS if d != "ep") or len(set(dims)) != len(dims) \
                or any(d not in _DIMS for d in dims):
            raise ReplicaLayoutError(f"CheckpointManager(rank_order={self.order!r}): a '-'-separated order of tp, "
                                     f"cp, dp, pp (and ep), the fastest first, as Megatron's (default {DEFAULT_ORDER!r})")

    def data_parallel(self, world: int) -> int:
        """The data-parallel size at `world` ranks (raises ReplicaLayoutError when the layout does not fit)."""
        model = self.tp * self.pp * self.cp
        if world % model:
            raise ReplicaLayoutError(
                f"the world of {world} ranks is not a multiple of tensor x pipeline x context parallel "
                f"({self.tp} x {self.pp} x {self.cp} = {model})")
        dp = world // model
        if self.instances is not None and (self.instances < 1 or (dp * self.cp) % self.instances):
            raise ReplicaLayoutError(
                f"num_distributed_optimizer_instances={self.instances} does not divide the data x context parallel "
                f"size {dp} x {self.cp} of {world} ranks (tensor {self.tp}, pipeline {self.pp}); use a divisor of it "
                "(2 or more for redundancy)")
        return dp

    def coordinates(self, rank: int, world: int) -> dict[str, int]:
        """`rank`'s position along each dimension (the first dimension of `order` the fastest)."""
        sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.data_parallel(world), "pp": self.pp}
        out = {}
        for dim in self.order.split("-"):
            out[dim] = rank % sizes[dim]
            rank //= sizes[dim]
        out.setdefault("ep", 0)
        return out

    def groups(self, world: int) -> list[list[int]]:
        """Replica groups: the ranks holding the same shard, one per instance, lowest instance first.

        A rank's shard is its position within its instance: its (data, context) index - ordered as
        `order` orders dp and cp, as Megatron lists its data-parallel-with-context group - modulo the
        instance size, at the same tensor and pipeline position."""
        dp = self.data_parallel(world)
        instances = self.instances or 1
        size = dp * self.cp // instances
        cp_first = self.order.index("cp") < self.order.index("dp")
        by_shard: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for rank in range(world):
            c = self.coordinates(rank, world)
            j = c["cp"] + self.cp * c["dp"] if cp_first else c["dp"] + dp * c["cp"]
            by_shard.setdefault((c["tp"], c["pp"], j % size), []).append((j // size, rank))
        return sorted([[r for _i, r in sorted(members)] for members in by_shard.values()])

    def fingerprint(self, world: int) -> str:
        """What a snapshot says of the layout it was taken under (compared exactly at restore)."""
        return (f"world={world} tp={self.tp} pp={self.pp} cp={self.cp} instances={self.instances or 1} "
                f"order={self.order}")

    def shared_nodes(self, world: int, local_world: int, every: bool = True) -> list[list[int]]:
        """The replica groups with every member (`every`), or at least two members, on one node (a node:
        `local_world` consecutive ranks)."""
        out = []
        for g in self.groups(world):
            nodes = len({r // local_world for r in g})
            if (nodes == 1) if every else (nodes < len(g)):
                out.append(g)
        return out

    def check_placement(self, world: int, local_world: int) -> None:
        """Refuse a multi-node layout that puts every copy of a shard on one node (that node's loss loses the
        shard): ReplicaLayoutError naming a rank order that spreads them. With 3 or more instances, a node
        holding two copies of a shard is said in a warning (one node's loss then leaves fewer copies)."""
        if self.instances is None or self.instances < 2 or local_world < 1 or world <= local_world:
            return        # one node: the copies guard against the loss of a process, not of the node
        bad = self.shared_nodes(world, local_world)
        if not bad:
            doubled = self.shared_nodes(world, local_world, every=False)
            if doubled:
                log.warning("replica layout: one node holds two copies of a shard (ranks %s); losing it leaves "
                            "fewer copies than num_distributed_optimizer_instances=%d", doubled[0], self.instances)
            return
        fixes = [o for o in candidate_orders() if not ParallelLayout(self.instances, self.tp, self.pp, self.cp, o)
                 .shared_nodes(world, local_world)]
        fix = (f"rank order {fixes[0]!r} (Megatron's initialize_model_parallel(order=...), and "
               f"CheckpointManager(rank_order={fixes[0]!r})) puts them on different nodes") if fixes else \
            "no rank order puts them on different nodes: change the tensor/pipeline parallel sizes or the number of " \
            "instances"
        raise ReplicaLayoutError(
            f"replica layout of {world} ranks ({local_world} per node; tensor {self.tp}, pipeline {self.pp}, "
            f"context {self.cp}, {self.instances} optimizer instances, order {self.order!r}) puts every copy of a "
            f"shard on one node (ranks {bad[0]}): the loss of that node loses the shard; {fix}")


def candidate_orders() -> list[str]:
    """Rank orders to suggest: Megatron's default first; tensor parallel the fastest, expert parallel next to
    data parallel (as Megatron requires)."""
    out = ["-".join(("tp", *("ep-dp" if d == "dp" else d for d in p))) for p in itertools.permutations(("cp", "dp", "pp"))]
    out.sort(key=lambda o: (o != DEFAULT_ORDER, o))
    return out


def mismatch(saved: Optional[str], current: str) -> Optional[str]:
    """A one-line refusal when a snapshot's layout fingerprint differs from this job's, else None (a
    snapshot of an older version without one is taken as is)."""
    if saved is None or saved == current:
        return None
    return (f"the snapshot was taken under another parallel layout ({saved}) than this job's ({current}); "
            "restoring it would load another rank's part of the model. Restore with the layout it was saved "
            "under, or start from a checkpoint converted for this layout")
