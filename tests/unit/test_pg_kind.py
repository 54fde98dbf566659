"""The abort, park/release and wire-device paths dispatch on what a process group really is - its backend
objects (hyperpodrun/runtime/pg_kind.py) - not on the name the user typed: torch 2.15's "nccl" is nccl2
(ProcessGroupNCCL2), "nccl-legacy" is ProcessGroupNCCL, and their aborts differ (one NCCL group around
legacy communicators' aborts; none for nccl2). Real gloo groups where the real thing exists here; the NCCL
backends cannot exist without a GPU, so they are stand-in objects (their class or the name they report)."""
from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyperpodrun.runtime import abort, pg_kind
from hyperpodrun.state.restore.replica_stream import wire_device

c10d = dist.distributed_c10d


class _Backend:
    """A stand-in c10d backend that reports a name, as c10d::Backend::getBackendName does."""

    def __init__(self, name: str, calls: list[str], tag: str = "") -> None:
        self._name, self.calls, self.tag = name, calls, tag

    def name(self) -> str:
        return self._name


class _Legacy(_Backend):
    """nccl-legacy: aborts bracketed by ncclGroupStart/End through the backend."""

    def _group_start(self) -> None:
        self.calls.append("group_start")

    def _group_end(self) -> None:
        self.calls.append("group_end")


class _Group:
    """A stand-in ProcessGroup: its device types, a backend per type, an abort that is recorded."""

    def __init__(self, backends: dict[str, Any], calls: list[str], tag: str) -> None:
        self._backends, self.calls, self.tag = backends, calls, tag
        self._device_types = [torch.device(d) for d in backends]

    def _get_backend(self, dev: torch.device) -> Any:
        return self._backends[dev.type]

    def abort(self) -> None:
        self.calls.append(f"abort {self.tag}")


