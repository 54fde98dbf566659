"""The reader of the safe metadata encoding (hyperpodrun/state/codec/safe_codec.py explains what it carries and
why). It only ever builds the values listed there; every read is bounds-checked, and anything malformed or
naming a class that is not loaded is a CodecError - never code run on behalf of the data."""
from __future__ import annotations

import collections
import enum
import struct
from typing import Any, Callable, Optional

from hyperpodrun.errors import CodecError
from hyperpodrun.state.codec import codec_format as F


class _Decoder:
    """Reads what _Encoder wrote; every read is bounds-checked (struct.error / CodecError otherwise)."""

    def __init__(self, data: Any, on_ref: Optional[Callable[[F.TensorRef], Any]]) -> None:
        self.buf = bytes(data)
        self.pos = 0
        self.end = len(self.buf)
        self.on_ref = on_ref
        self.table: dict[int, Callable[[int], Any]] = {
            ord("N"): lambda _d: None, ord("T"): lambda _d: True, ord("F"): lambda _d: False,
            ord("i"): lambda _d: self.q(), ord("f"): lambda _d: self.unpack(F.D)[0], ord("s"): lambda _d: self.str_(),
            ord("d"): self.dict_, ord("o"): self.dict_, ord("l"): self.items, ord("t"): lambda d: tuple(self.items(d)),
            ord("R"): lambda _d: self.ref(), ord("I"): lambda _d: int.from_bytes(self.take(self.u32()), "little",
                                                                                 signed=True),
            ord("c"): lambda _d: complex(*self.unpack(F.DD)), ord("b"): lambda _d: self.take(self.u64()),
            ord("B"): lambda _d: bytearray(self.take(self.u64())), ord("S"): lambda d: set(self.items(d)),
            ord("Z"): lambda d: frozenset(self.items(d)), ord("L"): lambda d: slice(*self.exactly(3, d)),
            ord("A"): lambda _d: self.array(), ord("a"): lambda _d: self.array()[()],
            ord("z"): self.torch_, ord("y"): self.torch_, ord("v"): self.torch_,
            ord("n"): self.namedtuple, ord("e"): lambda _d: self.enum_(),
        }

    def release(self) -> None:
        """Break the decoder's reference cycle (its dispatch table's lambdas hold it) and drop `on_ref`, which
        may hold a view of a mapped slot: without this the mapping lives until a full garbage collection -
        which, after HPWrapper's gc.freeze, may be never on the restart path (a leaked descriptor and mapping
        per restore)."""
        self.table = {}
        self.on_ref = None
        self.buf = b""

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
        return self.unpack(F.U32)[0]

    def u64(self) -> int:
        return self.unpack(F.U64)[0]

    def q(self) -> int:
        return self.unpack(F.Q)[0]

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
        if depth > F.MAX_DEPTH:
            raise CodecError(f"metadata nested more than {F.MAX_DEPTH} levels")
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
        offset, nbytes, dtype_len, ndim = self.unpack(F.REF)
        dtype = self.take(dtype_len).decode()
        shape = struct.unpack_from(f"<{ndim}q", self.buf, self.pos)
        self.pos += 8 * ndim
        ref = F.TensorRef(offset, dtype, shape, nbytes)
        if offset < 0 or nbytes < 0 or any(d < 0 for d in shape):
            raise CodecError("negative tensor offset, size or dimension")
        return self.on_ref(ref) if self.on_ref is not None else ref

    def array(self) -> Any:
        import numpy as np
        dtype_name = self.str_()
        dtype = np.dtype(dtype_name) if F.DTYPE.match(dtype_name) else None
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
        dtype = getattr(torch, name, None) if F.NAME.match(name) and "." not in name else None
        if not isinstance(dtype, torch.dtype):
            raise CodecError(f"unknown torch dtype {name!r}")
        return dtype

    def cls(self, what: str) -> type:
        module, qualname = self.str_(), self.str_()
        cls = F.lookup(module, qualname)
        if cls is None:
            raise CodecError(f"{what} class {module}.{qualname} is not loaded in this process (import it before "
                             "restoring); classes are never imported on behalf of the data")
        return cls

    def namedtuple(self, depth: int) -> Any:
        cls = self.cls("namedtuple")
        if not F.is_namedtuple(cls):
            raise CodecError(f"{cls.__module__}.{cls.__qualname__} is not a namedtuple class")
        if self.take(1) != b"t":
            raise CodecError("malformed namedtuple")
        return tuple.__new__(cls, self.exactly(len(F.own_attr(cls, "_fields")), depth))

    def enum_(self) -> Any:
        cls = self.cls("Enum")
        name = self.str_()
        if not issubclass(cls, enum.Enum):
            raise CodecError(f"{cls.__module__}.{cls.__qualname__} is not an Enum")
        members = F.own_attr(cls, "_member_map_")
        if name not in members:
            raise CodecError(f"{cls.__qualname__} has no member {name!r}")
        return members[name]


def loads(data: Any, on_ref: Optional[Callable[[F.TensorRef], Any]] = None) -> Any:
    """Decode what `dumps` wrote; each TensorRef is replaced by `on_ref(ref)` when given.

    Raises CodecError for anything malformed or not allowed (never runs code named by the data).
    """
    dec = _Decoder(data, on_ref)
    try:
        if dec.take(1) != bytes([F.VERSION]):
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
    finally:
        dec.release()
