"""What a surviving rank still holds of its newest snapshot: restores that copy nothing back.

Why: after an in-process restart most ranks are survivors, and a survivor's model and optimizer are
often still exactly at the committed step - every fault that comes outside the optimizer step of the
step after it (an exception in forward or backward, a peer's death, a hang) leaves them untouched. Copying
the state back from host memory then only costs time (1.1 s for a 1 B-parameter model with Adam on a GPU
host; on the order of the whole restart otherwise).

Every save() call makes one (also a call whose snapshot is coalesced or skipped for the overhead budget:
checkpoint.py): it certifies "the objects held step N's values", so that after an exception every rank can
go on from the step of its last save() call, retraining nothing, whether or not that step was ever copied.

When a survivor must restore (and does, from its slot or a peer): the step the job restores is not the one
this process saved last (a peer had not committed it, or this rank had gone on), or any tensor of the state
holds other values than at the save, or the state's structure changed (another number of tensors, other
shapes or keys: an optimizer built again has no state yet). Objects are compared by what they hold, not by
identity: a DDP or FSDP wrapper made again around the same module, DDP's construction broadcast (same values,
new version counts), a module passed bare at one call and wrapped at the next (same keys only) - all keep.
The values are compared by fingerprint (hyperpodrun/state/fingerprint.py says what it can miss).

What is kept between a save and a restore: the snapshot's non-tensor parts (copied at save time: hyper-
parameters, scheduler state, plain values, RNG states) and the tensors' fingerprint - never a reference that
would keep GPU memory alive.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, Mapping, Optional

from hyperpodrun.state.fingerprint import Fingerprint
from hyperpodrun.state.slots.snapshot_copy import free_bytes
from hyperpodrun.state.state_dicts import state_dict_of


class _Slot:
    """A tensor's place in a state skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _skeleton(obj: Any, tensors: list) -> Any:
    """`obj` with every tensor replaced by a _Slot (the tensor appended to `tensors`), the rest copied."""
    import torch
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, _PLAIN):       # immutable: nothing to copy (a deepcopy each, ~1000 a save, took ~10 ms)
        return obj
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _skeleton(v, tensors)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = _copy_metadata(meta)   # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        items = [_skeleton(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


#: values a skeleton keeps as they are (immutable)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _copy_metadata(meta: Any) -> Any:
    """A module state dict's `_metadata` (prefix -> {"version": n, ...}): copied two levels deep, which is all
    it holds - a deepcopy of its hundreds of small dicts cost milliseconds at every save()."""
    if isinstance(meta, dict) and all(isinstance(v, dict) and all(isinstance(x, _PLAIN) for x in v.values())
                                      for v in meta.values()):
        out = type(meta)() if type(meta) in (dict, collections.OrderedDict) else {}
        for k, v in meta.items():
            out[k] = dict(v)
        return out
    return copy.deepcopy(meta)


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


def _structure(skel: Any) -> Any:
    """The shape of a skeleton - keys, lengths, where the tensors are - without its plain values."""
    if isinstance(skel, _Slot):
        return "T"
    if isinstance(skel, dict):
        return tuple((k, _structure(v)) for k, v in skel.items())
    if isinstance(skel, (list, tuple)):
        return ("L",) + tuple(_structure(v) for v in skel)
    return "V"


