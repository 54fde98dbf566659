"""MACs on hyperpodrun's own restore protocols: the restore inventories and the replica stream.

Why: at a restore every rank believes what its peers say they hold (restore_plan.py) and loads what a donor
sends (replica_stream.py). A process that is not one of the job's workers but reached the job's process group
(another user of the node on a loopback store, say) could otherwise claim a newer step than anyone holds and
hand the ranks its own state. The job's workers hold a key the agent hands down (HYPERPODRUN_JOB_KEY,
hyperpodrun/auth.py); every message of these protocols carries an HMAC-SHA256 under a key derived from it for
this purpose (`derive(worker key, "restore")`, as peer copies use their own), over a context - the protocol,
the run id, the generation, the world size, the sending rank and the receiving rank (-1: every rank), and
what else pins the message (the step, the transfer's kind) - and the message. A message replayed from another
generation, run, world size, rank or transfer does not verify; one from a process without the key neither.

Without the workers' key (a CheckpointManager outside hyperpodrun's launcher) there is nothing to check
against: messages carry a zero tag and are not checked; a warning says so once per process.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union

from hyperpodrun import auth

log = logging.getLogger("hyperpodrun.runtime")

TAG_BYTES = hashlib.sha256().digest_size
_DOMAIN = b"hyperpodrun/restore/v1"
_warned = [False]

Part = Union[bytes, str, int]


def _framed(part: Part) -> bytes:
    if isinstance(part, int):
        raw = str(part).encode()
    elif isinstance(part, str):
        raw = part.encode()
    else:
        raw = bytes(part)
    return struct.pack("<I", len(raw)) + raw


def feed(m: "hmac.HMAC", part: Any) -> None:
    """Feed a part (bytes-like, never copied; or a str or int, as text) to a running MAC, its length first
    (parts cannot be re-split)."""
    if isinstance(part, (str, int)):
        part = str(part).encode()
    view = memoryview(part).cast("B")
    m.update(struct.pack("<Q", view.nbytes))
    m.update(view)


@dataclass(frozen=True)
class Channel:
    """The key and the context every MAC of one restore is bound to."""

    key: Optional[bytes]
    run_id: str
    generation: int
    world: int

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def mac(self, what: str, sender: int, receiver: int, *context: Part) -> "Optional[hmac.HMAC]":
        """A running MAC seeded with the context; feed it the message with update(). None without a key."""
        if self.key is None:
            return None
        seed = b"".join(_framed(p) for p in (_DOMAIN, what, self.run_id, self.generation, self.world, sender,
                                               receiver, *context))
        return hmac.new(self.key, seed, hashlib.sha256)

    def tag(self, what: str, sender: int, receiver: int, *parts: Any) -> bytes:
        """The tag of a message made of `parts` (bytes-like, each fed with its length, never copied), zeros
        without a key."""
        m = self.mac(what, sender, receiver)
        if m is None:
            return bytes(TAG_BYTES)
        for p in parts:
            feed(m, p)
        return m.digest()

    def check(self, tag: bytes, what: str, sender: int, receiver: int, *parts: Any) -> bool:
        """Whether `tag` is the tag of that message (always, without a key: nothing to check against)."""
        if self.key is None:
            return True
        return hmac.compare_digest(bytes(tag), self.tag(what, sender, receiver, *parts))


def channel(generation: int, world: int, run_id: Optional[str] = None, key: Optional[bytes] = None) -> Channel:
    """The channel of this worker for `generation` at `world` ranks: the key from the environment (or `key`,
    the workers' key itself), the run id the worker sees (or `run_id`)."""
    from hyperpodrun.state.slots import shm_runs
    worker = key if key is not None else auth.worker_key()
    if worker is None and not _warned[0]:
        _warned[0] = True
        log.warning("no HYPERPODRUN_JOB_KEY in the environment (not started by hyperpodrun?): restore inventories "
                    "and replica transfers are not authenticated")
    return Channel(auth.derive(worker, "restore") if worker is not None else None,
                   run_id if run_id is not None else shm_runs.run_id(), int(generation), int(world))


def current(generation: Optional[int] = None) -> Channel:
    """The channel for this process's default group: its world size and `generation` (the caller's
    iteration; without one, the generation the launcher gave this process)."""
    from hyperpodrun import env
    world = 1
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
    except ImportError:
        pass
    return channel(env.worker_context().generation if generation is None else generation, world)


__all__ = ["Channel", "TAG_BYTES", "channel", "current", "feed"]
