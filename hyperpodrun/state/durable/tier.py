"""The durable tier's writer and reader: every `fallback_every`-th sealed snapshot becomes a DCP checkpoint in the
store, behind the training; a restore lists the complete ones and rebuilds a rank's snapshot from one.

Never blocks a step: `submit` only starts a thread, and when the previous checkpoint is still being written the
new one is skipped (a `skipped` note), never waited for. The thread copies the sealed slot first (host memory
to host memory, no device copy: the slot is already on the host) and checks that copy against the slot's own
checksum - a slot rewritten meanwhile is skipped, not uploaded - so host memory is bounded by one snapshot plus
the transfer manager's parts in flight.

Atomic: each rank writes its object and then its part description; the rank that finds every rank's part
present (the last one to finish; on a store with read-after-write consistency at least one rank does) writes
DCP's `.metadata` and, last, `manifest.json` with the CRC32 of every part description. Only a checkpoint with
a manifest counts; parts of checkpoints that never completed are removed by the retention pass of a later one,
which keeps the newest `keep` complete checkpoints.

Verified: a restore checks the manifest, the part description against the manifest's CRC32, the object against
the part's size and CRC32, and the rebuilt snapshot against its own checksum; any mismatch rejects that
checkpoint (an older complete one is then used).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import zlib
from typing import Any, Literal, Optional

from hyperpodrun.errors import CheckpointStoreError, SnapshotCorrupt
from hyperpodrun.state.durable import dcp_layout as layout
from hyperpodrun.state.durable.stores import Store
from hyperpodrun.state.slots import snapshot_io as slot_io

log = logging.getLogger("hyperpodrun.runtime")

#: the largest manifest or part description read back (a part lists every tensor: well under this)
MAX_JSON_BYTES = 64 << 20
_STEP_DIR = re.compile(r"step_(\d{12})")
#: what became of a checkpoint (protocol.Checkpointed.outcome)
Outcome = Literal["written", "skipped", "failed"]


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=lambda c: None)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SnapshotCorrupt(f"{what}: not valid JSON ({exc})") from None


def _copy(path: str) -> bytearray:
    """A slot file's bytes, read once (never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        blob = bytearray(os.fstat(fd).st_size)
        view, got = memoryview(blob), 0
        while got < len(blob):
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
    return blob[:got] if got < len(blob) else blob