class _Entry:
    def __init__(self, kind: str, saved: Any, tensors: list) -> None:
        self.kind = kind
        self.skeleton = _skeleton(saved, tensors)
        self._shape: Any = None
        self.all_tensors = not any(True for _ in _non_tensor_leaves(self.skeleton))

    @property
    def structure(self) -> Any:
        """The skeleton's shape (see _structure), computed when a restore first asks: not at every save()."""
        if self._shape is None:
            self._shape = _structure(self.skeleton)
        return self._shape


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


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two tensors (state dicts return new tensor objects each call) are views of the same memory."""
    a, b = _local(a), _local(b)
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype \
        and a.device == b.device


class LiveState:
    """One save() call of this process, as far as its objects still hold it (see the module doc).

    Made when save() is called - the fingerprint must be of the values being saved, taken before the next
    optimizer step can change them (on a GPU it runs on a side stream; `wait_on` makes the optimizer step
    wait for it, on the device).

    It also holds the saved tensors themselves (the objects' own: no memory while the objects live), so that
    objects built again in the re-executed function - an optimizer that Lightning or the Trainer makes anew,
    a model built inside the function - get the values of the save from the previous generation's tensors:
    handed over (an optimizer's state) or copied device to device (a module's parameters), not read back from
    the host. While the re-executed function builds its objects again those tensors are still held: where
    the memory for that is short when a restart begins, `release_if_short` lets them go (then only objects
    that still hold them are kept)."""

    def __init__(self, step: int, payload: Mapping[str, Any], streams: Any = None, timed: bool = False) -> None:
        """`payload`: the save's payload (entries ("sd", state dict) or ("value", obj), RNG, layouts);
        `streams`: a SideStream for the device fingerprints (None: the current stream); `timed`: time them."""
        self.step = step
        tensors: list = []
        self._entries: dict[str, _Entry] = {}
        self._spans: dict[str, tuple[int, int]] = {}    # each entry's tensors in `tensors`
        for name, (kind, saved) in payload["state"].items():
            first = len(tensors)
            self._entries[name] = _Entry(kind, saved, tensors)
            self._spans[name] = (first, len(tensors))
        self._rest = {k: v for k, v in payload.items() if k != "state"}
        self.print = Fingerprint(tensors, streams, timed)
        self._refs: Optional[list] = tensors
        #: after payload_for: whether some object was given the values from the previous generation's tensors
        self.handed_over = False
        #: after payload_for returned None: why the state must be copied back (the restore's log line says it)
        self.why_not = ""

    def wait_on(self, device: Any) -> None:
        self.print.wait_on(device)

    def final(self) -> bool:
        """Whether the values fingerprinted had all been computed when this is asked (an abort beginning)."""
        return self.print.final()

    def release(self) -> None:
        """Let the saved tensors go (the objects of `state` hold the values now)."""
        if self._refs is not None:
            self.print.remember_layout(self._refs)
        self._refs = None

    def release_if_short(self) -> bool:
        """Let the saved tensors go when the memory they would take beside objects built again is not free
        (a restart begins: the re-executed function may build its model again before restore()). Returns
        whether they are still held."""
        refs = self._refs
        if refs is None:
            return False
        need: dict[Any, int] = {}
        for t in refs:
            local = _local(t)
            need[local.device] = need.get(local.device, 0) + local.numel() * local.element_size()
        for device, nbytes in need.items():
            if _free_bytes(device) < nbytes:
                self.release()
                return False
        return True

    def payload_for(self, step: int, state: Mapping[str, Any]) -> Optional[dict]:
        """The payload of `step` for the objects of `state`, or None when this is another step, the values of
        the save are gone (changed in place, or released and the objects hold others) - then the state must
        be loaded from a copy. Each entry is (kind, state dict or value, keep: the object holds exactly these
        tensors and nothing else, nothing to load)."""
        if self.step != step or set(state) != set(self._entries):
            self.why_not = (f"the restored step is {step}, this rank's last save() was step {self.step}"
                            if self.step != step else f"the state's keys changed: {sorted(state)}")
            return None
        everything: list = []          # in the order of the save (the skeletons' tensor indices)
        own: dict[str, bool] = {}
        for name, entry in self._entries.items():
            obj = state[name]
            has_sd = hasattr(obj, "state_dict") and callable(obj.state_dict)
            if (entry.kind == "sd") != has_sd:
                self.why_not = f"{name!r} is another kind of object than at the save"
                return None
            first = len(everything)
            skel = _skeleton(state_dict_of(obj) if has_sd else obj, everything)
            same_shape = _structure(skel) == entry.structure
            lo, hi = self._spans[name]
            own[name] = same_shape and (self._refs is None or all(
                _same_tensor(c, r) for c, r in zip(everything[first:], self._refs[lo:hi])))
            if not same_shape and (self._refs is None or _is_module(obj)):
                self.why_not = f"{name!r} has other keys or shapes than at the save"
                return None         # a module's keys must be the saved ones (bare vs wrapped: a load would fail)
            if same_shape and self._refs is not None and not own[name] and any(
                    _local(c).shape != _local(r).shape or _local(c).dtype != _local(r).dtype
                    for c, r in zip(everything[first:], self._refs[lo:hi])):
                self.why_not = f"{name!r} was built again with other shapes or dtypes"
                return None         # built again with other shapes: the saved values do not fit
        source = self._refs if self._refs is not None else everything
        if not self.print.matches(source):
            moved = [name for name, mine in own.items() if not mine and _is_module(state[name])]
            self.why_not = ("the saved tensors changed since the save" + (
                f" ({', '.join(repr(n) for n in moved)} now holds other tensors: moved or copied by the framework?)"
                if moved else ""))
            return None
        self.why_not = ""
        self.handed_over = not all(own.values()) and self._refs is not None
        out = {name: (entry.kind, _fill(entry.skeleton, source), entry.all_tensors and own[name])
               for name, entry in self._entries.items()}
        return {**self._rest, "state": out}


def _is_module(obj: Any) -> bool:
    import torch
    return isinstance(obj, torch.nn.Module)


def _free_bytes(device: Any) -> int:
    """Memory free for new tensors on `device` (snapshot_copy.free_bytes); on the host what the kernel calls
    available."""
    if getattr(device, "type", "cpu") == "cuda":
        return free_bytes(device)
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        return 0


__all__ = ["LiveState"]
