"""What each rank holds for a restore (its `Inventory`), and how the inventories reach every rank: sealed
with a MAC, bounded, and checked field by field.

Why: `plan_restore` (restore_plan.py) picks the step every rank restores from what the ranks say they hold.
An inventory that a process outside the job sent (one that reached the group as a rank), or a malformed one,
must not choose that step - "I hold step 1000000" would make every rank load the sender's state - nor end
the job: it is that sender's fault, not a lost state. So an inventory travels as a tag and JSON (never
pickled): the tag is a MAC under the workers' key (wire_auth.py) over the run, generation, world size, the
sending rank and the JSON; its announced length is capped (MAX_WIRE_BYTES) before anything is allocated for
it; the JSON is decoded strictly (UTF-8, no NaN, bounded nesting and number sizes: RecursionError,
UnicodeDecodeError and oversized numbers become ProtocolError); steps must be in 0 <= s < 2**63 and ranks in
range(world). An inventory that fails any of this is *refused*: its sender counts as holding nothing, and
the plan says so (restore_plan.py turns a state that then survives nowhere into a ProtocolError, retried in
the next round, instead of StateLostError). A rank whose inventory lacked the MAC is moreover sent no state
(`Gathered.check_receivers`: the round is tried again), so a process without the key that sits in a rank's
seat gets nothing from a replica. Every rank checks every inventory, its own included, with the same key and
bytes, so every rank reaches the same plan.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, NamedTuple, Optional, Sequence, TypedDict

from hyperpodrun.errors import ProtocolError
from hyperpodrun.state.restore import host_bytes
from hyperpodrun.state.restore.wire_auth import TAG_BYTES, Channel

log = logging.getLogger("hyperpodrun.runtime")

#: the largest inventory a rank accepts (tag + JSON); a real one is well under a kilobyte (two slots, the
#: fallback files, the copies of one peer's two slots)
MAX_WIRE_BYTES = 1 << 20
#: steps per list; a rank keeps two slots and its fallback files
MAX_STEPS = 4096
STEP_LIMIT = 1 << 63
_RANK_KEY = re.compile(r"(0|[1-9][0-9]{0,9})")


class Inventory(TypedDict):
    """What one rank holds (gathered as JSON: plain lists and dicts)."""

    shm: list[int]                    # steps in its own shared-memory slots
    disk: list[int]                   # steps in its disk fallback
    latest: Optional[int]             # the newest step it saved in this process (None: none)
    copies: dict[int, list[int]]      # source rank -> steps of that rank's slots it keeps (peer copies)
    #: this process has run since the job's first generation and never sealed (or restored) a snapshot: no
    #: step was ever committed by every rank, so the job's committed state is its start
    never_committed: bool
    #: the step whose values this rank's objects still hold (its last save() call, certified by fingerprint:
    #: live_state.py), whether or not a snapshot of it was completed; None: none
    live: Optional[int]
    #: the step the fault interrupted here (the last caller.progress() before the restart); None: not known
    at: Optional[int]


class Gathered(NamedTuple):
    """Every rank's inventory (rank r's at index r) and the ranks whose inventory was refused (rank -> why);
    a refused rank's entry holds nothing. `forged`: the refused ranks whose tag did not verify."""

    inventories: list[Inventory]
    refused: dict[int, str]
    forged: frozenset[int] = frozenset()

    def check_receivers(self, pairs: Sequence[tuple[int, int, str]]) -> None:
        """ProtocolError when the plan sends state to a rank whose inventory did not carry the job's MAC: a
        process without the workers' key is sent nothing (the round is tried again); a key holder whose
        inventory was merely malformed gets its state like any rank that holds nothing."""
        to = sorted({receiver for _d, receiver, _k in pairs if receiver in self.forged})
        if to:
            raise ProtocolError(f"rank(s) {to} would be sent state, but their restore inventory did not carry the "
                                "job's MAC: nothing is sent to them; the restore is tried again next round")


def nothing() -> Inventory:
    """The inventory of a rank that holds nothing (what a refused inventory counts as)."""
    return {"shm": [], "disk": [], "latest": None, "copies": {}, "never_committed": False, "live": None,
            "at": None}


def encode(mine: Inventory, channel: Channel, rank: int) -> bytes:
    """The wire form of this rank's inventory: the MAC tag, then the JSON."""
    body = json.dumps(mine, separators=(",", ":")).encode()
    return channel.tag("inventory", rank, -1, body) + body


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a value an inventory holds")


def _step(v: Any) -> bool:
    return type(v) is int and 0 <= v < STEP_LIMIT


