"""One durable checkpoint's objects: a DCP checkpoint that plain torch.distributed.checkpoint loads (at any world
size), which also holds everything hyperpodrun needs to rebuild each rank's snapshot bit for bit.

Layout under `step_<step:012d>/`:
- `__<rank>_0.distcp` (one per rank): what DCP's FileSystemWriter writes - every tensor of the rank's state as
  torch.save bytes, every other value (hyper-parameters, counters) as torch.save bytes - and after them the
  snapshot's own header and metadata block (safe_codec: no pickle) and the few data bytes no DCP item covers
  (alignment, RNG states). DCP reads only the slices its metadata names, so these extra bytes are invisible
  to it.
- `rank<rank>.json`: where each DCP item and each piece of the rank's snapshot sits in that object, with CRC32s.
- `.metadata`: DCP's metadata (pickled by torch, as DCP does), written by the rank that completes the set.
- `manifest.json`, written last: the checkpoint counts only once it exists (tier.py).

Why hyperpodrun never unpickles anything of it: a rank's snapshot is rebuilt from raw byte ranges (the tensor
data inside torch.save's zip entries, located when writing) and the snapshot's own metadata block, and then
decoded by the slot decoder, whose checksum covers every byte of the original snapshot. `.metadata` and the
pickles in the .distcp files are read only by DCP, by a user who loads the checkpoint with it.

Names: the keys of DCP's own flattening of {name: state_dict()} (`model.0.weight`, `opt.state.0.exp_avg`,
`opt.param_groups.0.lr`), so `dcp.load({"model": model.state_dict()}, checkpoint_id=...)` finds them. A value
that differs between ranks (a shard, a per-rank counter) is kept under `rank<r>.<name>` for each rank: no
rank's value silently stands for another's.
"""
from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from typing import Any, Iterator, Mapping, Sequence

from hyperpodrun.errors import SnapshotCorrupt
from hyperpodrun.state.slots import snapshot_io as slot_io

FORMAT = 1
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")


def step_dir(step: int) -> str:
    return f"step_{step:012d}"


def object_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _raw_offset(blob: memoryview, nbytes: int) -> int:
    """Where the tensor's raw bytes start inside torch.save's zip (its single storage, stored uncompressed)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        entries = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
        if len(entries) != 1 or entries[0].compress_type != zipfile.ZIP_STORED or entries[0].file_size != nbytes:
            raise SnapshotCorrupt("torch.save wrote a tensor in an unexpected layout")
        info = entries[0]
    sig, *_rest, name_len, extra_len = _LOCAL_HEADER.unpack_from(blob, info.header_offset)
    if sig != b"PK\x03\x04":
        raise SnapshotCorrupt("torch.save wrote a tensor in an unexpected layout")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _value_crc(leaf: Any) -> int:
    """What tells two ranks' values apart (pickled here only to compare them: nothing reads it back)."""
    try:
        return zlib.crc32(pickle.dumps(leaf, protocol=4))
    except Exception:
        return zlib.crc32(repr(leaf).encode())


