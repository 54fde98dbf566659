"""A replica peer's state sent to a rank that lost its snapshots: straight from the peer's live tensors.

Why: a rank that lost its own snapshot slots (replaced after a SIGKILL on a node that lost /dev/shm, or a
new node) gets its state from a replica peer (replicas.py). Sending the peer's slot bytes costs, on GPUs,
a host->device copy of the slot, the send, a device->host copy on the receiver, a decode and one more copy
into the receiver's tensors. A peer whose own objects are still exactly at the restored step (a survivor:
live_state.py) holds the same bytes in its live tensors: it sends those as they are - on GPUs from its GPU
memory over NCCL into tensors allocated on the receiver's GPU - plus the small non-tensor part of the state
(structure, hyper-parameters, RNG, DDP bucket layouts) in the safe_codec encoding: nothing received is
unpickled, and what the receiver builds is what a decoded snapshot holds (snapshot_io.decode), loaded the
same way. A peer without such live state, a copy held on another node ("peer" kind) and state that has
DTensors or non-dense tensors go the old way: the slot's bytes.

Wire, per (donor, receiver, kind) pair of the restore plan, in the plan's order (every rank walks the
same list, so the point-to-point calls pair up): a header (path, n) and its MAC tag, then n bytes and
their tag: the slot (path SLOT) or the metadata (path LIVE: the payload with each tensor replaced by a
TensorRef whose offset is the tensor's index); then, for LIVE, the bytes of every non-empty tensor in index
order and, on a CPU wire, a tag over them. The donor picks the path and the header tells the receiver, so
both sides always agree. On NCCL everything travels in CUDA tensors on the current device; tensors that
live elsewhere (an optimizer's step counters on the host) go through a staging copy.

Authentication (wire_auth.py): every tag is an HMAC under the workers' key over the run, generation, world
size, donor, receiver, kind and step, and the message; the receiver checks the header's tag before it
allocates anything for the body, caps the announced length (what the host has available; metadata at most
METADATA_MAX), checks the body's tag before decoding it, and the tensors' tag before returning them. What is
not MACed: on NCCL, the live tensors themselves. They go device to device and never reach the host; a MAC
over them would need a device->host copy or a hashing pass over all of the state on the GPU, which is the
cost this path exists to avoid. They arrive only from the donor of an authenticated header and metadata, over
the job's NCCL communicator (whose members the group's formation admitted), and their count, dtypes and
shapes are those of the MACed metadata. On a CPU wire (gloo) they reach the host and are MACed. Nothing
received is unpickled.
"""
from __future__ import annotations

import hmac
import logging
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from hyperpodrun.errors import CodecError, ProtocolError, SnapshotCorrupt, UnsupportedStateError
from hyperpodrun.state.restore import host_bytes
from hyperpodrun.state.codec import safe_codec
from hyperpodrun.state.codec.safe_codec import TensorRef
from hyperpodrun.state.slots.snapshot_io import ref_dtype
from hyperpodrun.state.state_dicts import device_of
from hyperpodrun.state.restore.wire_auth import TAG_BYTES, Channel, current, feed

log = logging.getLogger("hyperpodrun.runtime")

SLOT, LIVE = 0, 1
_HEAD = struct.Struct("<qq")       # path, body length
#: the largest metadata block a receiver accepts (the non-tensor part of the state: structure,
#: hyper-parameters, RNG states, DDP layouts; megabytes for large models)
METADATA_MAX = 1 << 30
_BATCH = 256        # point-to-point operations per batch_isend_irecv (one NCCL group each)


@dataclass
class Received:
    """What a receiver got from its donor: a slot's bytes (via "slot") or a decoded payload (via "live")."""

    donor: int
    kind: str
    via: str
    blob: Union[bytes, bytearray] = b""
    payload: Optional[dict] = None


class _Pending:
    """A tensor still to be received: where it stands in the decoded metadata."""

    __slots__ = ("ref",)

    def __init__(self, ref: TensorRef) -> None:
        self.ref = ref


