"""State read back from shared memory can neither run code nor be planted, slots are always checksummed,
unsupported state fails when saved, and a successful job leaves nothing in shared memory.

The attacker tests act as another local user (uid 65534 via setpriv; they need root and are skipped
otherwise): that user pre-creates the predictable directories and plants slots or batch files holding a
pickle payload that would create a marker file if it were ever unpickled.
"""
from __future__ import annotations

import collections
import enum
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import SCRIPTS, read_events
from hyperpodrun import CacheResumeMMAPConfig, CheckpointManager, MMAPDataLoader
from hyperpodrun.data import loader as loader_mod
from hyperpodrun.data import storage
from hyperpodrun.data.errors import CacheCorruptError
from hyperpodrun.state.slots import shm_runs
from hyperpodrun.state.slots import snapshot_io
from hyperpodrun.state.codec.safe_codec import UnsupportedStateError
from hyperpodrun.safe_fs import UnsafePathError

ATTACKER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="acting as another user needs root and setpriv")

Pair = collections.namedtuple("Pair", "a b")


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = "main"


class _Payload:
    """Unpickling this creates the marker file: what an attacker would plant."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A fresh run id and owner for in-process CheckpointManager / MMAP tests (as a launched worker)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"sec-{random.randrange(1 << 30)}")
    monkeypatch.setenv("HYPERPODRUN_AGENT_PID", str(os.getpid()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("HYPERPODRUN_SHM_DIR", raising=False)
    return tmp_path


@pytest.fixture
def shared_base():
    """A sticky, world-writable directory like /dev/shm (tmp_path is not reachable by another user)."""
    base = tempfile.mkdtemp(prefix="hpr-sec-", dir="/tmp")
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def as_attacker(code: str, *args: str) -> None:
    subprocess.run(ATTACKER + [sys.executable, "-c", code, *args], check=True, timeout=60)


def forged_slot(meta: bytes, step: int = 5, old_format: bool = False) -> bytes:
    """A complete slot with a valid checksum whose metadata block is `meta` (e.g. a pickle)."""
    if old_format:   # the previous layout: pickled metadata, checksum flag cleared
        hdr = struct.pack("<8sqIBBQQ", b"HPRSNAP2", step, 0, 0, 1, len(meta), 0)
        return hdr.ljust(64, b"\0") + meta
    view = memoryview(bytearray(64 + (len(meta) + 63) // 64 * 64))
    view[64:64 + len(meta)] = meta
    crc = snapshot_io.checksum(view, step, len(meta), 0)
    view[:snapshot_io.HEADER.size] = snapshot_io.HEADER.pack(snapshot_io.MAGIC, step, crc, 1, len(meta), 0,
                                                            snapshot_io.CHUNK)
    return bytes(view)


# ------------------------------------------------------------------------------------------ formats
def test_real_states_round_trip_without_pickle(env):
    """Optimizers, LR schedulers, grad scaler, python/numpy/torch RNG, namedtuples, enums and numpy values
    come back equal and of the same types."""
    model = torch.nn.Linear(4, 3)
    opts = [torch.optim.Adam(model.parameters()), torch.optim.AdamW(model.parameters(), betas=(0.8, 0.9)),
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    model(torch.randn(2, 4)).sum().backward()
    for o in opts:
        o.step()
    scheds = [torch.optim.lr_scheduler.OneCycleLR(opts[0], max_lr=0.1, total_steps=10),
              torch.optim.lr_scheduler.ReduceLROnPlateau(opts[1]), torch.optim.lr_scheduler.LambdaLR(
                  opts[2], lambda e: 0.9 ** e)]
    state = {"model": model, **{f"opt{i}": o for i, o in enumerate(opts)},
             **{f"sched{i}": s for i, s in enumerate(scheds)}, "scaler": torch.amp.GradScaler("cpu"),
             "value": {"pair": Pair(np.float32(1.5), [Phase.MAIN, {3, 4}, (1 << 70, b"raw")]),
                       "od": collections.OrderedDict(z=np.arange(3, dtype=np.int16)), "size": torch.Size([2])}}
    want = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    random.seed(7)
    np.random.seed(7)
    cm = CheckpointManager(shm_dir=str(env))
    cm.save(3, state)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)
    restored = {"value": None}
    for k, v in state.items():
        if hasattr(v, "load_state_dict"):
            restored[k] = v
    assert cm.restore(restored) == 3
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    v = restored["value"]
    assert type(v["pair"]) is Pair and type(v["pair"].a) is np.float32 and v["pair"].b[0] is Phase.MAIN
    assert v["pair"].b[1:] == [{3, 4}, (1 << 70, b"raw")] and type(v["od"]) is collections.OrderedDict
    assert v["od"]["z"].dtype == np.int16 and list(v["od"]["z"]) == [0, 1, 2] and v["size"] == torch.Size([2])
    for k in ("opt0", "opt1", "opt2", "sched0", "sched1", "sched2", "scaler"):
        got = state[k].state_dict()
        assert repr(got) == repr(want[k]), k


def test_unsupported_state_fails_at_save_naming_type_and_place(env):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["schedule"] = object()
    cm = CheckpointManager(shm_dir=str(env))
    with pytest.raises(UnsupportedStateError) as info:
        cm.save(1, {"model": model, "opt": opt})
    text = str(info.value)
    assert "state['opt'].state_dict()['param_groups'][0]['schedule']" in text and "builtins.object" in text, text
    assert isinstance(info.value, TypeError)   # HPWrapper ends the job instead of retrying it

    def local_pair():
        Local = collections.namedtuple("Local", "x")
        return Local(1)
    with pytest.raises(UnsupportedStateError, match=r"state\['cfg'\]\['inner'\] is a .*Local.*module level"):
        cm.save(1, {"cfg": {"inner": local_pair()}})
    with pytest.raises(UnsupportedStateError, match=r"collections.defaultdict"):
        cm.save(1, {"counts": collections.defaultdict(int)})
    assert cm.last_saved is None and cm.restore({"n": 0}) is None, "a refused state must not look saved"


def test_checksum_is_always_on_and_a_bad_or_missing_one_is_never_restored(env):
    """enable_checksum=False (the old default) still checksums: a corrupted slot, or one whose checksum
    was cleared, is skipped and the other slot is used - also a slot this process sealed itself, once it was
    written since (reuse_live=False: the live values of step 3 would otherwise be restored, from no slot)."""
    cm = CheckpointManager(enable_checksum=False, shm_dir=str(env), reuse_live=False)
    t = torch.zeros(1000)
    cm.save(1, {"t": t})
    cm.save(2, {"t": t + 2})
    cm.save(3, {"t": t + 3})          # the slots alternate: one holds step 3, the other step 2
    from hyperpodrun.state.slots import snapshot_io
    holding = {snapshot_io.header(open(p, "rb").read(), p)[0]: p
               for p in (os.path.join(cm.slot_dir(), f"slot{i}") for i in (0, 1))}
    data = bytearray(open(holding[3], "rb").read())
    data[snapshot_io.data_end(data, holding[3]) - 100] ^= 0x01    # one bit of the tensor data
    open(holding[3], "wb").write(bytes(data))
    state = {"t": None}
    assert cm.restore(state) == 2 and torch.equal(state["t"], t + 2)
    data = bytearray(open(holding[2], "rb").read())
    data[16:20] = b"\0\0\0\0"         # the checksum field: no flag makes a slot "unchecked"
    open(holding[2], "wb").write(bytes(data))
    assert cm.restore({"t": None}) is None


def test_planted_pickle_slots_in_our_own_directory_never_run(env, caplog):
    """Even a slot with a valid checksum (or in the old pickle format) is never unpickled."""
    marker = env / "pwned"
    cm = CheckpointManager(shm_dir=str(env))
    d = cm._ensure_dir()
    payload = pickle.dumps({"step": 5, "rng": _Payload(str(marker)), "state": {}})
    open(os.path.join(d, "slot1"), "wb").write(forged_slot(payload))
    open(os.path.join(d, "slot0"), "wb").write(forged_slot(payload, step=4, old_format=True))
    assert cm.restore({"n": 0}) is None
    assert not marker.exists(), "a pickle read back from shared memory was executed"
    assert "metadata of an unknown version" in caplog.text and "not a snapshot of this version" in caplog.text


def test_mmap_batch_with_pickle_meta_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    good = tmp_path / "b.batch"
    storage.write_batch(str(good), {"x": torch.ones(4)})
    blob = pickle.dumps({"tree": _Payload(str(marker)), "step": 0})
    size = (32 + len(blob) + 63) // 64 * 64
    forged = (struct.pack("<8sQQQ", storage.MAGIC, len(blob), size, size) + blob).ljust(size, b"\0")
    bad = tmp_path / "c.batch"
    bad.write_bytes(forged)
    with pytest.raises(CacheCorruptError):
        storage.read_batch(str(bad))
    with pytest.raises(CacheCorruptError):
        storage.read_meta(str(bad))
    assert not marker.exists()
    with pytest.raises(UnsupportedStateError, match=r"batch\['obj'\] is a builtins.object"):
        storage.write_batch(str(tmp_path / "d.tmp"), {"obj": object()})


def test_chunk_sums_match_zlib_whatever_order_the_copy_fills_the_region():
    from hyperpodrun.state.slots.slot_checksum import ChunkSums
    data = memoryview(bytearray(os.urandom(10_000)))
    want = [zlib.crc32(data[8 + i:8 + min(i + 1024, 8992)]) for i in range(0, 8992, 1024)]
    for threads in (1, 4):
        sums = ChunkSums(data, 8, 8992, chunk=1024, threads=threads).start()
        for end in (100, 3000, 2999, 8000):      # the copy reports progress, possibly out of order
            sums.advance(end)
        assert sums.result() == want
    stuck = ChunkSums(data, 8, 8992, chunk=1024, threads=4).start()
    stuck.cancel()                               # an abandoned slot: the helpers leave it without the data
    assert stuck.wait_idle(5)
    again = ChunkSums(data, 8, 8992, chunk=1024, threads=4).start()   # and serve the next one
    again.advance(8992)
    assert again.result() == want


def test_malformed_metadata_only_ever_raises_codec_error():
    """Random damage to encoded metadata: every outcome is a value or CodecError (no other exception)."""
    from hyperpodrun.state.codec import safe_codec
    blob = safe_codec.dumps({"rng": random.getstate(), "np": np.random.get_state(), "p": Pair(1, [2.5, "x"]),
                             "e": Phase.MAIN, "t": (1 << 70, b"b", {1}), "s": torch.Size([3])})
    rng = random.Random(0)
    for _ in range(2000):
        damaged = bytearray(blob)
        for _ in range(rng.randrange(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if rng.random() < 0.3:
            damaged = damaged[:rng.randrange(len(damaged))]
        try:
            safe_codec.loads(bytes(damaged))
        except safe_codec.CodecError:
            pass


# ------------------------------------------------------------------------------------------ directories
@needs_root
def test_run_directory_precreated_by_another_user_fails_without_reading_it(env, shared_base, monkeypatch):
    monkeypatch.setenv("HYPERPODRUN_SHM_DIR", shared_base)
    marker = os.path.join(shared_base, "pwned")
    cm = CheckpointManager()
    rank_dir = cm.slot_dir()
    slot = forged_slot(pickle.dumps({"step": 9, "rng": _Payload(marker), "state": {}}), step=9)
    as_attacker("import os, sys; os.makedirs(sys.argv[1], mode=0o777); os.chmod(os.path.dirname(os.path.dirname("
                "sys.argv[1])), 0o777); open(os.path.join(sys.argv[1], 'slot1'), 'wb').write(bytes.fromhex("
                "sys.argv[2]))", rank_dir, slot.hex())
    with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
        cm.restore({"n": 0})
    with pytest.raises(UnsafePathError):
        cm.save(1, {"n": 1})
    assert not os.path.exists(marker)
    assert os.path.exists(os.path.join(rank_dir, "slot1")), "the attacker's files must not be touched"


@needs_root
def test_symlinked_run_directory_is_refused(env, shared_base, monkeypatch):
    monkeypatch.setenv("HYPERPODRUN_SHM_DIR", shared_base)
    cm = CheckpointManager()
    base = os.path.dirname(os.path.dirname(cm.slot_dir()))
    as_attacker("import os, sys; os.mkdir(sys.argv[1] + '.theirs'); os.symlink(sys.argv[1] + '.theirs', sys.argv[1])",
                base)
    with pytest.raises(UnsafePathError, match="symlink"):
        cm.save(1, {"n": 1})
    assert os.listdir(base + ".theirs") == []


@needs_root
def test_mmap_cache_dir_of_another_user_degrades_to_uncached_reads_with_one_warning(env, shared_base, monkeypatch,
                                                                                   caplog):
    """Issue 33, item 5: UnsafePathError is not an OSError, so the loader's degrade path was skipped and the
    squatted cache_dir ended the job. Now: the batches come from the wrapped loader, one warning says why,
    and nothing is written to or read from the other user's directory."""
    cache = os.path.join(shared_base, "pdl_cache")
    as_attacker("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", cache)
    monkeypatch.setattr(loader_mod, "_WARNED", False)
    caplog.set_level("INFO", logger="hyperpodrun.data")
    for name in ("train", "val"):   # two loaders of one process: still one warning
        mm = MMAPDataLoader([torch.full((1,), float(i)) for i in range(3)], CacheResumeMMAPConfig(cache_dir=cache),
                            epochs=1, name=name)
        assert [(s, b.item()) for s, b in mm.iter_from(0)] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "MMAP data cache off" in r.getMessage()]
    assert len(warnings) == 1 and "belongs to uid 65534" in warnings[0].getMessage()
    assert os.listdir(cache) == []
    loader_mod.shutdown()


