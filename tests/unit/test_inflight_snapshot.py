"""A snapshot still being copied when a restart comes (CheckpointManager(enable_offload=True)): it is kept when
what it copies was final before the first abort began - the rank keeps the step it completed, nothing is lost
and nothing copied back - and dropped otherwise (on a GPU, work queued before the save that the abort may cut)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from hyperpodrun import CheckpointManager
from hyperpodrun.state.slots import snapshot_copy
from hyperpodrun.state.slots import snapshot_io


class FakeSession:
    """The two things CheckpointManager reads of the control session: restart_seen and on_abort."""

    def __init__(self) -> None:
        self.restart_seen = -1
        self.callbacks: list[Callable[[], None]] = []

    def on_abort(self, callback: Callable[[], None]) -> None:
        if callback not in self.callbacks:
            self.callbacks.append(callback)

    def restart(self, generation: int, aborting: bool) -> None:
        if aborting:                       # Session._on_command: the abort callbacks run first
            for callback in self.callbacks:
                callback()
        self.restart_seen = generation


class Caller:
    iteration = 0
    store = None


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cm = CheckpointManager(enable_offload=True, shm_dir=str(tmp_path))
    session = FakeSession()
    cm.attach(Caller(), session)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    yield cm, session, {"model": model, "opt": opt}
    cm.wait()


def gate_copies(monkeypatch) -> threading.Event:
    """Hold the background copy of the next snapshot until the returned event is set."""
    release = threading.Event()
    real = snapshot_copy.finish_copies

    def held(*args: Any, **kwargs: Any) -> bool:
        assert release.wait(30), "the test never released the copy"
        return real(*args, **kwargs)
    monkeypatch.setattr(snapshot_copy, "finish_copies", held)
    return release


def restart_while_copying(cm, session, state, monkeypatch, aborting: bool) -> None:
    """save(4) completes; save(5) is held mid-copy while RESTART for generation 1 comes (its abort callbacks
    run first when `aborting`); then the copy is let finish."""
    cm.save(4, state)
    cm.wait()
    release = gate_copies(monkeypatch)
    cm.save(5, state)                      # copying in the background
    session.restart(1, aborting=aborting)
    release.set()
    cm.wait()


def test_a_snapshot_whose_data_was_final_before_the_abort_is_kept(manager, monkeypatch):
    cm, session, state = manager
    restart_while_copying(cm, session, state, monkeypatch, aborting=True)
    assert cm.last_saved == 5


def test_a_restart_seen_before_the_data_was_judged_drops_the_snapshot(manager, monkeypatch):
    cm, session, state = manager
    restart_while_copying(cm, session, state, monkeypatch, aborting=False)   # no judgement: cannot be trusted
    assert cm.last_saved == 4


def test_a_snapshot_whose_device_work_was_pending_is_dropped(manager, monkeypatch):
    cm, session, state = manager
    monkeypatch.setattr(snapshot_copy, "data_final", lambda staged: False)   # a GPU still computing its inputs
    restart_while_copying(cm, session, state, monkeypatch, aborting=True)
    assert cm.last_saved == 4


class Event:
    def __init__(self, done: Any) -> None:
        self.done = done

    def query(self) -> bool:
        if isinstance(self.done, Exception):
            raise self.done
        return bool(self.done)


@pytest.mark.parametrize("events,final", [
    ({}, True),                                                  # host tensors only
    ({"cuda:0": Event(True), "cuda:1": Event(True)}, True),
    ({"cuda:0": Event(True), "cuda:1": Event(False)}, False),    # one device still computing
    ({"cuda:0": Event(RuntimeError("CUDA error: an illegal memory access"))}, False),
], ids=["host", "devices-done", "one-pending", "broken-context"])
def test_data_final(events, final):
    staged = snapshot_io.Staged(step=1, source_events=events)
    assert snapshot_copy.data_final(staged) is final


def test_a_save_of_host_tensors_made_after_the_restart_was_requested_is_kept(manager, monkeypatch):
    """A rank still inside save() when RESTART came (the restart lands once the save is done): host tensors
    were computed before any collective could fail, so that snapshot holds the step it names."""
    cm, session, state = manager
    cm.save(4, state)
    cm.wait()
    session.restart(1, aborting=True)      # judged while nothing was in flight
    release = gate_copies(monkeypatch)
    cm.save(5, state)
    release.set()
    cm.wait()
    assert cm.last_saved == 5