def wire_device() -> Any:
    """The device tensors travel on over the job's default group: the host where the group has a CPU backend
    (gloo, or the gloo half of `cpu:gloo,cuda:nccl`), else the current CUDA device (an NCCL-only group:
    nccl-legacy or nccl2, however the backend was spelled - torch 2.15's "nccl" is nccl2, and its
    "nccl-legacy" is not `== "nccl"`). Read from the group's own device types, not the name the user typed."""
    import torch
    import torch.distributed as dist
    try:
        types = getattr(dist.distributed_c10d._get_default_group(), "_device_types", None)
    except (ValueError, RuntimeError):   # no default group of torch's own (a wrapped or stand-in dist)
        types = None
    if types is not None:
        on_host = any(torch.device(t).type == "cpu" for t in types)
    else:   # a torch without the attribute: the name's rule
        on_host = "nccl" not in str(dist.get_backend()).lower()
    return torch.device("cpu") if on_host else torch.device("cuda", torch.cuda.current_device())


def placement(state: Mapping[str, Any]) -> dict[str, Any]:
    """Where the receiver's tensors of each entry go: the device of the object's own state (an optimizer's
    parameters, a module's first parameter or buffer); the host for plain values or an object without tensors."""
    import torch
    out: dict[str, Any] = {}
    for name, obj in state.items():
        device = device_of(obj)
        if device is None and isinstance(obj, torch.nn.Module):
            first: Any = next(iter(obj.parameters()), None)
            if first is None:
                first = next(iter(obj.buffers()), None)
            device = first.device if first is not None else None
        out[name] = device if device is not None and hasattr(obj, "state_dict") else torch.device("cpu")
    return out


def encode(payload: Mapping[str, Any]) -> Optional[tuple[bytes, list[Any]]]:
    """The metadata and the tensors (dense, contiguous, detached) of a snapshot payload; None when some
    tensor only goes in a slot (a DTensor shard, a sparse or quantized tensor) or a value cannot be encoded."""
    import torch
    tensors: list[Any] = []

    def on_tensor(obj: Any) -> TensorRef:
        if hasattr(obj, "placements") and hasattr(obj, "to_local"):   # only the slot path carries these
            raise UnsupportedStateError(type(obj), [], "a DTensor shard")
        t = obj.detach()
        if t.layout != torch.strided or t.is_quantized:
            raise UnsupportedStateError(type(obj), [], f"a {t.layout} tensor (only dense tensors)")
        if not t.is_contiguous():
            t = t.contiguous()
        tensors.append(t)
        return TensorRef(len(tensors) - 1, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                         t.numel() * t.element_size())
    try:
        return safe_codec.dumps(payload, on_tensor), tensors
    except UnsupportedStateError as exc:
        log.info("the state goes as slot bytes, not live tensors: %s is a %s%s", exc.where(), exc.kind.__qualname__,
                 f" ({exc.why})" if exc.why else "")
        return None


def decode(meta: bytes, devices: Mapping[str, Any]) -> tuple[dict, list[Any]]:
    """The payload the metadata describes with an empty tensor in place of each TensorRef, and those tensors
    in index order. A non-scalar tensor of entry `name` of the state is allocated on `devices[name]`,
    everything else on the host (as a decoded slot has it before CheckpointManager._load places it).
    Raises SnapshotCorrupt for metadata that does not describe a payload."""
    import torch
    refs: list[TensorRef] = []

    def on_ref(ref: TensorRef) -> _Pending:
        ref_dtype(ref)          # raises CodecError for an unknown dtype or a size that does not fit
        refs.append(ref)
        return _Pending(ref)
    try:
        payload = safe_codec.loads(meta, on_ref)
    except CodecError as exc:
        raise SnapshotCorrupt(f"state streamed by a replica peer: {exc}") from None
    if sorted(r.offset for r in refs) != list(range(len(refs))):
        raise SnapshotCorrupt("state streamed by a replica peer: its tensor indices are not 0..n-1, each once")
    if not (isinstance(payload, dict) and isinstance(payload.get("state"), dict) and {"step", "rng"} <= set(payload)
            and all(isinstance(e, tuple) and len(e) == 2 for e in payload["state"].values())):
        raise SnapshotCorrupt("state streamed by a replica peer: not a snapshot payload")
    tensors: list[Any] = [None] * len(refs)
    cpu = torch.device("cpu")

    def fill(obj: Any, device: Any) -> Any:
        if isinstance(obj, _Pending):
            ref = obj.ref
            t = torch.empty(ref.shape, dtype=getattr(torch, ref.dtype), device=device if ref.shape else cpu)
            tensors[ref.offset] = t
            return t
        if isinstance(obj, dict):
            out = type(obj)()
            for k, v in obj.items():
                out[k] = fill(v, device)
            return out
        if isinstance(obj, (list, tuple)):
            items = [fill(v, device) for v in obj]
            if type(obj) in (list, tuple):
                return type(obj)(items)
            kind: Any = type(obj)
            return tuple.__new__(kind, items)   # a namedtuple, as safe_codec builds it (its own __new__ not run)
        return obj
    out = {k: fill(v, cpu) for k, v in payload.items() if k != "state"}
    out["state"] = {name: (kind, fill(saved, devices.get(name, cpu) if kind == "sd" else cpu))
                    for name, (kind, saved) in payload["state"].items()}
    if any(t is None for t in tensors):
        raise SnapshotCorrupt("state streamed by a replica peer: a tensor inside a set (not carried)")
    return out, tensors


