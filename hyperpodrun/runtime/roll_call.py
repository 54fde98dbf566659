"""The roll call: right after a default process group forms, every member proves it knows the workers' key.

Why: the workers' store of a generation is reachable by anyone who can reach its address (on one node: every
user of the host, through loopback). A process outside the job can join the group as a rank whose real
process is slow to start, and everything the job sends that rank (DDP's broadcast of the initial weights,
restored state) would be its. The group itself cannot tell: its rendezvous carries no credential. So before
any user collective each rank sends a proof - an HMAC under a key derived from the workers' key (which only
the agent's workers hold, hyperpodrun/auth.py) over the job, the generation, the round's store's port (fresh
in every round: the nonce GO and the spawn environment carry), the group's size and its own rank - and
all ranks gather all proofs over the new group and check every one (keyed BLAKE2b: a microsecond each). A rank whose proof is wrong is not one
of ours; no rank goes on (so none sends it anything), the generation fails with RollCallError naming it and
the uid /proc/net/tcp shows connected to the job's ports (hyperpodrun/netwatch.py), and the agent retries the
round on a fresh store.

Only fixed-size bytes cross the network (32 per rank); nothing read from it is decoded beyond a compare.
A member that says nothing (an outsider that took a place and stays silent) would hold the others for gloo's
timeout; with another uid at the ports the roll call gives up after SILENT_S instead.

HYPERPODRUN_ROLL_CALL=0 turns it off (hyperpodrun/launch/settings.py). Outside hyperpodrun (no workers' key) it does
nothing. The cost: one 32-byte all-gather (scripts/bench/roll_call_bench.py).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

from hyperpodrun import auth, netwatch
from hyperpodrun import env as E
from hyperpodrun.errors import RollCallError

log = logging.getLogger("hyperpodrun.runtime")

PROOF_BYTES = 32
#: seconds a gloo group's members have to answer: they all left init_process_group together (gloo connects
#: the whole mesh before it returns), so only a member that is not running our code is late
GLOO_ANSWER_S = 60.0
#: seconds the proofs may be missing while a process of another uid is connected to the round's store or to
#: this rank's ports before the roll call fails: every honest member left init_process_group with this one and
#: answers within milliseconds, so a silent member beside an outsider at the ports is the outsider
SILENT_S = 2.0
#: seconds between two looks at the proofs (and, past SILENT_S, at the ports) while they are missing
_LOOK_S = 0.25


@dataclass(frozen=True)
class Roll:
    """What every honest member of one group agrees on, and this member's place in it."""

    run_id: str
    generation: int
    store: str          # the port of the round's store: fresh in every round (not its address, which nodes may
                        # write differently: a host name on one, an IP on another)
    world: int
    rank: int

    def context(self) -> bytes:
        parts = (self.run_id.encode(), str(self.generation).encode(), self.store.encode(), str(self.world).encode())
        return b"roll-call/" + b"".join(struct.pack("<I", len(p)) + p for p in parts)


@functools.lru_cache(maxsize=4)
def roll_key(worker_key: bytes) -> bytes:
    """The roll call's own key, one-way from the workers' key."""
    return auth.derive(worker_key, "roll-call")


def proof(key: bytes, roll: Roll, rank: Optional[int] = None) -> bytes:
    """The proof rank `rank` (default: roll.rank) gives in `roll`, under `key` (roll_key): keyed BLAKE2b, one
    C call (every rank computes one per member of the group)."""
    who = roll.rank if rank is None else rank
    return hashlib.blake2b(roll.context() + struct.pack("<Q", who), key=key, digest_size=PROOF_BYTES).digest()


def expected(key: bytes, roll: Roll) -> bytes:
    """Every member's proof, in rank order: what the all-gather must return."""
    context = roll.context()
    return b"".join(hashlib.blake2b(context + struct.pack("<Q", r), key=key, digest_size=PROOF_BYTES).digest()
                    for r in range(roll.world))


def failed_ranks(key: bytes, roll: Roll, gathered: bytes, want: Optional[bytes] = None) -> list[int]:
    """The ranks whose proof in `gathered` (PROOF_BYTES per rank, in rank order) is wrong."""
    want = expected(key, roll) if want is None else want
    if len(gathered) != len(want):
        return list(range(roll.world))
    if hmac.compare_digest(gathered, want):
        return []
    return [r for r in range(roll.world) if not hmac.compare_digest(gathered[r * PROOF_BYTES:(r + 1) * PROOF_BYTES],
                                                                     want[r * PROOF_BYTES:(r + 1) * PROOF_BYTES])]


