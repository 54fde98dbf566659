"""What a surviving rank still holds of its newest snapshot: restores that copy nothing back.

Why: after an in-process restart most ranks are survivors, and a survivor's model and optimizer are
often still exactly at the committed step - every fault that comes outside the optimizer step of the
step after it (an exception in forward or backward, a peer's death, a hang) leaves them untouched. Copying
the state back from host memory then only costs time (1.1 s for a 1 B-parameter model with Adam on a GPU
host; on the order of the whole restart otherwise).

When a survivor must restore (and does, from its slot or a peer): the step the job restores is not the one
this process saved last (a peer had not committed it, or this rank had gone on), an object of the state is
not the one it saved (built again inside the re-executed function), or any tensor of it changed since the
save. A change is seen by the tensor's version counter, which every in-place operation on it or on a view
of it advances (optimizer steps, `copy_`, a buffer updated in forward, DDP's buffer broadcast), and by its
storage address. Updates through `.data` (`p.data.add_(...)`) bypass the version counter: a script that
changes parameters that way between a save and the next one needs `CheckpointManager(reuse_live=False)`.

What is kept between a save and a restore: the snapshot's non-tensor parts (copied at save time: hyper-
parameters, scheduler state, plain values, RNG states) and, for each tensor, its fingerprint (storage
address, offset, shape, dtype, version) - never a reference that would keep GPU memory alive.
"""
from __future__ import annotations

import collections
import copy
import weakref
from typing import Any, Mapping, Optional

from hyperpodrun.runtime.state_dicts import state_dict_of


class _Slot:
    """A tensor's place in a state skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _fingerprint(t: Any) -> tuple:
    local = _local(t)
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), str(local.dtype),
            local._version)


def _skeleton(obj: Any, tensors: list) -> Any:
    """`obj` with every tensor replaced by a _Slot (the tensor appended to `tensors`), the rest copied."""
    import torch
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _skeleton(v, tensors)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = copy.deepcopy(meta)   # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        items = [_skeleton(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _fill(skel: Any, tensors: list) -> Any:
    if isinstance(skel, _Slot):
        return tensors[skel.index]
    if isinstance(skel, dict):
        out = type(skel)()
        for k, v in skel.items():
            out[k] = _fill(v, tensors)
        meta = getattr(skel, "_metadata", None)
        if meta is not None:
            out._metadata = meta   # type: ignore[attr-defined]
        return out
    if isinstance(skel, (list, tuple)):
        items = [_fill(v, tensors) for v in skel]
        return type(skel)(*items) if hasattr(skel, "_fields") else type(skel)(items)
    return copy.deepcopy(skel)


def _tensors(obj: Any) -> list:
    out: list = []
    _skeleton(obj, out)
    return out


class _Entry:
    def __init__(self, kind: str, obj: Any, saved: Any) -> None:
        tensors: list = []
        self.kind = kind
        self.skeleton = _skeleton(saved, tensors)
        self.prints = [_fingerprint(t) for t in tensors]
        try:
            self.ref: Optional[weakref.ref] = weakref.ref(obj) if kind == "sd" else None
        except TypeError:
            self.ref = None
        self.all_tensors = not any(True for _ in _non_tensor_leaves(self.skeleton))


def _non_tensor_leaves(skel: Any) -> Any:
    if isinstance(skel, _Slot):
        return
    if isinstance(skel, dict):
        for v in skel.values():
            yield from _non_tensor_leaves(v)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            yield from _non_tensor_leaves(v)
    else:
        yield skel


class LiveState:
    """One save of this process, as far as its objects still hold it (see the module doc).

    Made when save() is called - the fingerprints must be those of the values being copied, taken before
    the next optimizer step can change them - and kept by the CheckpointManager once the snapshot is sealed."""

    def __init__(self, step: int, payload: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """`payload`: the snapshot's payload (entries ("sd", state dict) or ("value", obj), RNG, layouts)."""
        self.step = step
        self._entries = {name: _Entry(kind, state[name], saved) for name, (kind, saved) in payload["state"].items()}
        self._rest = {k: v for k, v in payload.items() if k != "state"}

    def payload_for(self, step: int, state: Mapping[str, Any]) -> Optional[dict]:
        """The payload of `step` made of the objects of `state` themselves, or None when this is another step
        or some object changed since the save (then the state must be loaded from a copy). Each entry is
        (kind, state dict or value, whether it holds tensors only)."""
        if self.step != step or set(state) != set(self._entries):
            return None
        out: dict[str, Any] = {}
        for name, obj in state.items():
            entry = self._entries[name]
            if entry.kind == "sd":
                if entry.ref is None or entry.ref() is not obj:
                    return None
                current = _tensors(state_dict_of(obj))
            else:
                current = _tensors(obj)
            if [_fingerprint(t) for t in current] != entry.prints:
                return None
            out[name] = (entry.kind, _fill(entry.skeleton, current), entry.all_tensors)
        return {**self._rest, "state": out}


__all__ = ["LiveState"]