def _as_bytes(t: Any) -> Any:
    import torch
    return t.reshape(-1).view(torch.uint8)


def _p2p(tensors: Sequence[Any], peer: int, send: bool) -> None:
    """Send or receive `tensors` (uint8, on the wire device) in order, a batch of operations at a time."""
    import torch.distributed as dist
    op = dist.isend if send else dist.irecv
    for start in range(0, len(tensors), _BATCH):
        for work in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for t in tensors[start:start + _BATCH]]):
            work.wait()


class _Pair:
    """One (donor, receiver, kind) transfer of a restore of `step`: its wire device and its MACs."""

    def __init__(self, donor: int, receiver: int, kind: str, step: int, wire: Any, channel: Channel) -> None:
        self.donor, self.receiver, self.kind, self.step, self.wire, self.channel = \
            donor, receiver, kind, step, wire, channel

    def tag(self, what: str, *parts: Any) -> bytes:
        return self.channel.tag(f"replica-{what}", self.donor, self.receiver, self.kind, str(self.step), *parts)

    def check(self, tag: Any, what: str, *parts: Any) -> None:
        if not self.channel.check(tag, f"replica-{what}", self.donor, self.receiver, self.kind, str(self.step), *parts):
            raise ProtocolError(f"rank {self.donor} sent a replica {what} without the job's MAC (from a process that "
                                "does not hold the workers' key, or from another generation, run, rank or restore)")

    def tensors_tag(self, head: bytes, tensors: Sequence[Any]) -> bytes:
        """The MAC over the tensors' bytes; only tensors that reach the host (a CPU wire) are summed."""
        m = self.channel.mac("replica-tensors", self.donor, self.receiver, self.kind, str(self.step))
        if m is None:
            return bytes(TAG_BYTES)
        feed(m, head)
        for t in tensors:
            feed(m, host_bytes.view(t))
        return m.digest()

    def send_bytes(self, path: int, body: Any) -> bytes:
        """The header (path, length) with its tag, then the body with its tag; returns the header."""
        import torch.distributed as dist
        head = _HEAD.pack(path, len(body))
        dist.send(host_bytes.tensor(bytearray(head + self.tag("head", head))).to(self.wire), dst=self.receiver)
        out = bytearray(len(body) + TAG_BYTES)
        out[:len(body)] = body
        out[len(body):] = self.tag("body", head, body)
        dist.send(host_bytes.tensor(out).to(self.wire), dst=self.receiver)
        return head

    def receive_bytes(self) -> tuple[int, bytes, bytearray]:
        """(path, header, body) the donor sent, each part's tag checked, the length checked against
        `max_body` before anything is allocated for it."""
        import torch
        import torch.distributed as dist
        first = torch.empty(_HEAD.size + TAG_BYTES, dtype=torch.uint8, device=self.wire)
        dist.recv(first, src=self.donor)
        raw = bytes(host_bytes.copy_out(first))
        head = raw[:_HEAD.size]
        self.check(raw[_HEAD.size:], "head", head)
        path, size = _HEAD.unpack(head)
        limit = max_body(path)
        if path not in (SLOT, LIVE) or not 0 <= size <= limit:
            raise ProtocolError(f"rank {self.donor} sent a malformed replica header ({path}, {size} bytes; at most "
                                f"{limit})")
        if self.wire.type == "cpu":
            body = bytearray(size + TAG_BYTES)
            landing = host_bytes.tensor(body)
            dist.recv(landing, src=self.donor)
            del landing                     # the bytearray may be resized once no tensor shares it
        else:
            data = torch.empty(size + TAG_BYTES, dtype=torch.uint8, device=self.wire)
            dist.recv(data, src=self.donor)
            body = host_bytes.copy_out(data)
            del data
        tag = bytes(body[size:])
        del body[size:]
        self.check(tag, "body", head, body)
        return path, head, body