class DurableTier:
    """Checkpoints of one rank in `store`, the newest `keep` complete ones kept."""

    def __init__(self, store: Store, keep: int) -> None:
        self.store = store
        self.keep = keep
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._notes: list[tuple[Outcome, int, str]] = []
        #: (step, rank, world) -> the snapshot fetched while listing, kept for the restore that follows
        self._fetched: dict[tuple[int, int, int], bytearray] = {}
        #: seconds and bytes of the last checkpoint this rank wrote (for the benchmark and the log)
        self.last_write: Optional[tuple[float, int]] = None

    def where(self, step: int) -> str:
        return f"{self.store.url}/{layout.step_dir(step)}"

    # ------------------------------------------------------------------ writing
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, slot: str, rank: int, world: int) -> None:
        """Write the snapshot of `step` sealed in `slot` as this rank's part of a checkpoint, in the background;
        skipped (with a note) while the previous one is still being written."""
        if self.busy():
            self._note("skipped", step, "the previous checkpoint is still being written")
            return
        self._thread = threading.Thread(target=self._write, args=(step, slot, rank, world),
                                        name="hyperpodrun-durable", daemon=True)
        self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def notes(self) -> list[tuple[Outcome, int, str]]:
        """What happened since the last call: (outcome, step, detail), outcome written|skipped|failed."""
        with self._lock:
            out, self._notes = self._notes, []
        return out

    def _note(self, outcome: Outcome, step: int, detail: str) -> None:
        level = logging.INFO if outcome == "written" else logging.WARNING
        log.log(level, "durable checkpoint of step %d %s: %s", step, outcome, detail)
        with self._lock:
            self._notes.append((outcome, step, detail))

    def _write(self, step: int, slot: str, rank: int, world: int) -> None:
        from hyperpodrun.state.slots.slot_checksum import lowest_priority
        began = time.monotonic()
        d = layout.step_dir(step)
        try:
            # the slot is rewritten two snapshots later (a host state: two steps): copied at once, at normal
            # priority; the rest runs on CPU time the training leaves (the transfer threads inherit it)
            blob = _copy(slot)
            lowest_priority()
            try:
                if slot_io.verify(blob, slot) != step:    # rewritten while it was copied: not this snapshot
                    raise SnapshotCorrupt(f"{slot}: holds another step")
                info: dict = {}
                self.store.put(f"{d}/{layout.object_name(rank)}", layout.part_chunks(blob, slot, info))
            except SnapshotCorrupt:
                self._note("skipped", step, "the snapshot was rewritten before it was copied")
                return
            size = info["size"]
            del blob
            info.update(rank=rank, world=world)
            self.store.put(f"{d}/rank{rank}.json", [json.dumps(info, separators=(",", ":")).encode()])
            self.last_write = (time.monotonic() - began, size)
            self._complete(step, world)
        except Exception as exc:   # the store failed (unreachable, refused, full): the training goes on
            self._note("failed", step, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")

    def _complete(self, step: int, world: int) -> None:
        """If every rank's part of `step` is there, write .metadata and the manifest, then apply retention."""
        d = layout.step_dir(step)
        keys = set(self.store.keys(d + "/"))
        if not all(f"{d}/rank{r}.json" in keys for r in range(world)):
            return
        raw = [self.store.get(f"{d}/rank{r}.json", MAX_JSON_BYTES) for r in range(world)]
        parts = [_loads(b, f"{self.where(step)}/rank{r}.json") for r, b in enumerate(raw)]
        metadata = layout.dcp_metadata(parts, step)
        self.store.put(f"{d}/.metadata", [metadata])
        manifest = {"format": layout.FORMAT, "step": step, "world": world,
                    "parts": {str(r): zlib.crc32(b) for r, b in enumerate(raw)}, "metadata_crc": zlib.crc32(metadata)}
        self.store.put(f"{d}/manifest.json", [json.dumps(manifest, separators=(",", ":")).encode()])
        self._note("written", step, self.where(step))
        self._retain(step)

    def _retain(self, newest: int) -> None:
        """Keep the newest `keep` complete checkpoints; remove older ones and the parts of incomplete ones older
        than `newest` (writes that never completed: every rank writes its checkpoints in step order)."""
        by_step: dict[int, list[str]] = {}
        for key in self.store.keys("step_"):
            m = _STEP_DIR.fullmatch(key.split("/", 1)[0])
            if m:
                by_step.setdefault(int(m.group(1)), []).append(key)
        complete = sorted((s for s, ks in by_step.items() if f"{layout.step_dir(s)}/manifest.json" in ks),
                          reverse=True)
        kept = set(complete[:self.keep])
        doomed = [k for s, ks in by_step.items() if s not in kept and s < newest for k in ks]
        # the manifest first: a checkpoint being removed stops counting before any of its objects goes
        doomed.sort(key=lambda k: not k.endswith("/manifest.json"))
        if doomed:
            self.store.delete([k for k in doomed if k.endswith("/manifest.json")])
            self.store.delete([k for k in doomed if not k.endswith("/manifest.json")])

    # ------------------------------------------------------------------ reading
    def steps(self, rank: int, world: int, verify: bool = True) -> list[int]:
        """The steps of the complete checkpoints, for the restore plan: with `verify` (a rank with nothing in
        memory) the newest one that verifies for this rank (fetched now, kept for the restore) and every older
        one (verified when read); without, every complete one (one listing: a rank that holds its state in
        memory seldom reads the store, and a restore in-process must not download it). An unreachable store
        lists nothing (logged)."""
        self._fetched.clear()
        try:
            keys = self.store.keys("step_")
        except Exception as exc:
            log.error("durable checkpoints in %s not listed: %s", self.store.url, exc)
            return []
        found = sorted((int(m.group(1)) for m in (_STEP_DIR.fullmatch(k.split("/", 1)[0]) for k in keys
                        if k.endswith("/manifest.json")) if m), reverse=True)
        if not verify:
            return sorted(found)
        out: list[int] = []
        for step in found:
            if out:
                out.append(step)
                continue
            try:
                self._fetched[(step, rank, world)] = self._fetch(step, rank, world)
                out.append(step)
            except (SnapshotCorrupt, CheckpointStoreError) as exc:
                log.error("durable checkpoint %s not used: %s", self.where(step), exc)
            except Exception as exc:
                log.error("durable checkpoint %s not read: %s", self.where(step), exc)
        return sorted(out)

    def fetch(self, step: int, rank: int, world: int) -> bytearray:
        """This rank's snapshot of `step` (slot bytes, to be decoded with its checksum verified)."""
        got = self._fetched.pop((step, rank, world), None)
        self._fetched.clear()
        return got if got is not None else self._fetch(step, rank, world)

    def _fetch(self, step: int, rank: int, world: int) -> bytearray:
        d, where = layout.step_dir(step), self.where(step)
        manifest = _loads(self.store.get(f"{d}/manifest.json", MAX_JSON_BYTES), f"{where}/manifest.json")
        if not isinstance(manifest, dict) or manifest.get("format") != layout.FORMAT or manifest.get("step") != step:
            raise SnapshotCorrupt(f"{where}/manifest.json: not a manifest of step {step} in format {layout.FORMAT}")
        if manifest.get("world") != world:
            raise SnapshotCorrupt(f"{where}: written by {manifest.get('world')} ranks, this job has {world} (load it "
                                  "with torch.distributed.checkpoint to change the world size)")
        raw = self.store.get(f"{d}/rank{rank}.json", MAX_JSON_BYTES)
        if zlib.crc32(raw) != (manifest.get("parts") or {}).get(str(rank)):
            raise SnapshotCorrupt(f"{where}/rank{rank}.json: does not match the manifest's CRC32")
        part = _loads(raw, f"{where}/rank{rank}.json")
        if not isinstance(part, dict) or part.get("step") != step or part.get("rank") != rank or \
                not isinstance(part.get("size"), int) or part["size"] < 0:
            raise SnapshotCorrupt(f"{where}/rank{rank}.json: not rank {rank}'s part of step {step}")
        obj = self.store.get(f"{d}/{layout.object_name(rank)}", part["size"])
        try:
            blob = layout.rebuild(part, obj, f"{where}/{layout.object_name(rank)}")
        except SnapshotCorrupt:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotCorrupt(f"{where}/rank{rank}.json: malformed ({exc})") from None
        del obj
        if slot_io.verify(blob, where) != step:
            raise SnapshotCorrupt(f"{where}: rank {rank}'s snapshot holds another step")
        return blob