def describe(ranks: Sequence[int], generation: int, uids: Sequence[int]) -> str:
    """The plain message: 'a process outside the job took rank 1's place in generation 0 (uid 65534)'."""
    who = f"(uid {', '.join(str(u) for u in sorted(set(uids)))})" if uids else "(uid unknown)"
    if not ranks:
        return f"a process outside the job joined the worker group of generation {generation} {who}"
    if len(ranks) == 1:
        return f"a process outside the job took rank {ranks[0]}'s place in generation {generation} {who}"
    names = ", ".join(str(r) for r in ranks)
    return f"processes outside the job took the places of ranks {names} in generation {generation} {who}"


def foreign_uids(ports: Sequence[int]) -> list[int]:
    """The uids other than ours connected to `ports` or to a port this process listens on (its gloo pairs)."""
    rows = netwatch.read_tables()
    mine = netwatch.listening_ports([os.getpid()], rows)
    return sorted({uid for uid, _ in netwatch.foreign_clients(set(ports) | mine, rows=rows)})


def current_roll(rank: int, world: int, environ: Optional[Mapping[str, str]] = None) -> Optional[Roll]:
    """This process's roll in a group of `world` where it is `rank`, from the environment the agent wrote
    (None when it is not one of the agent's workers: nothing to prove)."""
    found = _roll_and_key(rank, world, environ)
    return found[0] if found is not None else None


def _roll_and_key(rank: int, world: int, environ: Optional[Mapping[str, str]]) -> Optional[tuple[Roll, bytes]]:
    env = os.environ if environ is None else environ
    ctx = E.worker_context(env)
    if ctx.job_key is None or not ctx.run_id:
        return None
    return (Roll(run_id=ctx.run_id, generation=ctx.generation, world=world, rank=rank,
                 store=env.get("MASTER_PORT", "")), roll_key(ctx.job_key))


def _device(dist: Any, group: Any) -> Any:
    """Where the group's collectives run: the CPU when it has a CPU backend (gloo), else its device - the one
    init_process_group(device_id=) bound, else the current one when the script chose it, else the local
    rank's (torch's own guess for a barrier): a script that calls set_device only after forming the group
    must not have every rank's communicator made on GPU 0."""
    import torch
    kind = dist.distributed_c10d._get_object_coll_device(group)
    if kind == "cpu":
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    module = getattr(torch, kind)
    index = module.current_device()
    if index == 0 and module.device_count() > 1:
        index = int(os.environ.get("LOCAL_RANK", "0")) % module.device_count()
    return torch.device(kind, index)


class _Silent(Exception):
    """The proofs did not come while an outsider is at the ports."""


def _wait(work: Any, timeout_s: float, outsider: Optional[Callable[[], bool]], silent_s: float) -> None:
    """Wait for a gloo work of the roll call: up to `timeout_s`, or `silent_s` once `outsider()` says a
    process of another uid is at the ports (_Silent). Short waits one after the other: a wait that times
    out leaves the collective running (c10d's Work.wait), so looking again costs nothing."""
    import time
    start = time.monotonic()
    while True:
        left = start + timeout_s - time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=max(0.001, min(_LOOK_S, left))))
            return
        except RuntimeError:
            if work.is_completed() or left <= _LOOK_S:
                raise
        if outsider is not None and time.monotonic() - start >= silent_s and outsider():
            raise _Silent()


def gather(group: Any, mine: bytes, world: int, timeout_s: Optional[float],
           outsider: Optional[Callable[[], bool]] = None, silent_s: float = SILENT_S) -> bytes:
    """All members' proofs over `group`, in rank order (a fixed-size all-gather of raw bytes).

    The tensors own their memory (not views of Python buffers through `torch.frombuffer`): the collective's
    work object may be let go by gloo's thread, and a tensor whose storage is a Python object then needs the
    interpreter lock to be freed - at interpreter exit that aborted a worker ("terminate called without an
    active exception"). The proofs are a few dozen bytes: the copies cost nothing."""
    import torch
    import torch.distributed as dist
    device = _device(dist, group)
    send = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    out = torch.empty(world * PROOF_BYTES, dtype=torch.uint8, device=device)
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
    work = op(out, send, group=group, async_op=True)
    try:
        if timeout_s is not None and device.type == "cpu":
            _wait(work, timeout_s, outsider, silent_s)
        else:
            work.wait()
        return bytes(out.cpu().tolist())    # synchronous on a device: waits for the collective
    finally:
        del work


