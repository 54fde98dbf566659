"""The registry half of a background NCCL abort (hyperpodrun/runtime/abort.py, _detach_registry), with real
torch.distributed groups: once detached, init_process_group works again at once while the old group is still
alive (parked, not destructed), and it is destructed later by the releaser. The NCCL aborts themselves need
a GPU (measured in scripts/bench/gpu/gpu_restart_phases.py)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hyperpodrun.launch import settings
from hyperpodrun.runtime import abort


def _group(tmp_path, name: str) -> None:
    store = dist.FileStore(str(tmp_path / name), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))


def test_a_detached_registry_lets_the_next_group_form_while_the_old_one_lives(tmp_path):
    _group(tmp_path, "g0")
    try:
        old = dist.group.WORLD
        abort.park_process_groups()
        assert abort._detach_registry(dist.distributed_c10d)
        assert not dist.is_initialized()
        _group(tmp_path, "g1")                       # the next generation's group, at once
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
        assert any(pg is old for pg in abort._PARKED), "the old group is parked, not destructed"
        del old
        abort.release_parked(wait=True, timeout=10)  # destructed off the main thread, then gone
        assert abort.parked_count() == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_background_abort_is_on_by_default_and_off_leaves_the_groups_alone(tmp_path, monkeypatch):
    assert settings.load({}).nccl_abort_background is True
    monkeypatch.setenv("HYPERPODRUN_NCCL_ABORT_BACKGROUND", "0")
    _group(tmp_path, "off")
    try:
        assert abort.abort_nccl_in_background() is False   # the caller aborts in its own thread instead
        assert dist.is_initialized() and abort.parked_count() == 0
    finally:
        dist.destroy_process_group()


def test_a_background_abort_forms_the_next_group_at_once_and_the_releaser_waits_for_it(tmp_path):
    """abort_nccl_in_background's threading with a real group (gloo: its abort() does nothing, so this checks
    the order of things, not NCCL): the caller goes on with a new group at once, the abort thread runs, and
    the parked group is destructed only after it, by the releaser."""
    _group(tmp_path, "b0")
    try:
        old_backend = dist.get_backend()
        assert abort.abort_nccl_in_background()
        assert not dist.is_initialized()
        aborter = abort._RELEASER
        assert aborter is not None and aborter.name == "hyperpodrun-nccl-abort"
        _group(tmp_path, "b1")
        t = torch.full((2,), 3.0)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((2,), 3.0)) and old_backend == "gloo"
        abort.release_parked(wait=True, timeout=10)
        assert not aborter.is_alive() and abort.parked_count() == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