def max_body(path: int) -> int:
    """The longest body a receiver accepts: what the host has available (a slot lands there whole; metadata
    at most METADATA_MAX)."""
    import psutil
    available = int(psutil.virtual_memory().available)
    return min(available, METADATA_MAX) if path == LIVE else available


def _send_live(meta: bytes, tensors: Sequence[Any], pair: _Pair) -> None:
    import torch.distributed as dist
    head = pair.send_bytes(LIVE, meta)
    out = [_as_bytes(t if t.device == pair.wire else t.to(pair.wire)) for t in tensors if t.numel()]
    _p2p(out, pair.receiver, send=True)
    if pair.wire.type == "cpu":
        dist.send(host_bytes.tensor(bytearray(pair.tensors_tag(head, out))), dst=pair.receiver)


def _receive(pair: _Pair, devices: Mapping[str, Any]) -> Received:
    import torch
    import torch.distributed as dist
    donor, kind, wire = pair.donor, pair.kind, pair.wire
    path, head, raw = pair.receive_bytes()
    if path == SLOT:
        log.info("received my state from rank %d (%s, slot bytes, %d bytes)", donor, kind, len(raw))
        return Received(donor, kind, "slot", blob=raw)
    payload, tensors = decode(bytes(raw), devices)
    landing = [t for t in tensors if t.numel()]
    staged = [t if t.device == wire else torch.empty_like(t, device=wire) for t in landing]
    _p2p([_as_bytes(t) for t in staged], donor, send=False)
    if wire.type == "cpu":
        tag = bytearray(TAG_BYTES)
        dist.recv(host_bytes.tensor(tag), src=donor)
        if not hmac.compare_digest(bytes(tag), pair.tensors_tag(head, [_as_bytes(t) for t in staged])):
            raise ProtocolError(f"rank {donor} sent replica tensors without the job's MAC")
    for t, s in zip(landing, staged):
        if s is not t:
            t.copy_(s)
    log.info("received my state from rank %d (%s, live tensors: %d tensors, %d bytes)", donor, kind,
             len(tensors), sum(t.numel() * t.element_size() for t in tensors))
    return Received(donor, kind, "live", payload=payload)


def exchange(pairs: Sequence[tuple[int, int, str]], me: int,
             live_for: Callable[[int, str], Optional[Mapping[str, Any]]], blob_for: Callable[[int, str], Any],
             devices: Mapping[str, Any], channel: Optional[Channel] = None, step: int = 0) -> Optional[Received]:
    """Send what I donate and return what I receive (None if I receive nothing).

    pairs: the plan's (donor, receiver, kind) transfers, the same list on every rank. As a donor, I send
    `live_for(receiver, kind)` - a snapshot payload made of my own objects' tensors, or None - as live
    tensors when it can go that way, else the slot bytes `blob_for(receiver, kind)`. As a receiver, my
    tensors are allocated per `devices` (see decode; `placement(state)` gives them).
    channel, step: the MACs' key and context (wire_auth.py; default: this process's, from its environment)
    and the step restored, which every message is bound to.
    """
    wire = wire_device()
    channel = channel if channel is not None else current()
    received: Optional[Received] = None
    for donor, receiver, kind in pairs:
        pair = _Pair(donor, receiver, kind, step, wire, channel)
        if me == donor:
            live = live_for(receiver, kind)
            encoded = encode(live) if live is not None else None
            if encoded is not None:
                _send_live(encoded[0], encoded[1], pair)
                log.info("sent my live state to rank %d (%d tensors)", receiver, len(encoded[1]))
            else:
                pair.send_bytes(SLOT, blob_for(receiver, kind))
                log.info("sent my snapshot slot to rank %d (%s)", receiver, kind)
        elif me == receiver:
            received = _receive(pair, devices)
    return received


__all__ = ["Received", "SLOT", "LIVE", "decode", "encode", "exchange", "placement", "wire_device"]
