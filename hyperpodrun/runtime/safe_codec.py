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
import re
import struct
import sys
import types
from typing import Any, Callable, NamedTuple, Optional

from hyperpodrun.errors import HyperpodrunError

VERSION = 1
#: containers nested deeper than this are refused (real states nest a few levels)
MAX_DEPTH = 100

_Q = struct.Struct("<q")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_D = struct.Struct("<d")
_DD = struct.Struct("<dd")
_REF = struct.Struct("<qqBB")        # offset, nbytes, dtype name length, ndim
_DTYPE = re.compile(r"^[<>|=]?[biufcmMSUV]\d{1,4}(\[[A-Za-z0-9]{1,8}\])?$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class CodecError(HyperpodrunError, ValueError):
    """Encoded metadata is malformed or names something this process does not allow."""


class UnsupportedStateError(HyperpodrunError, TypeError):
    """A value of a type the metadata encoding does not carry (raised when saving, never at restore)."""

    def __init__(self, kind: type, path: list, why: str = "") -> None:
        super().__init__(kind, path, why)
        self.kind, self.path, self.why = kind, path, why
        self.root = "value"

    def where(self) -> str:
        """Where the value sits, e.g. state['opt']['param_groups'][0]['extra']."""
        return self.root + "".join(f"[{p!r}]" for p in self.path)

    def __str__(self) -> str:
        name = f"{self.kind.__module__}.{self.kind.__qualname__}"
        return (f"{self.where()} is a {name}: {self.why or 'not a type snapshots can hold'}. Snapshots hold "
                "tensors, numpy arrays, None/bool/int/float/complex/str/bytes, lists, tuples, dicts, sets, "
                "namedtuples and Enum members; convert it (e.g. to a dict) or keep it out of the saved state")


class TensorRef(NamedTuple):
    """Where a tensor's bytes sit (offset or index, as the caller defines), its dtype name and shape."""

    offset: int
    dtype: str
    shape: tuple
    nbytes: int


def _class_path(kind: type) -> tuple[str, str]:
    return kind.__module__, kind.__qualname__


def _own_attr(cls: type, name: str) -> Any:
    """A class attribute from the namespaces of its MRO (no descriptors or metaclass hooks run)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise KeyError(name)


def _lookup(module: str, qualname: str) -> Optional[type]:
    """The class `module`.`qualname` if that module is loaded; None otherwise.

    Never imports, and reads only the module's and the classes' own namespaces (no __getattr__ hooks)."""
    if not _NAME.match(module) or not _NAME.match(qualname):
        return None
    obj: Any = sys.modules.get(module)
    if not isinstance(obj, types.ModuleType):
        return None
    for part in qualname.split("."):
        if not isinstance(obj, (type, types.ModuleType)):
            return None
        obj = vars(obj).get(part)
    return obj if isinstance(obj, type) else None


def _is_namedtuple(kind: type) -> bool:
    try:
        fields = _own_attr(kind, "_fields")
    except KeyError:
        return False
    return issubclass(kind, tuple) and isinstance(fields, tuple)


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
        self.out.append(_U32.pack(len(b)))
        self.out.append(b)

    def seq(self, tag: bytes, items: Any, depth: int) -> None:
        self.out.append(tag + _U32.pack(len(items)))
        for i, v in enumerate(items):
            try:
                self.enc(v, depth)
            except UnsupportedStateError as exc:
                exc.path.insert(0, i)
                raise

    def enc(self, obj: Any, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(type(obj), [], f"nested more than {MAX_DEPTH} levels (a cycle?)")
        out = self.out
        kind = type(obj)
        if obj is None:
            out.append(b"N")
        elif kind is bool:
            out.append(b"T" if obj else b"F")
        elif kind is int:
            if -(1 << 63) <= obj < (1 << 63):
                out.append(b"i" + _Q.pack(obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                out.append(b"I" + _U32.pack(len(raw)) + raw)
        elif kind is float:
            out.append(b"f" + _D.pack(obj))
        elif kind is str:
            out.append(b"s")
            self.str_(obj)
        elif kind is dict or kind is collections.OrderedDict:
            out.append((b"d" if kind is dict else b"o") + _U32.pack(len(obj)))
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
        self.out.append(b"R" + _REF.pack(ref.offset, ref.nbytes, len(dtype), len(shape)) + dtype
                        + struct.pack(f"<{len(shape)}q", *shape))

    def array(self, tag: bytes, arr: Any, kind: type) -> None:
        dt = arr.dtype
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None or not _DTYPE.match(dt.str):
            raise UnsupportedStateError(kind, [], f"numpy dtype {dt} cannot be stored (object or structured)")
        raw = arr.tobytes(order="C")
        self.out.append(tag)
        self.str_(dt.str)
        self.out.append(_U32.pack(arr.ndim) + b"".join(_Q.pack(d) for d in arr.shape))
        self.out.append(_U64.pack(len(raw)) + raw)

    def other(self, obj: Any, kind: type, depth: int) -> None:
        out, torch, np = self.out, self.torch, self.np
        if isinstance(obj, enum.Enum):
            cls = _lookup(*_class_path(kind))
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
            out.append(b"z" + _U32.pack(len(obj)) + b"".join(_Q.pack(d) for d in obj))
        elif torch is not None and kind is torch.dtype:
            out.append(b"y")
            self.str_(str(obj).removeprefix("torch."))
        elif torch is not None and kind is torch.device:
            out.append(b"v")
            self.str_(str(obj))
        elif kind is complex:
            out.append(b"c" + _DD.pack(obj.real, obj.imag))
        elif kind is bytes or kind is bytearray:
            out.append((b"b" if kind is bytes else b"B") + _U64.pack(len(obj)))
            out.append(bytes(obj))
        elif kind is set or kind is frozenset:
            self.seq(b"S" if kind is set else b"Z", list(obj), depth + 1)
        elif kind is slice:
            self.seq(b"L", (obj.start, obj.stop, obj.step), depth + 1)
        elif isinstance(obj, tuple) and _is_namedtuple(kind):
            cls = _lookup(*_class_path(kind))
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
    enc.out.append(bytes([VERSION]))
    enc.enc(obj)
    return b"".join(enc.out)


# ------------------------------------------------------------------------------------------ decoding
class _Decoder:
    """Reads what _Encoder wrote; every read is bounds-checked (struct.error / CodecError otherwise)."""

    def __init__(self, data: Any, on_ref: Optional[Callable[[TensorRef], Any]]) -> None:
        self.buf = bytes(data)
        self.pos = 0
        self.end = len(self.buf)
        self.on_ref = on_ref
        self.table: dict[int, Callable[[int], Any]] = {
            ord("N"): lambda _d: None, ord("T"): lambda _d: True, ord("F"): lambda _d: False,
            ord("i"): lambda _d: self.q(), ord("f"): lambda _d: self.unpack(_D)[0], ord("s"): lambda _d: self.str_(),
            ord("d"): self.dict_, ord("o"): self.dict_, ord("l"): self.items, ord("t"): lambda d: tuple(self.items(d)),
            ord("R"): lambda _d: self.ref(), ord("I"): lambda _d: int.from_bytes(self.take(self.u32()), "little",
                                                                                 signed=True),
            ord("c"): lambda _d: complex(*self.unpack(_DD)), ord("b"): lambda _d: self.take(self.u64()),
            ord("B"): lambda _d: bytearray(self.take(self.u64())), ord("S"): lambda d: set(self.items(d)),
            ord("Z"): lambda d: frozenset(self.items(d)), ord("L"): lambda d: slice(*self.exactly(3, d)),
            ord("A"): lambda _d: self.array(), ord("a"): lambda _d: self.array()[()],
            ord("z"): self.torch_, ord("y"): self.torch_, ord("v"): self.torch_,
            ord("n"): self.namedtuple, ord("e"): lambda _d: self.enum_(),
        }

    # ---------------------------------------------------------------- primitives
    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise CodecError(f"truncated metadata (wanted {n} bytes at {self.pos} of {self.end})")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def unpack(self, st: struct.Struct) -> tuple:
        out = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return out

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def q(self) -> int:
        return self.unpack(_Q)[0]

    def count(self) -> int:
        n = self.u32()
        if n > self.end - self.pos:       # every item takes at least one byte
            raise CodecError(f"metadata claims {n} items with {self.end - self.pos} bytes left")
        return n

    def str_(self) -> str:
        return self.take(self.u32()).decode("utf-8", "surrogatepass")

    def dims(self) -> tuple:
        return tuple(self.q() for _ in range(self.count()))

    # ---------------------------------------------------------------- values
    def dec(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"metadata nested more than {MAX_DEPTH} levels")
        if self.pos >= self.end:
            raise CodecError("truncated metadata")
        tag = self.buf[self.pos]
        self.pos += 1
        handler = self.table.get(tag)
        if handler is None:
            raise CodecError(f"unknown tag {bytes([tag])!r} at byte {self.pos - 1}")
        return handler(depth + 1)

    def items(self, depth: int) -> list:
        return [self.dec(depth) for _ in range(self.count())]

    def exactly(self, n: int, depth: int) -> list:
        items = self.items(depth)
        if len(items) != n:
            raise CodecError(f"malformed metadata: {len(items)} items where {n} belong")
        return items

    def dict_(self, depth: int) -> Any:
        kind = dict if self.buf[self.pos - 1] == ord("d") else collections.OrderedDict
        n = self.count()
        return kind([(self.dec(depth), self.dec(depth)) for _ in range(n)])

    def ref(self) -> Any:
        offset, nbytes, dtype_len, ndim = self.unpack(_REF)
        dtype = self.take(dtype_len).decode()
        shape = struct.unpack_from(f"<{ndim}q", self.buf, self.pos)
        self.pos += 8 * ndim
        ref = TensorRef(offset, dtype, shape, nbytes)
        if offset < 0 or nbytes < 0 or any(d < 0 for d in shape):
            raise CodecError("negative tensor offset, size or dimension")
        return self.on_ref(ref) if self.on_ref is not None else ref

    def array(self) -> Any:
        import numpy as np
        dtype_name = self.str_()
        dtype = np.dtype(dtype_name) if _DTYPE.match(dtype_name) else None
        if dtype is None or dtype.hasobject or dtype.fields is not None:
            raise CodecError(f"numpy dtype {dtype_name!r} is not allowed")
        shape = self.dims()
        raw = self.take(self.u64())
        count = 1
        for d in shape:
            if d < 0:
                raise CodecError("negative numpy dimension")
            count *= d
        if count * dtype.itemsize != len(raw):
            raise CodecError(f"numpy array of {shape} {dtype} with {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()

    def torch_(self, _depth: int) -> Any:
        import torch
        tag = chr(self.buf[self.pos - 1])
        if tag == "z":
            return torch.Size(self.dims())
        name = self.str_()
        if tag == "v":
            return torch.device(name)
        dtype = getattr(torch, name, None) if _NAME.match(name) and "." not in name else None
        if not isinstance(dtype, torch.dtype):
            raise CodecError(f"unknown torch dtype {name!r}")
        return dtype

    def cls(self, what: str) -> type:
        module, qualname = self.str_(), self.str_()
        cls = _lookup(module, qualname)
        if cls is None:
            raise CodecError(f"{what} class {module}.{qualname} is not loaded in this process (import it before "
                             "restoring); classes are never imported on behalf of the data")
        return cls

    def namedtuple(self, depth: int) -> Any:
        cls = self.cls("namedtuple")
        if not _is_namedtuple(cls):
            raise CodecError(f"{cls.__module__}.{cls.__qualname__} is not a namedtuple class")
        if self.take(1) != b"t":
            raise CodecError("malformed namedtuple")
        return tuple.__new__(cls, self.exactly(len(_own_attr(cls, "_fields")), depth))

    def enum_(self) -> Any:
        cls = self.cls("Enum")
        name = self.str_()
        if not issubclass(cls, enum.Enum):
            raise CodecError(f"{cls.__module__}.{cls.__qualname__} is not an Enum")
        members = _own_attr(cls, "_member_map_")
        if name not in members:
            raise CodecError(f"{cls.__qualname__} has no member {name!r}")
        return members[name]


def loads(data: Any, on_ref: Optional[Callable[[TensorRef], Any]] = None) -> Any:
    """Decode what `dumps` wrote; each TensorRef is replaced by `on_ref(ref)` when given.

    Raises CodecError for anything malformed or not allowed (never runs code named by the data).
    """
    dec = _Decoder(data, on_ref)
    try:
        if dec.take(1) != bytes([VERSION]):
            raise CodecError("metadata of an unknown version")
        obj = dec.dec(0)
        if dec.pos != dec.end:
            raise CodecError(f"{dec.end - dec.pos} stray bytes after the metadata")
        return obj
    except CodecError:
        raise
    except (struct.error, TypeError, ValueError, UnicodeDecodeError, OverflowError, RecursionError,
            KeyError, IndexError, RuntimeError) as exc:
        raise CodecError(f"malformed metadata: {type(exc).__name__}: {exc}") from exc


__all__ = ["dumps", "loads", "TensorRef", "CodecError", "UnsupportedStateError", "MAX_DEPTH"]
