"""A metadata encoding that cannot run code when it is read: plain values, containers and tensor references.

Why not pickle: snapshot slots, MMAP batch files and peer copies are read back from shared memory, files
and the network. Unpickling such bytes runs whatever callable they name, so whoever can write them can
run code in the training process. This format has a fixed set of tags and the reader only ever builds:

- None, bool, int, float, complex, str, bytes, bytearray, slice
- list, tuple, dict, collections.OrderedDict, set, frozenset
- TensorRef (where a tensor's bytes sit; the caller turns it into a tensor)
- numpy arrays and scalars of plain dtypes (rebuilt from raw bytes; never dtype=object)
- torch.Size, torch.dtype, torch.device
- namedtuples and Enum members, by the name of their class: the class must already be loaded
  (sys.modules) - no module is ever imported because the data names it - and it is looked up in the
  modules' and classes' own namespaces (no attribute hooks run); a namedtuple is rebuilt with
  tuple.__new__ (its own __new__ does not run), an Enum member is taken from the class's member table.

`dumps` refuses anything else at save time with UnsupportedStateError naming the type and where it
sits, so that a state that could not be restored never looks saved. `loads` raises CodecError on any
malformed input (bounds, depth, unknown tags, unknown classes).
"""
from __future__ import annotations

import collections
import enum
import struct
import sys
from typing import Any, Callable, Optional

from hyperpodrun.errors import CodecError, UnsupportedStateError
from hyperpodrun.state.codec import codec_format as F
from hyperpodrun.state.codec.codec_format import MAX_DEPTH, VERSION, TensorRef
from hyperpodrun.state.codec.codec_read import loads

# ------------------------------------------------------------------------------------------ encoding
class _Encoder:
    def __init__(self, on_tensor: Optional[Callable[[Any], TensorRef]]) -> None:
        self.out: list[bytes] = []
        self.on_tensor = on_tensor
        torch = sys.modules.get("torch")
        self.torch = torch
        self.np = sys.modules.get("numpy")

    def str_(self, s: str) -> None:
        b = s.encode("utf-8", "surrogatepass")
        self.out.append(F.U32.pack(len(b)))
        self.out.append(b)

    def seq(self, tag: bytes, items: Any, depth: int) -> None:
        self.out.append(tag + F.U32.pack(len(items)))
        for i, v in enumerate(items):
            try:
                self.enc(v, depth)
            except UnsupportedStateError as exc:
                exc.path.insert(0, i)
                raise

    def enc(self, obj: Any, depth: int = 0) -> None:
        if depth > F.MAX_DEPTH:
            raise UnsupportedStateError(type(obj), [], f"nested more than {F.MAX_DEPTH} levels (a cycle?)")
        out = self.out
        kind = type(obj)
        if obj is None:
            out.append(b"N")
        elif kind is bool:
            out.append(b"T" if obj else b"F")
        elif kind is int:
            if -(1 << 63) <= obj < (1 << 63):
                out.append(b"i" + F.Q.pack(obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                out.append(b"I" + F.U32.pack(len(raw)) + raw)
        elif kind is float:
            out.append(b"f" + F.D.pack(obj))
        elif kind is str:
            out.append(b"s")
            self.str_(obj)
        elif kind is dict or kind is collections.OrderedDict:
            out.append((b"d" if kind is dict else b"o") + F.U32.pack(len(obj)))
            for k, v in obj.items():
                try:
                    self.enc(k, depth + 1)
                    self.enc(v, depth + 1)
                except UnsupportedStateError as exc:
                    exc.path.insert(0, k)
                    raise
        elif kind is list:
            self.seq(b"l", obj, depth + 1)
        elif kind is tuple:
            self.seq(b"t", obj, depth + 1)
        elif kind is TensorRef:
            self.ref(obj)
        elif self.torch is not None and isinstance(obj, self.torch.Tensor):
            if self.on_tensor is None:
                raise UnsupportedStateError(kind, [], "tensors are not expected here")
            self.ref(self.on_tensor(obj))
        else:
            self.other(obj, kind, depth)

    def ref(self, ref: TensorRef) -> None:
        dtype = ref.dtype.encode()
        shape = ref.shape
        self.out.append(b"R" + F.REF.pack(ref.offset, ref.nbytes, len(dtype), len(shape)) + dtype
                        + struct.pack(f"<{len(shape)}q", *shape))

    def array(self, tag: bytes, arr: Any, kind: type) -> None:
        dt = arr.dtype
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None or not F.DTYPE.match(dt.str):
            raise UnsupportedStateError(kind, [], f"numpy dtype {dt} cannot be stored (object or structured)")
        raw = arr.tobytes(order="C")
        self.out.append(tag)
        self.str_(dt.str)
        self.out.append(F.U32.pack(arr.ndim) + b"".join(F.Q.pack(d) for d in arr.shape))
        self.out.append(F.U64.pack(len(raw)) + raw)

    def other(self, obj: Any, kind: type, depth: int) -> None:
        out, torch, np = self.out, self.torch, self.np
        if isinstance(obj, enum.Enum):
            cls = F.lookup(*F.class_path(kind))
            if cls is not kind:
                raise UnsupportedStateError(kind, [], "its Enum class is not reachable by module and name "
                                            "(defined inside a function?); define it at module level")
            out.append(b"e")
            self.str_(kind.__module__)
            self.str_(kind.__qualname__)
            self.str_(obj.name)
        elif np is not None and kind is np.ndarray:
            self.array(b"A", obj, kind)
        elif np is not None and isinstance(obj, np.generic):
            self.array(b"a", np.asarray(obj), kind)
        elif torch is not None and kind is torch.Size:
            out.append(b"z" + F.U32.pack(len(obj)) + b"".join(F.Q.pack(d) for d in obj))
        elif torch is not None and kind is torch.dtype:
            out.append(b"y")
            self.str_(str(obj).removeprefix("torch."))
        elif torch is not None and kind is torch.device:
            out.append(b"v")
            self.str_(str(obj))
        elif kind is complex:
            out.append(b"c" + F.DD.pack(obj.real, obj.imag))
        elif kind is bytes or kind is bytearray:
            out.append((b"b" if kind is bytes else b"B") + F.U64.pack(len(obj)))
            out.append(bytes(obj))
        elif kind is set or kind is frozenset:
            self.seq(b"S" if kind is set else b"Z", list(obj), depth + 1)
        elif kind is slice:
            self.seq(b"L", (obj.start, obj.stop, obj.step), depth + 1)
        elif isinstance(obj, tuple) and F.is_namedtuple(kind):
            cls = F.lookup(*F.class_path(kind))
            if cls is not kind:
                raise UnsupportedStateError(kind, [], "its namedtuple class is not reachable by module and name "
                                            "(defined inside a function?); define it at module level")
            out.append(b"n")
            self.str_(kind.__module__)
            self.str_(kind.__qualname__)
            self.seq(b"t", tuple(obj), depth + 1)
        else:
            raise UnsupportedStateError(kind, [])


def dumps(obj: Any, on_tensor: Optional[Callable[[Any], TensorRef]] = None) -> bytes:
    """Encode `obj`; every torch.Tensor in it is replaced by `on_tensor(tensor)` (a TensorRef).

    Raises UnsupportedStateError (a TypeError) naming the first value of a type that is not carried.
    """
    enc = _Encoder(on_tensor)
    enc.out.append(bytes([F.VERSION]))
    enc.enc(obj)
    return b"".join(enc.out)


__all__ = ["dumps", "loads", "TensorRef", "CodecError", "UnsupportedStateError", "MAX_DEPTH", "VERSION"]