@needs_root
def test_job_with_a_squatted_slot_base_runs_on_a_private_one(launcher, shared_base):
    """Issue 33, item 5: a real job (2 ranks, --inprocess-restart, a fault and a restore from the slots) whose
    slot base another user created first ended with UnsafePathError. Now the agent makes a private base
    beside it, hands it to the workers (an event says so) and removes it at the end; the other user's
    directory is neither used nor touched."""
    squatted = os.path.join(shared_base, f"hyperpodrun-{os.getuid()}")
    as_attacker("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", squatted)
    res = _run_ckpt_job(launcher, shared_base, inprocess=True, faults="raise:1:3:top")
    assert res.rc == 0, res
    [event] = [e for e in read_events(launcher.log_dir) if e["event"] == "slot_base_squatted"]
    assert event["path"] == squatted and os.path.dirname(event["private"]) == shared_base
    restores = [line.split() for line in (launcher.tmp / "out" / "restores.rank1").read_text().splitlines()]
    assert [gen for gen, *_ in restores] == ["0", "1"] and int(restores[1][1]) >= 2, restores   # state restored
    assert os.listdir(squatted) == [] and os.listdir(shared_base) == [os.path.basename(squatted)]


def test_stale_snapshot_runs_are_removed_at_start_live_ones_kept(env):
    base = shm_runs.checkpoint_base(str(env))
    os.makedirs(base, mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    runs = {}
    for name, pid in (("gone.1", dead.pid), ("alive.2", os.getpid())):
        path = os.path.join(base, name)
        os.makedirs(os.path.join(path, "rank0"), mode=0o700)
        open(os.path.join(path, "rank0", "slot0"), "wb").write(b"x" * 100)
        with open(os.path.join(path, "owner.json"), "w") as fh:
            json.dump({"pid": pid, "start_time": shm_runs.start_time(pid), "run_id": name}, fh)
        runs[name] = path
    cm = CheckpointManager(shm_dir=str(env))
    cm.save(1, {"n": 1})
    assert not os.path.exists(runs["gone.1"]) and os.path.exists(runs["alive.2"])
    cm.close(success=True)
    assert sorted(os.listdir(base)) == ["alive.2"], "close(success=True) must remove this run's directory"


# ------------------------------------------------------------------------------------------ jobs
def _run_ckpt_job(launcher, shm: str, inprocess: bool, faults: str = "", extra_env: Optional[dict] = None):
    out = launcher.tmp / "out"
    out.mkdir(exist_ok=True)
    env = {"OUT_DIR": str(out), "HYPERPODRUN_SHM_DIR": shm, "MODE": "allreduce", "STEPS": "6", "DIM": "16",
           "FAULTS": faults, **(extra_env or {})}
    args = ["--nproc-per-node", "2", *(["--inprocess-restart", "--inprocess-timeout", "60"] if inprocess else []),
            str(SCRIPTS / "ckpt_worker.py")]
    return launcher.run(args, env=env, timeout=180)


@pytest.mark.parametrize("inprocess", [True, False], ids=["inprocess", "process"])
def test_successful_job_leaves_nothing_in_shared_memory(launcher, inprocess):
    """A job that finished successfully leaves no snapshots (run directory, slots, owner and lock files).
    In-process (with a fault and a restore first): the ranks remove them at the completion barrier - the
    slots are in a directory given in code, which the agent does not know. Without: the agent removes them
    once every worker exited 0."""
    shm = launcher.tmp / "shm"
    shm.mkdir()
    if inprocess:
        res = _run_ckpt_job(launcher, "/nonexistent", True, faults="raise:1:3:top", extra_env={"CKPT_SHM_DIR": str(shm)})
    else:
        res = _run_ckpt_job(launcher, str(shm), False)
    assert res.rc == 0, res
    if inprocess:
        # generation 1 restores step 3 (saved just before the fault) or, when that save was still in flight as
        # the restart came and was dropped (checkpoint.py: a timing, not a rule), step 2: a restore either way
        entries = (launcher.tmp / "out" / "entries.rank0").read_text().split("\n")
        restored = [line.split()[1] for line in entries if line and line.split()[0] == "1"]
        assert restored in (["3"], ["2"]), f"generation 1 did not restore step 3 or 2: {entries}"
    assert os.listdir(shm) == [], f"left in shared memory: {[p for p, _, _ in os.walk(shm)]}"


LIGHTNING_JOB = """
import os, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from hyperpodrun import (CacheResumeMMAPConfig, CheckpointlessCallback, CheckpointManager, MMAPDataModule,
                         ResumableSampler)

class Data(pl.LightningDataModule):
    def train_dataloader(self):
        ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        return DataLoader(ds, batch_size=8, sampler=ResumableSampler(ds))

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)
    def training_step(self, b, i):
        return F.mse_loss(self.l(b[0]), b[1])
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

cm = CheckpointManager(shm_dir=sys.argv[2])
trainer = pl.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[CheckpointlessCallback(checkpoint_manager=cm)])
data = MMAPDataModule(data_module=Data(), mmap_config=CacheResumeMMAPConfig(cache_dir=sys.argv[1],
                                                                            prefetch_length=4))
trainer.fit(Net(), data)
assert trainer.global_step == 5 and data.train_dataloader().stats["cached"] >= 5, data.train_dataloader().stats
print("fit done", flush=True)
"""


def test_lightning_job_stopping_at_max_steps_leaves_no_cache_and_no_snapshots(tmp_path):
    """Lightning tears the data module down before it marks the fit finished: the MMAP cache of a fit that
    reached max_steps (mid-epoch, its stream not exhausted) is removed at exit, and the snapshots too."""
    cache, shm = tmp_path / "cache", tmp_path / "shm"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERPODRUN_", "TORCHELASTIC_"))}
    proc = subprocess.run([sys.executable, "-c", LIGHTNING_JOB, str(cache), str(shm)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "fit done" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not cache.exists(), f"MMAP cache left: {[p for p, _, _ in os.walk(cache)]}"
    assert os.listdir(shm) == [], f"snapshots left: {[p for p, _, _ in os.walk(shm)]}"


def test_a_fresh_start_refuses_state_this_rank_already_trained(env, monkeypatch):
    """A fault before every rank completed its first snapshot makes the job start again from the beginning
    (another rank, running since the start, has none). Objects built inside the wrapped function are new and
    simply start over; objects this rank already trained (built outside it) cannot be rewound: exit 75 with a
    message that says what to do, never a silent mix of trained and fresh state."""
    import types
    from hyperpodrun.state import restoring as ckpt   # where restore() finds its gather
    from hyperpodrun.errors import StateLostError
    cm = CheckpointManager(shm_dir=str(env))
    cm.attach(types.SimpleNamespace(iteration=0, store=None), None)
    model = torch.nn.Linear(4, 4)
    cm.save(1, {"model": model})
    other = {"shm": [], "disk": [], "latest": None, "copies": {}, "never_committed": True, "live": None, "at": None}
    from hyperpodrun.state.restore.restore_inventory import Gathered
    monkeypatch.setattr(ckpt, "gather", lambda mine, channel: Gathered([mine, other], {}))
    with pytest.raises(StateLostError, match=r"\['model'\] are the objects this rank already trained"):
        cm.restore({"model": model})
    assert cm.restore({"model": torch.nn.Linear(4, 4)}) is None   # rebuilt: starts over
