"""The wire format of the safe metadata encoding (hyperpodrun/state/codec/safe_codec.py): its version, tags,
structs, the names a class may have, and how a class named by the data is found without running code.

Shared by the writer (safe_codec.dumps) and the reader (codec_read.loads)."""
from __future__ import annotations

import re
import struct
import sys
import types
from typing import Any, NamedTuple, Optional

VERSION = 1
#: containers nested deeper than this are refused (real states nest a few levels)
MAX_DEPTH = 100

Q = struct.Struct("<q")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
D = struct.Struct("<d")
DD = struct.Struct("<dd")
REF = struct.Struct("<qqBB")        # offset, nbytes, dtype name length, ndim
DTYPE = re.compile(r"^[<>|=]?[biufcmMSUV]\d{1,4}(\[[A-Za-z0-9]{1,8}\])?$")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class TensorRef(NamedTuple):
    """Where a tensor's bytes sit (offset or index, as the caller defines), its dtype name and shape."""

    offset: int
    dtype: str
    shape: tuple
    nbytes: int


def class_path(kind: type) -> tuple[str, str]:
    """(module, qualified name) by which the reader finds `kind` again."""
    return kind.__module__, kind.__qualname__


def own_attr(cls: type, name: str) -> Any:
    """A class attribute from the namespaces of its MRO (no descriptors or metaclass hooks run)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise KeyError(name)


def lookup(module: str, qualname: str) -> Optional[type]:
    """The class `module`.`qualname` if that module is loaded; None otherwise.

    Never imports, and reads only the module's and the classes' own namespaces (no __getattr__ hooks)."""
    if not NAME.match(module) or not NAME.match(qualname):
        return None
    obj: Any = sys.modules.get(module)
    if not isinstance(obj, types.ModuleType):
        return None
    for part in qualname.split("."):
        if not isinstance(obj, (type, types.ModuleType)):
            return None
        obj = vars(obj).get(part)
    return obj if isinstance(obj, type) else None


def is_namedtuple(kind: type) -> bool:
    try:
        fields = own_attr(kind, "_fields")
    except KeyError:
        return False
    return issubclass(kind, tuple) and isinstance(fields, tuple)
