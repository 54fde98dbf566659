"""The optimizer state of one optimizer instance, sharded over its ranks (Megatron's partial distributed
optimizer, for CheckpointlessMegatronStrategy's stock-PyTorch backend).

Why: with `num_distributed_optimizer_instances` = N the ranks are cut into N contiguous instances; within an
instance each rank holds the optimizer state of its share of the parameters only, and the rank at the same
position of every other instance holds the same share - the replica a lost rank's state comes back from. How,
without replacing the user's optimizer (LR schedulers and Lightning keep the object they were given): the
gradients are all-reduced over every rank as DDP does; after the closure (backward, gradient clipping), the
gradients of parameters another rank of the instance owns are dropped, so the optimizer steps - and keeps
state for - its own share only; then each owner broadcasts its updated parameters within the instance. The
update of a parameter is the one an unsharded optimizer computes, bit for bit: the same gradient, the same
state, the same arithmetic, done once and copied.
"""
from __future__ import annotations

from typing import Any, Callable, Optional


def owners(sizes: list[int], ranks: int) -> list[int]:
    """Which position of an instance owns each parameter (sizes: element counts in the optimizer's order):
    contiguous runs of about equal element counts, as Megatron's buffer is cut."""
    total = sum(sizes) or 1
    out, seen = [], 0
    for n in sizes:
        out.append(min(ranks - 1, (seen + n // 2) * ranks // total))
        seen += n
    return out


class InstanceShards:
    """One optimizer's parameters split over the `size` ranks of this rank's instance (`group`)."""

    def __init__(self, optimizer: Any, group: Any, position: int, size: int, members: list[int]) -> None:
        self.optimizer = optimizer
        self.group, self.position, self.size, self.members = group, position, size, members
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.owner = owners([p.numel() for p in self.params], size)

    def drop_foreign_grads(self) -> None:
        """Before the update: only this rank's share has gradients (the optimizer skips the rest)."""
        for p, o in zip(self.params, self.owner):
            if o != self.position:
                p.grad = None

    def broadcast(self) -> None:
        """After the update: every owner's parameters to the other ranks of the instance."""
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        with torch.no_grad():
            for o in range(self.size):
                mine = [p for p, owner in zip(self.params, self.owner) if owner == o]
                if not mine:
                    continue
                flat = _flatten_dense_tensors([p.detach() for p in mine])
                dist.broadcast(flat, src=self.members[o], group=self.group)
                if o != self.position:
                    for p, value in zip(mine, _unflatten_dense_tensors(flat, mine)):
                        p.copy_(value)

    def step(self, step: Callable[..., Any], closure: Optional[Callable[[], Any]], **kwargs: Any) -> Any:
        """`step` (the optimizer's own) with the foreign gradients dropped after `closure`, then the broadcast."""
        def run() -> Any:
            out = closure() if closure is not None else None
            self.drop_foreign_grads()
            return out
        if closure is None:
            self.drop_foreign_grads()
            result = step(**kwargs)
        else:
            result = step(closure=run, **kwargs)
        self.broadcast()
        return result


def instance_groups(world: int, instances: int) -> tuple[Any, int, int, list[int]]:
    """This rank's instance: (its process group, the rank's position in it, its size, its global ranks); every
    rank makes every instance's group (torch.distributed.new_group is collective)."""
    import torch.distributed as dist
    size = world // instances
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(instances)]
    mine = rank // size
    return groups[mine], rank % size, size, list(range(mine * size, (mine + 1) * size))
