"""CheckpointManager: per-step state snapshots that survive the process, restored at the committed step.

    cm = CheckpointManager(enable_checksum=True)

    @HPWrapper(checkpoint_manager=cm)
    def main(caller=None):
        dist.init_process_group(...)
        model, opt = build()
        state = {"model": model, "opt": opt}
        start = cm.restore(state) or 0          # None on a fresh start
        for step in range(start, steps):
            caller.progress(step)
            train_step(batch(step))              # data indexed by step
            cm.save(step + 1, state)             # after optimizer/scheduler/scaler steps

`step` counts completed optimizer steps (= the index of the next batch). `save` captures the state
dicts and the RNG states (python, numpy, torch CPU/CUDA) into one of two slots in host shared memory
(double buffer: the previous step stays valid while the next is written, and a slot is replaced by an
atomic rename, so it survives the death of the process at any instant). `restore` agrees with every
rank on the newest step that all of them hold (ranks are at most one step apart with synchronous
training, so two slots suffice), loads it - DTensor shards (FSDP2) included - and restores RNG before any
data iterator draws seeds. If some rank's state at that step exists nowhere and no disk fallback has it,
`StateLostError` ends the job with exit code 75 - never a silent restart from step 0.

What is not here yet (see README): copies to a peer on another node (a lost node loses its snapshots),
receiving live state from a replica peer instead of shared memory, GPU offload tuning.
"""
from __future__ import annotations

import io
import logging
import os
import random
import threading
import zlib
from typing import Any, Mapping, Optional

from hyperpodrun.errors import EXIT_STATE_LOST
from hyperpodrun.runtime.ddp_layout import LayoutKeeper

log = logging.getLogger("hyperpodrun.runtime")

_MAGIC = b"HPRSNAP1"


class StateLostError(RuntimeError):
    """Some rank's committed state survives nowhere (exit code 75)."""

    exit_code = EXIT_STATE_LOST


class SnapshotCorrupt(ValueError):
    """A snapshot failed its checksum: it is ignored."""


def _rng_state() -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    import torch
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _to_host(obj: Any) -> Any:
    """Deep copy of a state dict with every tensor as a host tensor (DTensor -> its local shard)."""
    import torch
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") and hasattr(obj, "placements") else obj
        return local.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _like(saved: Any, current: Any) -> Any:
    """Turn saved host tensors back into tensors shaped like `current` (device, DTensor placement)."""
    import torch
    if isinstance(saved, torch.Tensor) and isinstance(current, torch.Tensor):
        if hasattr(current, "placements") and hasattr(current, "device_mesh"):
            from torch.distributed.tensor import DTensor
            local = saved.to(current.to_local().device)
            return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                      shape=current.shape, stride=current.stride())
        return saved.to(current.device)
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: _like(v, current.get(k)) if k in current else v for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) and len(saved) == len(current):
        return type(saved)(_like(s, c) for s, c in zip(saved, current))
    return saved


