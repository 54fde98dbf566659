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


def test_steps_slowed_by_a_snapshot_in_flight_count_against_it() -> None:
    """A snapshot whose device->host copy runs beside two steps and makes each 5 ms slower costs 10 ms more than
    its save() call: the interval grows to keep the whole within the budget."""
    b = OverheadBudget(0.02)
    b.step_s, b.busy_step_s, b.call_s = 0.100, 0.105, 0.0
    b.in_flight(2)
    b.snapshot_cost(0.002)
    assert b.interval == 4                       # (2 + 2 * 5) ms / 2 ms = 6 steps a cycle, 2 of them in flight
    b.busy_step_s = 0.100
    b.snapshot_cost(0.002)
    assert b.interval < 4


def test_the_bound_on_retrained_steps_counts_snapshots_in_flight() -> None:
    b = _budget(0.1, 0.0, 0.006)
    b.in_flight(2)
    b.in_flight(1)
    assert (b.interval, b.retrain_bound) == (3, 7)     # the restored one and the next may each be in flight 2


def test_mapping_a_slot_is_not_counted_as_a_snapshots_cost(tmp_path, monkeypatch) -> None:
    """The first snapshot into each slot maps (on a GPU host: registers) the file - a one-time cost that must not
    set the interval (it made it jump to its cap on an H200): what the budget is told leaves it out."""
    from hyperpodrun import CheckpointManager
    from hyperpodrun.runtime import snapshot_io
    monkeypatch.setenv("RANK", "0")
    told: list[float] = []
    monkeypatch.setattr(OverheadBudget, "snapshot_cost", lambda self, s: told.append(s))
    real = snapshot_io.SlotFile.prepare

    def slow_prepare(self, staged, pin):   # a mapping that takes 0.5 s, as registering 6.4 GB does
        view = real(self, staged, pin)
        if self.mapped_now:
            import time
            time.sleep(0.5)
        return view
    monkeypatch.setattr(snapshot_io.SlotFile, "prepare", slow_prepare)
    cm = CheckpointManager(shm_dir=str(tmp_path))
    cm._on_gpu = True
    model = torch.nn.Linear(4, 4)
    for step in (1, 2, 3):
        cm.save(step, {"model": model})
        cm.wait()
    assert len(told) == 3 and max(told) < 0.4, told
    cm.close()


def test_no_budget_means_every_call() -> None:
    b = OverheadBudget(None)
    b.step_s, b.call_s = 0.1, 0.0
    b.snapshot_cost(1.0)
    assert b.interval == 1


def test_a_budgeted_manager_snapshots_every_kth_call_and_keeps_live_steps(tmp_path, monkeypatch) -> None:
    """A state handled as a GPU state is (snapshots behind the training, within the budget), on CPU tensors: with
    an interval of 3, calls 1, 4, 7, 10 are snapshotted (the others certified); a restore of the unchanged objects
    gives step 11 from them, and once they changed, the newest snapshot - from the slot, step 10."""
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
    assert sealed == [1, 1, 1, 4, 4, 4, 7, 7, 7, 10, 10]
    assert cm.snapshot_interval == 3
    at_11 = model.weight.detach().clone()
    assert cm.restore(state) == 11 and cm.restored_from == "live"
    assert torch.equal(model.weight, at_11)
    with torch.no_grad():
        model.weight.add_(1.0)              # the live values are gone: back to the newest snapshot
    assert cm.restore(state) == 10 and cm.restored_from == "shm"
    assert torch.allclose(model.weight, at_11 - 0.01)
    cm.close()


def test_a_seeded_budget_takes_only_sane_values_and_never_overrides_its_own() -> None:
    b = OverheadBudget(0.02)
    assert not b.seed({"snapshot_s": float("nan"), "step_s": -1.0, "call_s": True})
    assert b.seed({"step_s": 0.1, "call_s": 0.0, "snapshot_s": 0.006})
    assert b.interval == 3
    assert not b.seed({"step_s": 0.1, "call_s": 0.0, "snapshot_s": 0.05})   # measured already: kept
    assert b.export() == {"step_s": 0.1, "call_s": 0.0, "snapshot_s": 0.006}


def test_a_replacement_keeps_its_predecessors_cadence_instead_of_snapshotting_its_first_save(
        tmp_path, monkeypatch) -> None:
    """A process that restores a snapshot starts with the snapshot cadence its predecessor measured (carried in
    the snapshot): its first save() after the restore certifies only - a snapshot there would map and register
    a slot of its own inside the first step after the recovery - and the next snapshot comes one interval after
    the restored one. Without the cadence it would snapshot at once."""
    from hyperpodrun import CheckpointManager
    monkeypatch.setenv("RANK", "0")
    # whatever was measured, an interval of 3 once there is something to compute it from (the CPU's timings vary)
    monkeypatch.setattr(OverheadBudget, "_update", lambda self: setattr(self, "interval", 3))
    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    first = CheckpointManager(shm_dir=str(tmp_path))
    first._on_gpu = True                    # budgeted as a GPU state is
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            model.weight.add_(0.01)
        first.save(step, state)
        first.wait()
    assert first.last_saved == 4 and first.snapshot_interval == 3
    first._files.clear()                    # the process is gone; its slots stay (as after a SIGKILL)

    again = CheckpointManager(shm_dir=str(tmp_path))
    assert again._budget.interval == 1                  # nothing measured yet
    assert again.restore(state) == 4 and again.restored_from == "shm"
    assert again._budget.interval == 3                  # the predecessor's measurements were taken
    again._on_gpu = True
    sealed = []
    for step in (5, 6, 7, 8):
        again.save(step, state)
        again.wait()
        sealed.append(again.last_saved)
    assert sealed == [4, 4, 7, 7], sealed
    again.close()


def test_the_interval_counts_from_the_seal_so_steps_without_a_snapshot_in_flight_follow_each(
        tmp_path, monkeypatch) -> None:
    """A snapshot in flight for longer than the interval must not make the next one due the moment it is sealed
    (then every step would run beside a copy, and the step without one - what every cost is measured against -
    would never be measured again): after the seal come `interval` calls that only certify."""
    import threading

    from hyperpodrun import CheckpointManager
    from hyperpodrun.runtime import checkpoint
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(OverheadBudget, "_update", lambda self: setattr(self, "interval", 2))
    gate = threading.Event()
    real = checkpoint.copying.finish_copies

    def slow(*a, **kw):                      # the first snapshot's copy lasts until the gate opens
        assert gate.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(checkpoint.copying, "finish_copies", slow)
    model = torch.nn.Linear(4, 4)
    cm = CheckpointManager(shm_dir=str(tmp_path))
    cm._on_gpu = True
    cm._budget.interval = 2
    cm.save(1, {"model": model})            # not due yet (interval 2)
    cm.save(2, {"model": model})            # snapshotted, in flight until the gate opens
    for step in (3, 4, 5):
        cm.save(step, {"model": model})     # coalesced: certified only
    assert cm.last_saved is None
    gate.set()
    cm.wait()
    assert cm.last_saved == 2
    cm.save(6, {"model": model})            # one call after the seal: not due yet
    cm.wait()
    assert cm.last_saved == 2
    cm.save(7, {"model": model})
    cm.wait()
    assert cm.last_saved == 7
    cm.close()
