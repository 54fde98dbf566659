"""Which step the ranks restore and from where (hyperpodrun/state/restore/restore_plan.py): a pure function of
what each rank holds, the same on every rank."""
from __future__ import annotations

from typing import Optional

import pytest

from hyperpodrun.errors import StateLostError
from hyperpodrun.state.restore.restore_plan import Inventory, plan_restore


def inv(shm: tuple[int, ...] = (), disk: tuple[int, ...] = (), latest: Optional[int] = None,
        copies: Optional[dict[int, list[int]]] = None, never_committed: bool = False, live: Optional[int] = None,
        at: Optional[int] = None) -> Inventory:
    return {"shm": list(shm), "disk": list(disk), "latest": latest, "copies": copies or {},
            "never_committed": never_committed, "live": live, "at": at}


def singletons(world: int) -> list[list[int]]:
    return [[r] for r in range(world)]


def test_fresh_start_asks_for_no_replica_layout() -> None:
    def no_groups(_world: int) -> list[list[int]]:
        raise AssertionError("groups are asked only when there is something to restore")
    assert plan_restore([inv(), inv()], no_groups) is None


def test_newest_step_every_rank_holds_in_memory() -> None:
    plan = plan_restore([inv((4, 5), latest=5), inv((4, 5), latest=5)], singletons)
    assert plan is not None and (plan.step, plan.pairs, plan.source, plan.lost_steps) == (5, [], "memory", 0)


def test_a_rank_that_lost_its_slots_gets_them_from_a_replica() -> None:
    plan = plan_restore([inv((7, 8), latest=8), inv(latest=None)], lambda world: [[0, 1]])
    assert plan is not None and (plan.step, plan.pairs, plan.source) == (8, [(0, 1, "replica")], "replica")


def test_a_peer_copy_on_another_node_counts_as_memory() -> None:
    everyone = [inv((3,), latest=3), inv(), inv((3,), copies={1: [3]})]
    plan = plan_restore(everyone, singletons)
    assert plan is not None and (plan.step, plan.pairs, plan.source) == (3, [(2, 1, "peer")], "peer")


def test_memory_beats_a_newer_step_that_needs_the_disk() -> None:
    plan = plan_restore([inv((4,), disk=(6,), latest=6), inv((4, 6), latest=6)], singletons)
    assert plan is not None and (plan.step, plan.source, plan.lost_steps) == (4, "memory", 2)


def test_the_disk_fallback_when_memory_is_gone() -> None:
    plan = plan_restore([inv(disk=(10,)), inv((10,), disk=(10,))], singletons)
    assert plan is not None and (plan.step, plan.pairs, plan.source) == (10, [], "disk")


def test_state_that_survives_nowhere_names_the_ranks() -> None:
    with pytest.raises(StateLostError, match=r"rank\(s\) \[1\] at step 9 survives nowhere"):
        plan_restore([inv((9,)), inv()], singletons)


def test_a_fault_during_the_first_snapshot_starts_the_job_again() -> None:
    """Ranks 2 and 3 sealed step 1; ranks 0 and 1, running since the start, dropped theirs (RESTART came during
    the copy): step 1 was never committed by every rank, so the committed state is the start - not exit 75."""
    everyone = [inv(never_committed=True), inv(never_committed=True), inv((1,), latest=1), inv((1,), latest=1)]
    assert plan_restore(everyone, singletons) is None


def test_a_job_started_again_after_it_was_lost_whole_takes_the_durable_checkpoint() -> None:
    """Every rank a fresh process with no memory, the durable tier holding steps 6 and 9: step 9 from disk, not
    a start from the beginning; one rank that finds none (its store unreadable) is a loss named, never a silent
    start from the beginning beside the others' checkpoint."""
    everyone = [inv(disk=(6, 9), never_committed=True) for _ in range(3)]
    plan = plan_restore(everyone, singletons)
    assert plan is not None and (plan.step, plan.source, plan.pairs) == (9, "disk", [])
    with pytest.raises(StateLostError, match=r"rank\(s\) \[2\] at step 9"):
        plan_restore([*everyone[:2], inv(never_committed=True)], singletons)


def test_a_replaced_rank_without_state_is_still_a_loss() -> None:
    """A new process (not running since the start) with nothing: its state at step 9 is lost (exit 75)."""
    with pytest.raises(StateLostError, match=r"rank\(s\) \[1\] at step 9"):
        plan_restore([inv((9,), latest=9), inv(never_committed=False)], singletons)


