"""The overhead budget (hyperpodrun/state/snapshot_budget.py): the snapshot interval follows from measured costs,
and a CheckpointManager under it snapshots every k-th save(), certifies the others, and restores the step of its
last save() call from its live objects whether or not that call was snapshotted."""
from __future__ import annotations

import torch

from hyperpodrun.state import snapshot_budget
from hyperpodrun.state.snapshot_budget import MAX_INTERVAL, OverheadBudget


class Clock:
    """time.perf_counter for the budget, moved by hand: a step takes exactly what the test says."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _drive(b: OverheadBudget, clock: Clock, steps: list, in_flight: int = 0) -> None:
    """Save() calls separated by `steps` seconds each; an entry (s, "snap") takes a snapshot at that call, and the
    calls after it are busy until an entry (s, "sealed") - the step in which it was sealed."""
    busy = False
    for entry in steps:
        took, what = entry if isinstance(entry, tuple) else (entry, "")
        clock.t += took
        b.call_started()
        if what == "snap":
            b.snapshot_began()
            busy = True
        elif what == "sealed":
            b.in_flight(in_flight)
            busy = False
        b.call_ended(busy)


def _budget(monkeypatch, clean: float, busy: list[float], in_flight: int, share: float = 0.02,
            certify_s: float = 0.0) -> OverheadBudget:
    """A budget that measured 8 clean steps of `clean` s, then one snapshot whose in-flight steps took `busy`."""
    clock = Clock()
    monkeypatch.setattr(snapshot_budget.time, "perf_counter", clock)
    b = OverheadBudget(share)
    b.certified(0.0001)
    if certify_s:
        b.certify_measured(certify_s)
    _drive(b, clock, [clean] * 8 + [(clean, "snap")] + busy[:-1] + [(busy[-1], "sealed"), clean, clean],
           in_flight=in_flight)
    return b


def test_the_interval_spreads_a_snapshots_measured_cost_within_the_budget(monkeypatch) -> None:
    """Three steps beside a snapshot take 15 ms more than three without one. The budget is aimed at four fifths of
    2 % of a 0.1 s step: 1.6 ms of room a step, so the cost is spread over 10 steps, 3 of which it was in
    flight: 7 more after it."""
    assert snapshot_budget.AIM == 0.8
    b = _budget(monkeypatch, 0.100, [0.110, 0.105, 0.100], in_flight=3)
    assert abs(b.step_s - 0.100) < 1e-9 and abs(b.snapshot_s - 0.015) < 1e-9
    assert b.interval == 10 - 3
    # certifying every call takes 1 ms of the device: 0.6 ms of room left, 25 steps a cycle
    assert _budget(monkeypatch, 0.100, [0.110, 0.105, 0.100], in_flight=3, certify_s=0.001).interval == 25 - 3
    # certifying alone spends the budget: as seldom as allowed
    assert _budget(monkeypatch, 0.100, [0.110, 0.105, 0.100], in_flight=3, certify_s=0.003).interval == MAX_INTERVAL
    # a snapshot that costs nothing measurable: still a step without one after each (the baseline stays measured)
    assert _budget(monkeypatch, 0.100, [0.100, 0.100], in_flight=2).interval == 2


def test_a_pause_between_steps_does_not_move_the_step_it_measures_against(monkeypatch) -> None:
    """An evaluation, a data stall or another job's burst makes one step 4 s long: the step without a snapshot is
    the median of the last ones, so the budget is not fooled into snapshotting every step (a running mean went
    to 4 s once, and the interval to 2 with it)."""
    clock = Clock()
    monkeypatch.setattr(snapshot_budget.time, "perf_counter", clock)
    b = OverheadBudget(0.02)
    _drive(b, clock, [0.1] * 6 + [4.0] + [0.1] * 6)
    assert abs(b.step_s - 0.1) < 1e-9


def test_the_cost_is_the_median_of_recent_snapshots_and_a_slot_mapping_is_not_one(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(snapshot_budget.time, "perf_counter", clock)
    b = OverheadBudget(0.02)
    _drive(b, clock, [0.1] * 8)
    for extra in (0.010, 0.012, 3.0, 0.011):    # the third: a 3 s stall while it was in flight
        clock.t += 0.1
        b.call_started()
        b.snapshot_began()
        b.call_ended(True)
        _drive(b, clock, [(0.1 + extra, "sealed"), 0.1, 0.1])
    assert abs(b.snapshot_s - 0.0115) < 1e-6
    clock.t += 0.1
    b.call_started()
    b.snapshot_began(counted=False)             # it mapped a slot: 0.6 s, once per slot and process
    b.call_ended(True)
    _drive(b, clock, [(0.7, "sealed"), 0.1, 0.1])
    assert abs(b.snapshot_s - 0.0115) < 1e-6


def test_a_restart_drops_the_snapshot_being_costed(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(snapshot_budget.time, "perf_counter", clock)
    b = OverheadBudget(0.02)
    _drive(b, clock, [0.1] * 4 + [(0.1, "snap"), 0.3])
    b.restarted()                              # the wrapped function runs again: those steps were cut short
    clock.t += 7.0
    _drive(b, clock, [0.1, 0.1, 0.1])
    assert b.snapshot_s is None and abs(b.step_s - 0.1) < 1e-9


def test_the_bound_on_retrained_steps_counts_snapshots_in_flight() -> None:
    b = OverheadBudget(0.02)
    b.interval = 3
    b.in_flight(2)
    b.in_flight(1)
    assert b.retrain_bound == 3 + 2 * 2     # the restored one and the next may each be in flight 2 steps


def test_mapping_a_slot_is_not_counted_as_a_snapshots_cost(tmp_path, monkeypatch) -> None:
    """The first snapshot into each slot maps (on a GPU host: registers) the file - a one-time cost that must not
    set the interval (it made it jump to its cap on an H200): what the budget is told leaves it out."""
    from hyperpodrun import CheckpointManager
    from hyperpodrun.state.slots import snapshot_io
    monkeypatch.setenv("RANK", "0")
    told: list[bool] = []
    monkeypatch.setattr(OverheadBudget, "snapshot_began", lambda self, counted=True: told.append(counted))
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
    # calls 1 and 3 snapshot (one step without a snapshot after each); the first mapped both slots (its own and
    # the next one's), so the second into the other slot maps nothing
    assert told == [False, True], told
    cm.close()


def test_no_budget_means_every_call(monkeypatch) -> None:
    b = _budget(monkeypatch, 0.1, [5.0], in_flight=1, share=None)
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
    cm._budget.interval = 3
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


def test_a_seeded_budget_takes_only_sane_values_and_never_overrides_its_own(monkeypatch) -> None:
    b = OverheadBudget(0.02)
    assert not b.seed({"snapshot_s": float("nan"), "step_s": -1.0, "certify_s": True})
    assert b.seed({"step_s": 0.1, "snapshot_s": 0.006, "mean_in_flight": 1.0})
    assert b.interval == 3                       # 4 steps a cycle (6 ms over 1.6 ms of room), 1 of them in flight
    assert b.export() == {"step_s": 0.1, "snapshot_s": 0.006, "mean_in_flight": 1.0}
    measured = _budget(monkeypatch, 0.100, [0.110, 0.105, 0.100], in_flight=3)
    assert not measured.seed({"step_s": 0.1, "snapshot_s": 0.5})   # measured already: kept
    assert abs(measured.snapshot_s - 0.015) < 1e-9


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
    first._budget.interval = 3
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            model.weight.add_(0.01)
        first.save(step, state)
        first.wait()
    assert first.last_saved == 4 and first.snapshot_interval == 3
    first._files.clear()                    # the process is gone; its slots stay (as after a SIGKILL)

    again = CheckpointManager(shm_dir=str(tmp_path))
    assert again._budget.interval == 2                  # nothing measured yet: one step without a snapshot after each
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
    from hyperpodrun.state.slots import snapshot_copy as copying
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(OverheadBudget, "_update", lambda self: setattr(self, "interval", 2))
    gate = threading.Event()
    real = copying.finish_copies

    def slow(*a, **kw):                      # the first snapshot's copy lasts until the gate opens
        assert gate.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(copying, "finish_copies", slow)
    model = torch.nn.Linear(4, 4)
    cm = CheckpointManager(shm_dir=str(tmp_path))
    cm._on_gpu = True
    cm._budget.interval = 2
    cm.save(1, {"model": model})            # the first call is due: snapshotted, in flight until the gate opens
    for step in (2, 3, 4):
        cm.save(step, {"model": model})     # coalesced: certified only
    assert cm.last_saved is None
    gate.set()
    cm.wait()
    assert cm.last_saved == 1
    cm.save(5, {"model": model})            # one call after the seal: not due yet
    cm.wait()
    assert cm.last_saved == 1
    cm.save(6, {"model": model})
    cm.wait()
    assert cm.last_saved == 6
    cm.close()


def test_a_budget_that_certifying_alone_spends_snapshots_seldom_from_the_first_steps(monkeypatch) -> None:
    """Certifying costs 3 ms of a 0.1 s step, more than 2 %: no snapshot need be costed to know the interval is
    its cap (otherwise the first snapshots, one step apart, were paid until one had been measured)."""
    clock = Clock()
    monkeypatch.setattr(snapshot_budget.time, "perf_counter", clock)
    b = OverheadBudget(0.02)
    b.certify_measured(0.003)
    _drive(b, clock, [0.1, 0.1])
    assert b.snapshot_s is None and b.interval == MAX_INTERVAL
