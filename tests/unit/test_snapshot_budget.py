"""The overhead budget (hyperpodrun/runtime/snapshot_budget.py): the snapshot interval follows from measured costs,
and a CheckpointManager under it snapshots every k-th save(), certifies the others, and restores the step of its
last save() call from its live objects whether or not that call was snapshotted."""
from __future__ import annotations

import torch

from hyperpodrun.runtime.snapshot_budget import MAX_INTERVAL, OverheadBudget


def _budget(step_s: float, call_s: float, snapshot_s: float, share: float = 0.02) -> OverheadBudget:
    b = OverheadBudget(share)
    b.step_s, b.call_s = step_s, call_s
    b.snapshot_cost(snapshot_s)
    return b


def test_the_interval_keeps_the_cost_within_the_budget() -> None:
    b = _budget(step_s=0.100, call_s=0.0005, snapshot_s=0.008)   # room 1.5 ms a step, 7.5 ms extra a snapshot
    assert b.interval == 5
    assert 0.0005 + (0.008 - 0.0005) / b.interval <= 0.02 * 0.100 + 1e-12
    assert _budget(0.100, 0.0005, 0.0015).interval == 1           # cheap: every call
    assert _budget(0.100, 0.003, 0.010).interval == MAX_INTERVAL  # certifying alone spends the budget


def test_the_bound_on_retrained_steps_counts_snapshots_in_flight() -> None:
    b = _budget(0.1, 0.0, 0.006)
    b.in_flight(2)
    b.in_flight(1)
    assert (b.interval, b.retrain_bound) == (3, 5)


def test_no_budget_means_every_call() -> None:
    b = OverheadBudget(None)
    b.step_s, b.call_s = 0.1, 0.0
    b.snapshot_cost(1.0)
    assert b.interval == 1


def test_a_budgeted_manager_snapshots_every_kth_call_and_keeps_live_steps(tmp_path, monkeypatch) -> None:
    """A state handled as a GPU state is (snapshots behind the training, within the budget), on CPU tensors: with
    an interval of 3 once measured, calls 3, 6, 9 are snapshotted (the others certified) - the first two map their
    slot files, a cost the budget does not count, so the interval is first known at the third; a restore of the
    unchanged objects gives step 11 from them, and once they changed, the newest snapshot - from the slot, 9."""
    from hyperpodrun import CheckpointManager
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(OverheadBudget, "_update", lambda self: setattr(self, "interval", 3))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    cm = CheckpointManager(shm_dir=str(tmp_path))
    cm._on_gpu = True                       # budgeted as a GPU state is
    sealed = []
    for step in range(1, 12):
        with torch.no_grad():
            model.weight.add_(0.01)
        cm.save(step, state)
        cm.wait()                           # nothing in flight: only the interval decides
        sealed.append(cm.last_saved)
    assert sealed == [1, 2, 3, 3, 3, 6, 6, 6, 9, 9, 9]
    assert cm.snapshot_interval == 3
    at_11 = model.weight.detach().clone()
    assert cm.restore(state) == 11 and cm.restored_from == "live"
    assert torch.equal(model.weight, at_11)
    with torch.no_grad():
        model.weight.add_(1.0)              # the live values are gone: back to the newest snapshot
    assert cm.restore(state) == 9 and cm.restored_from == "shm"
    assert torch.allclose(model.weight, at_11 - 0.02)
    cm.close()