def _fix_optimizer_dtensors(opt: Any) -> None:
    """After load_state_dict, give each optimizer state tensor its parameter's DTensor layout (FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    for p, st in getattr(opt, "state", {}).items():
        if not isinstance(p, DTensor):
            continue
        local_shape = p.to_local().shape
        for k, v in list(st.items()):
            if hasattr(v, "shape") and not isinstance(v, DTensor) and v.shape == local_shape and v.dim() > 0:
                st[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())


class CheckpointManager:
    """Snapshots of each rank's training state in memory that outlives the process.

    enable_checksum: store a CRC32 with every slot and refuse a slot that does not match.
    enable_offload: snapshots are always written to host memory here; the flag is accepted for
        compatibility with the product note and records that device tensors are copied off the device.
    fallback_dir / fallback_every: also write every N-th snapshot to disk, asynchronously and atomically,
        for the case where shared memory is lost too.
    shm_dir: where the slots live (a tmpfs; default /dev/shm).
    """

    def __init__(self, enable_checksum: bool = False, enable_offload: bool = False,
                 fallback_dir: Optional[str] = None, fallback_every: Optional[int] = None,
                 shm_dir: Optional[str] = None) -> None:
        if fallback_every is not None and fallback_every < 1:
            raise ValueError(f"CheckpointManager(fallback_every={fallback_every}): must be >= 1")
        if fallback_every is not None and not fallback_dir:
            raise ValueError("CheckpointManager(fallback_every=...) needs fallback_dir= (where to write)")
        self.enable_checksum = enable_checksum
        self.enable_offload = enable_offload
        self.fallback_dir = fallback_dir
        self.fallback_every = fallback_every or (1 if fallback_dir else None)
        self.shm_dir = shm_dir or os.environ.get("HYPERPODRUN_SHM_DIR", "/dev/shm")
        self._session: Any = None
        self._caller: Any = None
        self._writer: Optional[threading.Thread] = None
        self.last_saved: Optional[int] = None
        self._layouts = LayoutKeeper()

    # ------------------------------------------------------------------ wiring
    def _attach(self, caller: Any, session: Any) -> None:
        """Called by HPWrapper at every (re-)entry."""
        self._caller, self._session = caller, session
        self._layouts.reset()

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    def slot_dir(self, rank: Optional[int] = None) -> str:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        return os.path.join(self.shm_dir, f"hyperpodrun-{os.getuid()}", run, f"rank{self.rank if rank is None else rank}")

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot `state` as the state after `step` completed optimizer steps."""
        blob = self._encode(step, state)
        d = self.slot_dir()
        os.makedirs(d, exist_ok=True)
        slot = os.path.join(d, f"slot{step % 2}")
        tmp = slot + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, slot)
        self.last_saved = step
        if self.fallback_dir and self.fallback_every and step % self.fallback_every == 0:
            self._write_fallback(step, blob)

    def _encode(self, step: int, state: Mapping[str, Any]) -> bytes:
        import torch
        payload = {"step": step, "rng": _rng_state(), "state": {}, "ddp_layouts": self._layouts.collect()}
        for name, obj in state.items():
            if hasattr(obj, "state_dict") and callable(obj.state_dict):
                payload["state"][name] = ("sd", _to_host(obj.state_dict()))
            else:
                payload["state"][name] = ("value", _to_host(obj))
        buf = io.BytesIO()
        torch.save(payload, buf)
        body = buf.getvalue()
        crc = zlib.crc32(body) if self.enable_checksum else 0
        header = _MAGIC + step.to_bytes(8, "little") + crc.to_bytes(4, "little") + \
            (1 if self.enable_checksum else 0).to_bytes(1, "little")
        return header + body

    def _write_fallback(self, step: int, blob: bytes) -> None:
        if self._writer is not None:
            self._writer.join()   # one write in flight at a time; a slow disk slows saving, never corrupts

        def write() -> None:
            d = os.path.join(self.fallback_dir or ".", f"rank{self.rank}")
            try:
                os.makedirs(d, exist_ok=True)
                path = os.path.join(d, f"step{step:012d}.snap")
                with open(path + ".tmp", "wb") as fh:
                    fh.write(blob)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(path + ".tmp", path)
                for old in sorted(f for f in os.listdir(d) if f.endswith(".snap"))[:-2]:
                    os.unlink(os.path.join(d, old))
            except OSError as exc:
                log.error("fallback checkpoint of step %d not written: %s", step, exc)
        self._writer = threading.Thread(target=write, name="hyperpodrun-fallback", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ restore
    @staticmethod
    def _read(path: str) -> tuple[int, bytes]:
        with open(path, "rb") as fh:
            data = fh.read()
        if len(data) < 21 or data[:8] != _MAGIC:
            raise SnapshotCorrupt(f"{path}: not a snapshot")
        step = int.from_bytes(data[8:16], "little")
        crc = int.from_bytes(data[16:20], "little")
        body = data[21:]
        if data[20] and zlib.crc32(body) != crc:
            raise SnapshotCorrupt(f"{path}: checksum mismatch (step {step})")
        return step, body

    def _candidates(self, directory: str) -> dict[int, str]:
        """step -> path of every valid snapshot in `directory` (corrupt ones are skipped, loudly)."""
        found: dict[int, str] = {}
        if not os.path.isdir(directory):
            return found
        for name in os.listdir(directory):
            if name.endswith(".tmp"):
                continue
            path = os.path.join(directory, name)
            try:
                step, _ = self._read(path)
            except (SnapshotCorrupt, OSError) as exc:
                log.error("ignoring snapshot %s", exc)
                continue
            found[step] = path
        return found

    def restore(self, state: Mapping[str, Any]) -> Optional[int]:
        """Load the newest step every rank holds into `state`; returns it, or None on a fresh start."""
        import torch.distributed as dist
        shm = self._candidates(self.slot_dir())
        disk = self._candidates(os.path.join(self.fallback_dir, f"rank{self.rank}")) if self.fallback_dir else {}
        mine = {"shm": sorted(shm), "disk": sorted(disk), "latest": self.last_saved}
        if dist.is_available() and dist.is_initialized():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        common_shm = set.intersection(*(set(e["shm"]) for e in everyone))
        common_any = set.intersection(*(set(e["shm"]) | set(e["disk"]) for e in everyone))
        anything = any(e["shm"] or e["disk"] for e in everyone)
        if not anything:
            return None
        if common_shm:
            step, source = max(common_shm), "memory"
        elif common_any:
            step, source = max(common_any), "disk"
        else:
            missing = [r for r, e in enumerate(everyone) if not (e["shm"] or e["disk"])]
            newest = max(max(e["shm"] + e["disk"]) for e in everyone if e["shm"] or e["disk"])
            raise StateLostError(
                f"the state of rank(s) {missing or 'some ranks'} at step {newest} survives nowhere (no snapshot in "
                f"shared memory, no fallback checkpoint); configure CheckpointManager(fallback_dir=...) to survive this")
        path = shm.get(step) or disk[step]
        _, body = self._read(path)
        self._load(body, state)
        latest = max((e["latest"] for e in everyone if e["latest"] is not None), default=step)
        lost = max(0, latest - step)
        self.last_saved = step
        if self._session is not None and self.rank == 0:
            from hyperpodrun import protocol as P
            self._session.send(P.Restored(rank=self.rank, pid=os.getpid(), generation=self._caller.iteration,
                                          step=step, lost_steps=lost, source=source))
        log.info("restored step %d from %s (%d step(s) lost)", step, source, lost)
        return step

    def _load(self, body: bytes, state: Mapping[str, Any]) -> None:
        import torch
        payload = torch.load(io.BytesIO(body), weights_only=False)
        for name, obj in state.items():
            if name not in payload["state"]:
                raise KeyError(f"snapshot has no entry {name!r}; the state dict given to save() and restore() "
                               "must have the same keys")
            kind, saved = payload["state"][name]
            if kind == "sd":
                current = obj.state_dict()
                obj.load_state_dict(_like(saved, current))
                if isinstance(obj, torch.optim.Optimizer):
                    _fix_optimizer_dtensors(obj)
            elif isinstance(state, dict):
                state[name] = saved  # type: ignore[index]
        if payload.get("ddp_layouts"):
            self._layouts.restore(payload["ddp_layouts"])
        _set_rng_state(payload["rng"])

    def wait(self) -> None:
        """Block until an asynchronous fallback write has finished."""
        if self._writer is not None:
            self._writer.join()


__all__ = ["CheckpointManager", "StateLostError", "SnapshotCorrupt"]