def call(group: Any = None, environ: Optional[Mapping[str, str]] = None,
         answer_s: float = GLOO_ANSWER_S) -> Optional[float]:
    """Hold the roll call in `group` (default: the default group). Returns its seconds, None when there is
    nothing to prove (not the agent's worker, one member). RollCallError when a member is not one of ours."""
    import time
    import torch.distributed as dist
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    found = _roll_and_key(rank, world, environ) if world > 1 else None
    if found is None:
        return None
    roll, key = found
    t0 = time.perf_counter()
    seen: list[int] = []

    def outsider() -> bool:
        seen[:] = foreign_uids(_ports(roll))
        return bool(seen)
    try:
        gathered = gather(group, proof(key, roll), world, answer_s, outsider)
    except _Silent:   # an outsider took a place in the group and says nothing: no 60 s wait for gloo
        raise RollCallError(f"{describe((), roll.generation, seen)}: its members' proofs did not arrive within "
                            f"{SILENT_S:g}s while it was connected to the job's ports", uids=tuple(seen)) from None
    except RuntimeError as exc:   # a member that does not take part: gloo's wait timed out, or it hung up
        uids = foreign_uids(_ports(roll))
        if not uids:
            raise
        raise RollCallError(f"{describe((), roll.generation, uids)}: the roll call failed "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                            uids=tuple(uids)) from None
    bad = failed_ranks(key, roll, gathered)
    if bad:
        uids = foreign_uids(_ports(roll))
        raise RollCallError(describe(bad, roll.generation, uids), ranks=tuple(bad), uids=tuple(uids))
    return time.perf_counter() - t0


#: gloo's own checks on a peer's rendezvous record, in the files that parse it
_GLOO_PARSERS = ("gloo/transport/tcp/context.cc", "gloo/transport/tcp/address.cc", "gloo/rendezvous/")


def malformed_rendezvous(exc: BaseException) -> bool:
    """Whether forming a gloo group failed (`exc`) on a rendezvous record that gloo did not write.

    Why this is an outside cause: every record under the round's store's group keys is written by gloo in a
    rank of ours, in the format the reading rank expects. A record that makes gloo read a length from junk
    (std::bad_alloc: MemoryError; std::length_error: ValueError 'basic_string::_M_create') or fail one of
    the checks of its parser ('enforce fail at .../gloo/transport/tcp/context.cc') was written by someone
    else - another user of the node can reach the store (finding 2 of the security issue). A network or
    timeout error is not taken for one: those the script's own environment causes too."""
    text = str(exc)
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, ValueError) and ("basic_string" in text or "length_error" in text):
        return True
    return isinstance(exc, RuntimeError) and "enforce fail" in text and any(p in text for p in _GLOO_PARSERS)


def outside_cause(exc: BaseException, environ: Optional[Mapping[str, str]] = None) -> Optional[RollCallError]:
    """When forming the group failed (`exc`) because of a process outside the job - one of another uid is
    connected to the round's store or to this process's ports, or a peer's rendezvous record is junk
    (malformed_rendezvous) - the error that names that outside cause instead of blaming the script; None
    when no outsider is in sight. An outsider that wrote junk and hung up before this rank read the tables
    is '(uid unknown)': the agent, which watches the ports all along, fills in the uid it saw."""
    env = os.environ if environ is None else environ
    try:
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    found = _roll_and_key(rank, world, environ)
    if found is None:
        return None
    uids = foreign_uids(_ports(found[0]))
    junk = malformed_rendezvous(exc)
    if not uids and not junk:
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    who = f"(uid {', '.join(str(u) for u in uids)})" if uids else "(uid unknown)"
    what = ("wrote malformed rendezvous records into" if junk else "is connected to")
    return RollCallError(f"a process outside the job {who} {what} the workers' store of generation "
                         f"{found[0].generation} and the group failed to form: {first}", uids=tuple(uids))


def _ports(roll: Roll) -> list[int]:
    return [int(roll.store)] if roll.store.isdigit() else []
