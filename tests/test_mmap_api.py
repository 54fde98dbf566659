"""The MMAP cache's public surface: config validation with actionable errors, importing without Lightning,
MMAPDataModule over a duck-typed data module and over a LightningDataModule subclass, stale-run cleanup."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hyperpodrun.data import CacheResumeMMAPConfig, MMAPConfigError, MMAPDataLoader, MMAPDataModule
from hyperpodrun.data import housekeeping
from hyperpodrun.data import loader as loader_mod


@pytest.fixture(autouse=True)
def _stop_producers():
    yield
    loader_mod.shutdown()


# ------------------------------------------------------------------------------------------ config
def test_defaults_are_the_product_notes():
    cfg = CacheResumeMMAPConfig()
    # the product note's /dev/shm/pdl_cache, one per user (another user could take a shared name first)
    assert (cfg.cache_dir, cfg.prefetch_length, cfg.lookback_length) == (f"/dev/shm/pdl_cache-{os.getuid()}", 10, 2)
    assert cfg.window == 12


@pytest.mark.parametrize("field,value,words", [
    ("prefetch_length", 0, ["prefetch_length", ">= 1"]),
    ("prefetch_length", 2.5, ["prefetch_length", "integer"]),
    ("prefetch_length", True, ["prefetch_length", "integer"]),
    ("lookback_length", -1, ["lookback_length", ">= 0"]),
    ("cache_dir", "", ["cache_dir", "/dev/shm"]),
    ("cache_dir", None, ["cache_dir"]),
    ("share_key", "tp group/1", ["share_key", "A-Za-z0-9"]),
    ("share_key", "", ["share_key"]),
    ("max_bytes", 0, ["max_bytes", ">= 1"]),
    ("resume", "sometimes", ["resume", "auto", "replay"]),
    ("wait_timeout", 0, ["wait_timeout", "positive"]),
    ("enabled", "yes", ["enabled", "True or False"]),
])
def test_invalid_config_names_the_field_and_the_fix(field, value, words):
    with pytest.raises(MMAPConfigError) as info:
        CacheResumeMMAPConfig(**{field: value})
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_relative_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CacheResumeMMAPConfig(cache_dir="cache").cache_dir == str(tmp_path / "cache")


# ------------------------------------------------------------------------------------------ imports
def test_importing_hyperpodrun_and_the_data_api_does_not_import_lightning():
    code = """
import sys
import hyperpodrun
from hyperpodrun import CacheResumeMMAPConfig, MMAPDataModule, MMAPDataLoader, ResumableSampler
class DM:
    def train_dataloader(self):
        return [1, 2, 3]
MMAPDataModule(data_module=DM(), mmap_config=CacheResumeMMAPConfig())
bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'agent')]
print('BAD' if bad else 'OK', bad)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("OK"), out.stdout + out.stderr


# ------------------------------------------------------------------------------------------ data module
class DuckDataModule:
    """What Trainer.fit needs from a data module, without Lightning."""

    def __init__(self):
        self.calls = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage=None):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return [torch.full((2,), float(i)) for i in range(6)]

    def val_dataloader(self):
        return ["val"]

    def teardown(self, stage=None):
        self.calls.append(f"teardown:{stage}")

    def state_dict(self):
        return {"mine": 1}

    def load_state_dict(self, state):
        self.calls.append(f"load:{state}")

    extra_attribute = "kept"


def test_datamodule_serves_training_batches_from_the_cache_and_delegates_the_rest(tmp_path):
    inner = DuckDataModule()
    dm = MMAPDataModule(data_module=inner, mmap_config=CacheResumeMMAPConfig(cache_dir=str(tmp_path / "c")))
    dm.prepare_data()
    dm.setup("fit")
    train = dm.train_dataloader()
    assert isinstance(train, MMAPDataLoader) and dm.train_dataloader() is train
    assert [float(b[0]) for b in train] == [0, 1, 2, 3, 4, 5]
    assert train.stats["cached"] == 6
    assert dm.val_dataloader() == ["val"] and dm.extra_attribute == "kept"
    state = dm.state_dict()
    assert state == {"data_module": {"mine": 1}, "mmap_train_step": 6}
    # a restored module resumes the stream at the saved step
    again = MMAPDataModule(data_module=DuckDataModule(), mmap_config=CacheResumeMMAPConfig(cache_dir=str(tmp_path / "c")))
    again.load_state_dict({"data_module": {"mine": 1}, "mmap_train_step": 4})
    assert [float(b[0]) for b in again.train_dataloader()] == [4, 5]
    dm.teardown("fit")
    assert inner.calls == ["prepare_data", "setup:fit", "teardown:fit"]


def test_datamodule_is_a_lightning_datamodule_when_the_wrapped_one_is():
    class LightningDataModule:          # stands in for lightning.pytorch.LightningDataModule
        def __init__(self):
            self.trainer = None
            self.inited = True

    class Mine(LightningDataModule):
        def train_dataloader(self):
            return [torch.zeros(1)]

    dm = MMAPDataModule(data_module=Mine(), mmap_config=CacheResumeMMAPConfig())
    assert isinstance(dm, LightningDataModule) and isinstance(dm, MMAPDataModule)
    assert dm.inited and dm.trainer is None
    assert type(MMAPDataModule(data_module=Mine())) is type(dm), "one subclass per Lightning base"
    with pytest.raises(TypeError, match="train_dataloader"):
        MMAPDataModule(data_module=object())


# ------------------------------------------------------------------------------------------ housekeeping
def _run_dir(cache, name, pid, start_time):
    cache.mkdir(mode=0o700, exist_ok=True)     # cache_dir must be this user's alone (0700)
    path = cache / name
    path.mkdir(mode=0o700)
    (path / "owner.json").write_text(json.dumps({"pid": pid, "start_time": start_time, "run_id": name}))
    (path / "alive.lock").touch()
    (path / "train.rank0").mkdir()
    (path / "train.rank0" / "b000000000001.batch").write_bytes(b"x" * 100)
    return path


def test_stale_runs_are_removed_live_or_locked_ones_kept(tmp_path):
    cache = tmp_path / "cache"
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    gone = _run_dir(cache, "gone.1", dead.pid, 12345)
    reused = _run_dir(cache, "reused.2", me, (housekeeping.start_time(me) or 0) + 1)   # same pid, other process
    alive = _run_dir(cache, "alive.3", me, housekeeping.start_time(me))
    locked = _run_dir(cache, "locked.4", dead.pid, 1)
    foreign = cache / "someone-elses"
    foreign.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.lockf(fd, fcntl.LOCK_SH); "
        "print('held', flush=True); sys.stdin.read()"), str(locked / "alive.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = housekeeping.remove_stale(str(cache), keep="none")
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert sorted(removed) == sorted([str(gone), str(reused)])
    assert alive.exists() and locked.exists() and foreign.exists()
    assert not gone.exists() and not reused.exists()


def test_opening_the_cache_removes_stale_runs_first(tmp_path):
    cache = tmp_path / "cache"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = _run_dir(cache, "old-run.99", dead.pid, 1)
    mm = MMAPDataLoader([torch.zeros(1)] * 3, CacheResumeMMAPConfig(cache_dir=str(cache)), epochs=1)
    assert len(list(mm.iter_from(0))) == 3
    assert not stale.exists()
    assert os.path.basename(os.path.dirname(mm.group_dir)) == f"local.{os.getpid()}"
    loader_mod.shutdown()
    assert not cache.exists(), "a finished run left files behind"