def parse(raw: Any, rank: int, world: int) -> Inventory:
    """A peer's inventory (decoded JSON) as plain typed values, every step in 0 <= s < 2**63 and every rank in
    range(world); ProtocolError (a ValueError) naming the rank otherwise."""
    def steps(v: Any, what: str) -> list[int]:
        if not isinstance(v, list) or len(v) > MAX_STEPS or not all(_step(x) for x in v):
            raise ProtocolError(f"rank {rank} sent a restore inventory with a malformed step list ({what}: steps "
                                f"are ints in 0 <= s < 2**63): {v!r:.200}")
        return v
    if not isinstance(raw, dict) or set(raw) != set(Inventory.__annotations__):
        raise ProtocolError(f"rank {rank} sent a malformed restore inventory: {raw!r:.200}")
    never, copies = raw["never_committed"], raw["copies"]
    if type(never) is not bool or not isinstance(copies, dict) or len(copies) > world \
            or any(raw[k] is not None and not _step(raw[k]) for k in ("latest", "live", "at")):
        raise ProtocolError(f"rank {rank} sent a malformed restore inventory: {raw!r:.200}")
    held: dict[int, list[int]] = {}
    for src, v in copies.items():               # JSON made the rank numbers strings
        if not isinstance(src, (str, int)) or not _RANK_KEY.fullmatch(str(src)) or int(src) >= world:
            raise ProtocolError(f"rank {rank} sent a restore inventory with malformed copies (source ranks are in "
                                f"0..{world - 1}): {copies!r:.200}")
        held[int(src)] = steps(v, f"copies of rank {src}")
    return {"shm": steps(raw["shm"], "shm"), "disk": steps(raw["disk"], "disk"), "latest": raw["latest"],
            "copies": held, "never_committed": never, "live": raw["live"], "at": raw["at"]}


def authentic(blob: bytes, rank: int, channel: Channel) -> bool:
    """Whether `blob` carries the MAC of an inventory that rank `rank` sent in this channel's generation."""
    return len(blob) >= TAG_BYTES and channel.check(blob[:TAG_BYTES], "inventory", rank, -1, blob[TAG_BYTES:])


def check(blob: bytes, rank: int, channel: Channel) -> Inventory:
    """The inventory rank `rank` sent as `blob` (encode's form); ProtocolError naming the rank when its tag
    does not verify (not sent by a holder of the workers' key as that rank, for this generation) or it does
    not parse."""
    if len(blob) < TAG_BYTES or len(blob) > MAX_WIRE_BYTES:
        raise ProtocolError(f"rank {rank} sent a restore inventory of {len(blob)} bytes ({TAG_BYTES}.."
                            f"{MAX_WIRE_BYTES})")
    if not authentic(blob, rank, channel):
        raise ProtocolError(f"rank {rank} sent a restore inventory without the job's MAC (from a process that does "
                            f"not hold the workers' key, or from another generation, run or rank)")
    try:
        raw = json.loads(blob[TAG_BYTES:].decode("utf-8"), parse_constant=_no_constant)
    except (RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"rank {rank} sent a restore inventory that is not JSON: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return parse(raw, rank, channel.world)


def gather(mine: Inventory, channel: Channel) -> Gathered:
    """Every rank's inventory (just `mine` without a process group), as byte tensors over the job's default
    group: the lengths first (each capped at MAX_WIRE_BYTES before any buffer is sized by them), then the
    blobs, each checked (`check`); a rank whose inventory fails is refused and holds nothing."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return Gathered([mine], {})
    world, me = dist.get_world_size(), dist.get_rank()
    from hyperpodrun.state.restore.replica_stream import wire_device
    dev = wire_device()     # what the group carries: the host on gloo, the GPU on nccl-legacy / nccl2
    blob = encode(mine, channel, me)
    size = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    fits = [TAG_BYTES <= n <= MAX_WIRE_BYTES for n in lengths]
    width = max([n for n, ok in zip(lengths, fits) if ok], default=0)
    buf = torch.zeros(max(width, 1), dtype=torch.uint8)
    if fits[me]:
        buf[:len(blob)] = host_bytes.tensor(bytearray(blob))
    buf = buf.to(dev)
    received = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(received, buf)
    every = host_bytes.copy_out(torch.stack(received))
    out: list[Inventory] = []
    refused: dict[int, str] = {}
    forged: set[int] = set()
    for rank, n in enumerate(lengths):
        try:
            if not fits[rank]:
                raise ProtocolError(f"rank {rank} announced a restore inventory of {n} bytes ({TAG_BYTES}.."
                                    f"{MAX_WIRE_BYTES})")
            start = rank * buf.numel()
            sent = bytes(every[start:start + n])
            if not authentic(sent, rank, channel):
                forged.add(rank)
            out.append(check(sent, rank, channel))
        except ProtocolError as exc:
            refused[rank] = str(exc)
            out.append(nothing())
            log.warning("%s: it is refused and counts as holding nothing", exc)
    return Gathered(out, refused, frozenset(forged))


__all__ = ["Gathered", "authentic", "Inventory", "MAX_WIRE_BYTES", "check", "encode", "gather", "nothing", "parse"]