def _gloo(tmp_path, name: str) -> None:
    store = dist.FileStore(str(tmp_path / name), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def clean_groups():
    yield
    abort.release_parked(wait=True, timeout=10)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_real_gloo_group_is_gloo_and_needs_no_communicator_abort(tmp_path, clean_groups):
    _gloo(tmp_path, "g")
    group = c10d._get_default_group()
    assert pg_kind.group_kinds(group) == {pg_kind.GLOO}
    assert pg_kind.current_kinds() == {pg_kind.GLOO}
    assert not pg_kind.uses_nccl(pg_kind.current_kinds())
    assert pg_kind.group_bracket([group]) == (None, None)
    assert wire_device() == torch.device("cpu")


def test_the_kind_comes_from_the_backend_class_then_from_the_name_it_reports(monkeypatch):
    calls: list[str] = []

    class ProcessGroupNCCL2:   # stands for torch 2.15's class (absent from a CPU build)
        def name(self) -> str:
            return "nccl"          # a name that would mislead: the class decides

    monkeypatch.setattr(c10d, "ProcessGroupNCCL2", ProcessGroupNCCL2, raising=False)
    assert pg_kind.backend_kind(ProcessGroupNCCL2()) == pg_kind.NCCL2
    assert pg_kind.backend_kind(_Backend("nccl2", calls)) == pg_kind.NCCL2
    assert pg_kind.backend_kind(_Backend("nccl-lazy", calls)) == pg_kind.NCCL2
    assert pg_kind.backend_kind(_Legacy("nccl", calls)) == pg_kind.NCCL_LEGACY
    assert pg_kind.backend_kind(_Backend("gloo", calls)) == pg_kind.GLOO
    assert pg_kind.backend_kind(_Backend("ucc", calls)) == pg_kind.OTHER
    assert pg_kind.backend_kind(None) == pg_kind.OTHER
    mixed = _Group({"cpu": _Backend("gloo", calls), "cuda": _Backend("nccl2", calls)}, calls, "m")
    assert pg_kind.group_kinds(mixed) == {pg_kind.GLOO, pg_kind.NCCL2}
    assert pg_kind.uses_nccl(pg_kind.group_kinds(mixed))


@pytest.mark.parametrize("kinds, expected", [
    (("legacy", "legacy"), ["group_start", "abort b", "abort a", "group_end"]),
    (("nccl2", "nccl2"), ["abort b", "abort a"]),
    (("nccl2", "legacy"), ["group_start", "abort b", "abort a", "group_end"]),
], ids=["nccl-legacy", "nccl2", "both"])
def test_the_background_abort_brackets_legacy_communicators_only(monkeypatch, kinds, expected, clean_groups):
    """abort_nccl_in_background: nccl-legacy aborts run inside one NCCL group (torch 2.13's
    _abort_process_group); nccl2's backend has no such bracket and aborts each communicator itself."""
    calls: list[str] = []
    make = {"legacy": lambda: _Legacy("nccl", calls), "nccl2": lambda: _Backend("nccl2", calls)}
    groups = [_Group({"cuda": make[k]()}, calls, tag) for k, tag in zip(kinds, "ab")]
    monkeypatch.setattr(pg_kind, "registered_groups", lambda: list(reversed(groups)))   # newest first
    assert abort.abort_nccl_in_background()
    aborter = abort._RELEASER
    assert aborter is not None
    aborter.join(10)
    assert calls == expected


def _abort_path(monkeypatch) -> list[str]:
    """Run AbortProcessGroups on the current groups; which path it took (the background NCCL abort or not)."""
    taken: list[str] = []
    real = abort.abort_nccl_in_background

    def spy() -> bool:
        taken.append("nccl")
        return real()
    monkeypatch.setattr(abort, "abort_nccl_in_background", spy)
    abort.AbortProcessGroups()()
    return taken


def test_a_group_named_nccl_that_is_gloo_is_aborted_as_gloo(tmp_path, monkeypatch, clean_groups):
    """The name says nccl, the backend is gloo: no communicator abort, the group is parked and gone from
    torch's registry so the next one forms."""
    _gloo(tmp_path, "named")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert _abort_path(monkeypatch) == []
    assert not dist.is_initialized() and abort.parked_count() >= 1
    _gloo(tmp_path, "next")


def test_a_group_whose_backend_is_nccl2_takes_the_nccl_abort_whatever_its_name(tmp_path, monkeypatch,
                                                                                 clean_groups):
    """The name says gloo; the backend object is (here made to count as) ProcessGroupNCCL2: the
    communicators are aborted in the background and the next group forms at once."""
    _gloo(tmp_path, "real")
    monkeypatch.setattr(c10d, "ProcessGroupNCCL2", c10d.ProcessGroupGloo, raising=False)
    assert pg_kind.current_kinds() == {pg_kind.NCCL2} and dist.get_backend() == "gloo"
    assert _abort_path(monkeypatch) == ["nccl"]
    assert not dist.is_initialized()
    _gloo(tmp_path, "after")


def test_the_registry_detach_drops_flight_recorder_hooks_and_leaves_torchcomms_to_torch(tmp_path, monkeypatch,
                                                                                      clean_groups):
    """torch 2.15 keeps each nccl2 group's FlightRecorder hook in `_world.pg_flight_recorder_hooks`, keyed by
    the group: a detach that left it would hold every ended group alive. Communicators of torchcomms
    (`_world.comms`) only torch's destroy_process_group finalizes: then nothing is detached."""
    world = c10d._world
    _gloo(tmp_path, "fr")
    group = c10d._get_default_group()
    if not isinstance(getattr(world, "pg_flight_recorder_hooks", None), dict):   # torch < 2.15
        monkeypatch.setattr(world, "pg_flight_recorder_hooks", {}, raising=False)
    world.pg_flight_recorder_hooks[group] = object()
    comms = getattr(world, "comms", None)
    if isinstance(comms, list):
        comms.append(object())
        try:
            assert not abort._detach_registry(c10d) and dist.is_initialized()
        finally:
            comms.pop()
    assert abort._detach_registry(c10d)
    assert not dist.is_initialized() and world.pg_flight_recorder_hooks == {}
    abort._PARKED.append(group)    # what park_process_groups does first; released by the fixture
    del group


def test_the_wire_device_follows_the_groups_device_types(tmp_path, monkeypatch, clean_groups):
    calls: list[str] = []
    nccl_only = _Group({"cuda": _Backend("nccl2", calls)}, calls, "n")
    mixed = _Group({"cpu": _Backend("gloo", calls), "cuda": _Legacy("nccl", calls)}, calls, "m")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(c10d, "_get_default_group", lambda: nccl_only)
    assert wire_device() == torch.device("cuda", 0)
    monkeypatch.setattr(c10d, "_get_default_group", lambda: mixed)
    assert wire_device() == torch.device("cpu")