def test_every_rank_live_at_an_unsnapshotted_step_restores_it_retraining_nothing() -> None:
    """An exception: every rank's objects still hold the values of its last save() call (step 7), whose
    snapshot was skipped for the overhead budget (the newest sealed is 4): step 7, from the ranks' own objects."""
    plan = plan_restore([inv((4,), latest=4, live=7, at=7), inv((4,), latest=4, live=7, at=7)], singletons)
    assert plan is not None and (plan.step, plan.pairs, plan.source, plan.lost_steps) == (7, [], "memory", 0)


def test_a_killed_rank_without_replica_takes_everyone_back_to_the_newest_snapshot() -> None:
    """Rank 1 was SIGKILLed in step 8 (its replacement holds its slots, 4 newest): survivors live at 8 cannot
    lend it step 8 (no replica), so everyone goes back to 4 - 4 steps to train again, said as such."""
    everyone = [inv((2, 4), latest=4, live=8, at=8), inv((2, 4))]
    plan = plan_restore(everyone, singletons)
    assert plan is not None and (plan.step, plan.pairs, plan.lost_steps) == (4, [], 4)


def test_a_killed_rank_gets_the_unsnapshotted_step_from_a_live_replica() -> None:
    """The same with a DDP replica: the survivor's live objects at step 8 are sent to the replacement; nothing
    is trained again."""
    everyone = [inv((2, 4), latest=4, live=8, at=8), inv((2, 4))]
    plan = plan_restore(everyone, lambda world: [[0, 1]])
    assert plan is not None and (plan.step, plan.pairs, plan.source, plan.lost_steps) == \
        (8, [(0, 1, "replica")], "replica", 0)


def test_lost_steps_are_the_steps_trained_again() -> None:
    """The fault came in step 6 (the last progress), step 5 is restored: one step to train again - however
    new the newest slot any rank saved."""
    plan = plan_restore([inv((3, 5), latest=5, at=6), inv((3, 5), latest=5, at=5)], singletons)
    assert plan is not None and (plan.step, plan.lost_steps) == (5, 1)
    plan = plan_restore([inv((3, 5), latest=5, at=5), inv((3, 5), latest=5, at=5)], singletons)
    assert plan is not None and (plan.step, plan.lost_steps) == (5, 0)


def test_a_first_fault_before_any_snapshot_keeps_live_objects_when_every_rank_has_them() -> None:
    """No rank has completed its first snapshot, but every rank's objects hold step 1 (an exception): step 1."""
    everyone = [inv(never_committed=True, live=1, at=1), inv(never_committed=True, live=1, at=1)]
    plan = plan_restore(everyone, singletons)
    assert plan is not None and plan.step == 1
    everyone[1]["live"] = None        # one was SIGKILLed: nothing was committed job-wide - a fresh start
    assert plan_restore(everyone, singletons) is None


def test_inventories_travel_as_json_and_come_back_typed():
    """gather() sends each rank's inventory as JSON bytes over the default group (never pickled): on a real
    one-rank gloo group it comes back equal, the peer-copy rank numbers ints again."""
    import datetime

    import torch.distributed as dist

    from hyperpodrun.state.restore import wire_auth
    from hyperpodrun.state.restore.restore_plan import gather
    mine = {"shm": [4, 6], "disk": [], "latest": 6, "copies": {0: [6]}, "never_committed": False,
            "live": 9, "at": 9}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        got = gather(mine, wire_auth.channel(0, 1, run_id="r", key=b"k" * 32))
        assert got.inventories == [mine] and not got.refused
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("raw, needle", [
    ({"shm": [1], "disk": [], "latest": None, "copies": {}}, "malformed restore inventory"),
    ({"shm": ["1"], "disk": [], "latest": None, "copies": {}, "never_committed": False, "live": None, "at": None},
     "malformed step list"),
    ({"shm": [], "disk": [], "latest": "7", "copies": {}, "never_committed": False, "live": None, "at": None},
     "malformed restore inventory"),
    ({"shm": [], "disk": [], "latest": 1, "copies": {"x": [1]}, "never_committed": False, "live": None,
      "at": None}, "malformed copies"),
    ({"shm": [], "disk": [], "latest": 1, "copies": {}, "never_committed": False, "live": "3", "at": None},
     "malformed restore inventory"),
    ({"shm": [], "disk": [], "latest": 1, "copies": {}, "never_committed": False, "live": None, "at": 2.5},
     "malformed restore inventory"),
    ([1, 2], "malformed restore inventory"),
])
def test_a_malformed_inventory_names_the_rank_that_sent_it(raw, needle):
    from hyperpodrun.state.restore.restore_inventory import parse
    with pytest.raises(ValueError, match=needle) as err:
        parse(raw, 3, 4)
    assert "rank 3" in str(err.value)