def part_chunks(blob: bytearray, what: str, info: dict) -> Iterator[bytes]:
    """The bytes of one rank's `.distcp` object made from its sealed snapshot `blob` (verified by the caller);
    `info` is filled with the part's description (rank<r>.json) once the last chunk has been produced."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    step, payload = slot_io.decode(blob, what, verify=False, copy=False)
    _s, _crc, meta_len, data_len, _chunk = slot_io.header(blob, what)
    head = slot_io.HEADER_LEN + slot_io.aligned(meta_len)
    address = torch.frombuffer(blob, dtype=torch.uint8).data_ptr() + head
    flat, _mapping = flatten_state_dict({name: value for name, (_kind, value) in payload["state"].items()})
    at, crc = 0, 0
    items: list[dict] = []
    covered: dict[int, tuple[int, int]] = {}      # data offset -> (object offset, bytes)
    for fqn, leaf in flat.items():
        out = io.BytesIO()
        item: dict[str, Any] = {"fqn": fqn}
        if isinstance(leaf, torch.Tensor):
            tensor = leaf
            if tensor.untyped_storage().nbytes() != tensor.nbytes or tensor.storage_offset():
                tensor = tensor.clone()            # torch.save writes the whole storage: only this tensor's bytes
            torch.save(tensor, out)
            data = out.getbuffer()
            raw_at = _raw_offset(data, tensor.nbytes) if tensor.nbytes else 0
            item.update(kind="tensor", dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape),
                        same=zlib.crc32(data[raw_at:raw_at + tensor.nbytes]))
            offset = leaf.data_ptr() - address
            if leaf.nbytes and 0 <= offset and offset + leaf.nbytes <= data_len and offset not in covered:
                covered[offset] = (at + raw_at, leaf.nbytes)
        else:
            torch.save(leaf, out)
            data = out.getbuffer()
            item.update(kind="bytes", same=_value_crc(leaf))
        item.update(offset=at, length=len(data), crc=zlib.crc32(data))
        items.append(item)
        crc = zlib.crc32(data, crc)
        at += len(data)
        yield bytes(data)
        del data, out
    view = memoryview(blob)
    pieces: list[list[int]] = []
    rest = bytearray(view[:head])
    head_at = at
    at += len(rest)
    pos = 0
    for offset in sorted(covered) + [data_len]:
        if offset > pos:                            # bytes no DCP item holds: alignment, RNG states, ...
            pieces.append([pos, at + len(rest) - head, offset - pos])
            rest += view[head + pos:head + offset]
        if offset < data_len:
            obj_at, n = covered[offset]
            pieces.append([offset, obj_at, n])
            pos = offset + n
    crc = zlib.crc32(rest, crc)
    at = head_at + len(rest)
    info.update(format=FORMAT, step=step, size=at, crc=crc, head=[head_at, head], data_len=data_len,
                pieces=pieces, items=items)
    yield bytes(rest)


def rebuild(part: Mapping[str, Any], obj: bytes, what: str) -> bytearray:
    """A rank's snapshot (slot bytes) from its part description and its object, every range checked; the caller
    decodes it with the slot checksum verified."""
    if len(obj) != part["size"] or zlib.crc32(obj) != part["crc"]:
        raise SnapshotCorrupt(f"{what}: the object does not match its description (size or CRC32)")
    head_at, head = part["head"]
    data_len = part["data_len"]
    if not (isinstance(head, int) and isinstance(data_len, int) and 0 <= head <= 1 << 30 and
            0 <= data_len <= len(obj) and 0 <= head_at <= len(obj) - head):
        raise SnapshotCorrupt(f"{what}: malformed description")
    out = bytearray(head + data_len)
    out[:head] = obj[head_at:head_at + head]
    pos = 0
    for data_at, obj_at, n in sorted(part["pieces"]):
        if data_at != pos or n < 0 or not 0 <= obj_at <= len(obj) - n:
            raise SnapshotCorrupt(f"{what}: its pieces do not cover the snapshot")
        out[head + pos:head + pos + n] = obj[obj_at:obj_at + n]
        pos += n
    if pos != data_len:
        raise SnapshotCorrupt(f"{what}: its pieces do not cover the snapshot")
    return out


def dcp_metadata(parts: Sequence[Mapping[str, Any]], step: int) -> bytes:
    """DCP's `.metadata` for the ranks' parts (rank r's at index r): a value every rank holds alike under its
    own name, stored once (the lowest rank's copy); a value that differs, under `rank<r>.<name>` per rank."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)
    by_name: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for rank, part in enumerate(parts):
        for item in part["items"]:
            by_name.setdefault(item["fqn"], []).append((rank, item))
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    mapping: dict[str, tuple] = {}
    for fqn, held in by_name.items():
        first = held[0][1]
        alike = len(held) == len(parts) and all(
            (i["kind"], i.get("dtype"), i.get("shape"), i["same"]) ==
            (first["kind"], first.get("dtype"), first.get("shape"), first["same"]) for _r, i in held)
        for rank, item in (held[:1] if alike else held):
            name = fqn if alike else f"rank{rank}.{fqn}"
            mapping[name] = tuple(name.split("."))
            where = _StorageInfo(relative_path=object_name(rank), offset=item["offset"], length=item["length"])
            if item["kind"] == "tensor":
                size = torch.Size(item["shape"])
                zeros = torch.Size([0] * len(size))
                state[name] = TensorStorageMetadata(properties=TensorProperties(dtype=getattr(torch, item["dtype"])),
                                                    size=size, chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)])
                storage[MetadataIndex(name, zeros)] = where
            else:
                state[name] = BytesStorageMetadata()
                storage[MetadataIndex(name)] = where
    meta = Metadata(state_dict_metadata=state, planner_data=mapping, storage_data=storage,
                    storage_meta=StorageMeta(save_id=f"hyperpodrun-{step_dir(step)}"))
    return pickle.dumps(meta, protocol=4)
