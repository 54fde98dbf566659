"""NodeState: the transition table is enforced (an illegal phase change raises at once), and the named guards
say what the repeated phase checks used to."""
from __future__ import annotations

import pytest

from hyperpodrun.agent.state import ALLOWED, IllegalTransition, NodeState, Phase, StopPlan
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.errors import HyperpodrunError


@pytest.mark.parametrize("src", list(Phase))
def test_every_transition_outside_the_table_raises(src):
    for dst in Phase:
        state = NodeState(phase=src)
        if dst in ALLOWED[src]:
            state._to(dst)
            assert state.phase is dst
        else:
            with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
                state._to(dst)
            assert state.phase is src


def test_done_is_final_and_illegal_transitions_are_hyperpodrun_errors():
    state = NodeState(phase=Phase.RUNNING)
    state.finish(0)
    assert state.exit_code == 0 and state.exiting and not state.active
    for move in (lambda: state.finish(1), state.begin_round, lambda: state.workers_started(1),
                 lambda: state.begin_stop(StopPlan.exit(1), 0.0, 1.0), lambda: state.begin_finish(0.0, 1.0)):
        with pytest.raises(IllegalTransition):
            move()
    assert issubclass(IllegalTransition, HyperpodrunError)


def test_methods_check_where_they_are_called():
    with pytest.raises(IllegalTransition):
        NodeState(phase=Phase.RUNNING).stop_complete()           # nothing was stopping
    with pytest.raises(IllegalTransition):
        NodeState(phase=Phase.STARTING).round_done(1)            # no round without workers
    with pytest.raises(IllegalTransition):
        NodeState(phase=Phase.RUNNING).all_nodes_done(0.0, 10.0)  # only the exit barrier learns that
    with pytest.raises(IllegalTransition):
        NodeState(phase=Phase.STOPPING).begin_round()            # a fault while stopping is no round


def test_a_restart_goes_through_stopping_and_awaiting_store():
    state = NodeState()
    state.workers_started(0)
    state.begin_stop(StopPlan.restart(1), now=10.0, shutdown_timeout=5.0)
    assert state.phase is Phase.STOPPING and state.stop_deadline == 15.0 and state.restarting_to == 1
    assert not state.exiting and not state.active
    assert state.stop_complete() == StopPlan.restart(1)
    assert state.phase is Phase.AWAITING_STORE and state.pending_generation == 1 and state.restarting_to == 1
    state.workers_started(1)
    assert state.phase is Phase.RUNNING and state.generation == 1 and state.pending_generation is None
    assert state.restarting_to is None


def test_a_stop_plan_can_be_replaced_while_stopping():
    """A signal during a restart: the exit replaces the restart; the deadline starts again."""
    state = NodeState(phase=Phase.RUNNING)
    state.begin_stop(StopPlan.restart(1), now=0.0, shutdown_timeout=5.0)
    state.mark_killed_all()
    state.begin_stop(StopPlan.exit(143), now=2.0, shutdown_timeout=5.0)
    assert state.exiting and state.restarting_to is None and state.stop_deadline == 7.0 and not state.killed_all
    assert state.stop_complete() == StopPlan.exit(143) and state.phase is Phase.STOPPING
    state.finish(143)
    assert state.phase is Phase.DONE and state.stop is None and state.stop_deadline is None


def test_guards():
    running = NodeState(phase=Phase.RUNNING)
    assert running.active and not running.exiting and not running.ending
    assert NodeState(phase=Phase.RESTARTING).active
    finishing = NodeState(phase=Phase.RUNNING)
    finishing.begin_finish(now=0.0, timeout=300.0)
    assert finishing.ending and not finishing.exiting and not finishing.job_known_complete
    assert finishing.finish_deadline == 300.0
    finishing.all_nodes_done(now=5.0, linger=10.0)
    assert finishing.job_known_complete and finishing.left_deadline == 15.0


def test_first_failure_wins_and_detect_time_is_taken_once():
    state = NodeState()
    state.record_failure(FailureInfo(rank=1, summary="first"))
    state.record_failure(FailureInfo(rank=2, summary="second"))
    assert state.first_failure is not None and state.first_failure.rank == 1
    state.note_fault(3.0)
    assert state.take_detect_time() == 3.0 and state.take_detect_time() is None
