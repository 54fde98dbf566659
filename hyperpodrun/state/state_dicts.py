"""State dicts and RNG state for snapshots: what a rank saves of each object, and how it is put back.

Why a module: objects differ in what "this rank's state" is - a ZeroRedundancyOptimizer's own shard
rather than its consolidated state dict (which would need a collective on every save), FSDP2's DTensor
shards as local tensors plus their placement - and restore must hand each one back in the form it expects.
"""
from __future__ import annotations

import collections
import random
import sys
from typing import Any, Iterator, Mapping

from hyperpodrun.state.codec.safe_codec import UnsupportedStateError


def rng_state() -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(rng: Mapping[str, Any]) -> None:
    import torch
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def is_zero(obj: Any) -> bool:
    """Whether `obj` is a ZeroRedundancyOptimizer - without importing torch.distributed.optim to ask (0.16 s
    the first time, which a replacement rank paid inside its restore): no object can be one unless the
    module that defines it was imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    cls = getattr(module, "ZeroRedundancyOptimizer", None)
    return cls is not None and isinstance(obj, cls)


def state_dict_of(obj: Any) -> Any:
    """The rank's own part of `obj`'s state: for ZeroRedundancyOptimizer its local shard (its full
    state_dict() would need a collective consolidation on every save), plus the shared hyper-parameters."""
    if is_zero(obj):
        return {"local": obj.optim.state_dict(),
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]}
    return obj.state_dict()


def load_state_dict_into(obj: Any, sd: Any) -> None:
    if is_zero(obj):
        obj.optim.load_state_dict(sd["local"])
        for group, saved in zip(obj.param_groups, sd["groups"]):
            group.update(saved)
        return
    obj.load_state_dict(sd)


def tensors_in(obj: Any) -> Iterator[Any]:
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def local_ptr(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t
    return local.data_ptr()


def like(saved: Any, current: Any, device: Any = None, non_blocking: bool = False) -> Any:
    """Copies of the saved tensors (views of a mapped slot) shaped like `current` (device, DTensor
    placement). A tensor with no counterpart in `current` goes to `device`, or is cloned on the host:
    nothing returned may alias the slot, which is rewritten two saves later.

    non_blocking (the slot is pinned, pinned_read.py): device copies are queued by DMA, not waited for - the
    caller synchronizes before the mapping goes - and a plain CUDA tensor of the same shape and dtype in
    `current` is written in place (no second copy of the state on the GPU while it loads)."""
    import torch
    if isinstance(saved, torch.Tensor):
        if isinstance(current, torch.Tensor):
            if hasattr(current, "placements") and hasattr(current, "device_mesh"):
                from torch.distributed.tensor import DTensor
                if isinstance(current, DTensor):
                    local = saved.to(current.to_local().device, copy=True, non_blocking=non_blocking)
                    return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                              shape=current.shape, stride=current.stride())
            if non_blocking and current.is_cuda and current.shape == saved.shape and current.dtype == saved.dtype:
                return current.copy_(saved, non_blocking=True)
            return saved.to(current.device, copy=True, non_blocking=non_blocking and current.is_cuda)
        if device is None or saved.dim() == 0:      # scalars (an optimizer's step): the owner places them
            return saved.clone()
        return saved.to(device, copy=True, non_blocking=non_blocking and torch.device(device).type == "cuda")
    if isinstance(saved, dict):
        cur = current if isinstance(current, dict) else {}
        out = {k: like(v, cur.get(k), device, non_blocking) for k, v in saved.items()}
        return collections.OrderedDict(out) if type(saved) is collections.OrderedDict else out
    if isinstance(saved, (list, tuple)):
        peers = current if isinstance(current, (list, tuple)) and len(current) == len(saved) else [None] * len(saved)
        items = [like(s, c, device, non_blocking) for s, c in zip(saved, peers)]
        return type(saved)(*items) if hasattr(saved, "_fields") else type(saved)(items)
    return saved


def device_of(obj: Any) -> Any:
    """Where an optimizer's state lives: the device of its first parameter (local shard)."""
    for group in getattr(obj, "param_groups", []):
        for p in group.get("params", []):
            local = p.to_local() if hasattr(p, "to_local") and hasattr(p, "placements") else p
            return local.device
    return None


def fix_optimizer_dtensors(opt: Any) -> None:
    """After load_state_dict, give each optimizer state tensor its parameter's DTensor layout (FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    for p, st in getattr(opt, "state", {}).items():
        if not isinstance(p, DTensor):
            continue
        local_shape = p.to_local().shape
        for k, v in list(st.items()):
            if hasattr(v, "shape") and not isinstance(v, DTensor) and v.shape == local_shape and v.dim() > 0:
                st[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())


def saved_where(exc: UnsupportedStateError, payload: Mapping[str, Any]) -> UnsupportedStateError:
    """The error with the place named as the user wrote it, e.g. state['opt'].state_dict()['param_groups']."""
    path = list(exc.path)
    if path[:1] == ["state"] and len(path) >= 3 and path[1] in payload["state"]:
        kind = payload["state"][path[1]][0]
        exc.root, exc.path = f"state[{path[1]!r}]" + (".state_dict()" if kind == "sd" else ""), path[3:]
    elif path[:1] == ["rng"]:
        exc.root, exc.path = "the RNG state", path[1:]
    exc.root = f"CheckpointManager.save: {exc.root}"
    return exc
