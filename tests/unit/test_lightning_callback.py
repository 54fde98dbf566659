"""The Lightning callback reaches the wrapped call's `caller` through CheckpointManager's public API
(`attach` by HPWrapper, `caller`), not through a private attribute."""
from __future__ import annotations

import types

import pytest


class _Caller:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def progress(self, step: int) -> None:
        self.steps.append(step)


def test_progress_goes_to_the_caller_the_manager_was_attached_to(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    from hyperpodrun import CheckpointlessCallback, CheckpointManager
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cm = CheckpointManager()
    assert cm.caller is None, "not attached yet"
    caller = _Caller()
    cm.attach(caller, None)
    assert cm.caller is caller
    callback = CheckpointlessCallback(checkpoint_manager=cm)
    callback.on_train_batch_start(types.SimpleNamespace(global_step=12), None, None, 0)   # no trainer.wrapper
    assert caller.steps == [12]
    other = _Caller()
    callback.on_train_batch_start(types.SimpleNamespace(global_step=13, wrapper=other), None, None, 0)
    assert other.steps == [13] and caller.steps == [12], "trainer.wrapper, when the script sets it, wins"
