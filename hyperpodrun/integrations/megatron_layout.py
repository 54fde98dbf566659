"""The replica layout of a job that runs Megatron itself (Megatron-LM, Megatron-Bridge or NeMo loops), read from
megatron-core's own process groups, for the CheckpointManager.

    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                                             num_distributed_optimizer_instances=2)
    cm.use_layout(megatron_layout())

Why read it rather than repeat it: the sizes and the rank order given to initialize_model_parallel are spread
over a launcher's flags and a config; what the job runs with is in parallel_state. The tensor, pipeline and
context sizes are asked from it; the number of instances is the data x context parallel size over the size of
this rank's partial data-parallel group; the rank order is the one (among Megatron's) under which every rank's
data x context parallel group is the one Megatron made - agreed between the ranks with one all-reduce of a
bit mask (nothing is pickled). Expert parallelism is refused: its optimizer shards follow the expert
data-parallel groups, which this map does not describe.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

from hyperpodrun.errors import ReplicaLayoutError
from hyperpodrun.state.restore.parallel_layout import ParallelLayout, candidate_orders


def megatron_layout(parallel_state: Optional[Any] = None) -> ParallelLayout:
    """The ParallelLayout megatron-core's parallel_state was initialized with (call it on every rank, after
    initialize_model_parallel: it runs one all-reduce). Raises ReplicaLayoutError when no Megatron rank order
    reproduces its groups, or with expert parallelism."""
    import torch
    import torch.distributed as dist
    ps = parallel_state or importlib.import_module("megatron.core.parallel_state")
    if ps.get_expert_model_parallel_world_size() > 1:
        raise ReplicaLayoutError("megatron_layout(): expert parallelism is not supported (its optimizer shards follow "
                                 "the expert data-parallel groups)")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
    intra = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    instances = dp_cp // intra
    world, rank = dist.get_world_size(), dist.get_rank()
    theirs = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    candidates = [ParallelLayout(instances, tp, pp, cp, order) for order in candidate_orders()]
    mine = [_dp_cp_group(layout, rank, world) == theirs for layout in candidates]
    agreed = torch.tensor([int(m) for m in mine], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    for layout, ok in zip(candidates, agreed.tolist()):
        if ok:
            return layout
    raise ReplicaLayoutError(f"megatron_layout(): no Megatron rank order reproduces the data x context parallel "
                             f"groups of this job (tensor {tp}, pipeline {pp}, context {cp}, {instances} instances); "
                             "give the CheckpointManager replica_groups= instead")


def _dp_cp_group(layout: ParallelLayout, rank: int, world: int) -> list[int]:
    """The data x context parallel group of `rank` under `layout`, in Megatron's order of it."""
    me = layout.coordinates(rank, world)
    dp = layout.data_parallel(world)
    members = []
    for r in range(world):
        c = layout.coordinates(r, world)
        if c["tp"] == me["tp"] and c["pp"] == me["pp"]:
            members.append(r)
    cp_first = layout.order.index("cp") < layout.order.index("dp")

    def index(r: int) -> int:
        c = layout.coordinates(r, world)
        return c["cp"] + layout.cp * c["dp"] if cp_first else c["dp"] + dp * c["cp"]
    return sorted(members, key=index)
