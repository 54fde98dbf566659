"""The node's life outside the in-process round: the completion barrier, the loss of the coordination store
before and after local success, and shutdown by a signal in each phase."""
from __future__ import annotations

import signal

import pytest

from fakes import Harness, config, job

from hyperpodrun.agent.state import Phase, StopPlan
from hyperpodrun.errors import EXIT_AGENT_ERROR


# ------------------------------------------------------------------ completion
def test_one_node_succeeds_when_every_worker_exits_0():
    h = Harness(config()).start()
    h.exit(0, 0)
    assert h.phase is Phase.RUNNING
    h.exit(1, 0)
    assert h.phase is Phase.DONE and h.state.exit_code == 0 and h.succeeded == 1
    assert h.sink.names()[-2:] == ["workers_done", "job_done"]


def test_every_node_waits_for_the_others_before_reporting_success():
    n0, n1 = job(2)
    n0.start(), n1.start()
    n1.exit(0, 0), n1.exit(1, 0)
    assert n1.phase is Phase.FINISHING
    n1.tick(60)
    assert n1.phase is Phase.FINISHING and n1.succeeded == 0      # node 0 is still training
    n0.exit(0, 0), n0.exit(1, 0)
    n0.tick()
    assert n0.phase is Phase.FINISHING and n0.state.job_known_complete   # the host serves on until node 1 read it
    n1.tick()
    assert n1.phase is Phase.DONE and n1.state.exit_code == 0
    n0.tick()
    assert n0.phase is Phase.DONE and n0.state.exit_code == 0 and n0.succeeded == n1.succeeded == 1


def test_the_store_host_waits_at_most_linger_for_the_others_to_leave():
    n0, n1 = job(2)
    n0.start(), n1.start()
    for n in (n0, n1):
        n.exit(0, 0), n.exit(1, 0)
    n0.tick()
    n0.tick(5)
    assert n0.phase is Phase.FINISHING
    n0.tick(6)                                    # node 1 never read the result: the host goes after 10 s
    assert n0.phase is Phase.DONE and n0.state.exit_code == 0


def test_exit_barrier_timeout():
    n0, n1 = job(2, join_timeout=30.0)
    n0.start(), n1.start()
    n1.exit(0, 0), n1.exit(1, 0)
    n1.tick(299)
    assert n1.phase is Phase.FINISHING
    n1.tick(2)
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_AGENT_ERROR and n1.sink.named("exit_barrier_timeout")


# ------------------------------------------------------------------ store loss
def test_store_lost_while_running_stops_the_node():
    n0, n1 = job(2)
    n0.start(), n1.start()
    n1.node.on_posted(("store_lost", "Connection reset by peer"))
    assert n1.phase is Phase.STOPPING and n1.state.exiting
    n1.settle()
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_AGENT_ERROR


@pytest.mark.parametrize("how", ["watcher", "barrier"])
def test_store_lost_after_local_success_but_before_every_node_finished_is_no_success(how):
    """Node 1's workers all exited 0, node 0's had not finished when the store (node 0) went away: the job's
    outcome is unknown, so node 1 must not exit 0 (it used to: the loss was ignored while finishing)."""
    n0, n1 = job(2)
    n0.start(), n1.start()
    n1.exit(0, 0), n1.exit(1, 0)
    assert n1.phase is Phase.FINISHING
    n1.flaky.lost = True                              # node 0 is gone
    if how == "watcher":
        n1.node.on_posted(("store_lost", "Connection reset by peer"))
    n1.tick()
    assert n1.phase is Phase.DONE and n1.state.exit_code == EXIT_AGENT_ERROR, n1.sink.names()
    assert "outcome is unknown" in n1.sink.named("store_lost")[0]["msg"] and not n1.sink.named("job_done")


def test_store_lost_once_every_node_finished_is_success():
    n0, n1 = job(2)
    n0.start(), n1.start()
    for n in (n0, n1):
        n.exit(0, 0), n.exit(1, 0)
    n1.node.state.all_nodes_done(n1.clock.monotonic(), 10.0)    # node 1 has read that every node is done ...
    n1.flaky.lost = True                                         # ... then the host went away
    n1.node.on_posted(("store_lost", "Connection reset by peer"))
    assert n1.phase is Phase.FINISHING
    n1.tick()
    assert n1.phase is Phase.DONE and n1.state.exit_code == 0 and n1.sink.named("job_done")
    n0.tick()
    assert n0.phase is Phase.FINISHING       # the host waits for node 1 to say it left, or LINGER_S


# ------------------------------------------------------------------ signals in each phase
def _to_phase(phase: Phase) -> Harness:
    """A one-node job with in-process restarts in `phase` (for AWAITING_STORE: node 1 of two, started before
    node 0 published generation 0's store)."""
    if phase is Phase.AWAITING_STORE:
        _, h = job(2, inprocess_restart=True, max_restarts=1)
        return h.start()
    h = Harness(config(inprocess_restart=True, max_restarts=1))
    if phase is not Phase.STARTING:
        h.start()
        h.hello_all()
    if phase is Phase.RESTARTING:
        h.fault(1, generation=0)
    if phase is Phase.STOPPING:
        h.obey = False
        h.node.begin_stop(StopPlan.restart(1), signal.SIGTERM)
    return h


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING,
                                   Phase.AWAITING_STORE])
def test_a_signal_stops_the_node_with_128_plus_its_number(phase):
    h = _to_phase(phase)
    assert h.phase is phase
    live = [lr for lr, p in h.procs.workers.items() if p.alive]
    h.obey = True
    h.node.on_signal(signal.SIGINT)
    assert h.state.stopped_by_signal == signal.SIGINT
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == 128 + signal.SIGINT
    assert sorted(lr for lr, sig in h.procs.signals if sig == signal.SIGINT) == live   # forwarded to every worker
    assert h.coord.generation() == (1 if phase is Phase.RESTARTING else 0)


def test_a_signal_while_finishing_ends_the_node_at_once():
    n0, n1 = job(2)
    n0.start(), n1.start()
    n1.exit(0, 0), n1.exit(1, 0)
    n1.node.on_signal(signal.SIGTERM)
    assert n1.phase is Phase.DONE and n1.state.exit_code == 128 + signal.SIGTERM


def test_a_second_signal_is_forwarded_and_keeps_the_first_deadline():
    h = Harness(config(shutdown_timeout=5.0)).start()
    h.obey = False
    h.node.on_signal(signal.SIGTERM)
    deadline = h.state.stop_deadline
    h.tick(3)
    h.node.on_signal(signal.SIGINT)
    assert h.state.stop_deadline == deadline and h.state.exit_code is None
    assert [sig for _, sig in h.procs.signals] == [signal.SIGTERM] * 2 + [signal.SIGINT] * 2
    h.tick(2)                                               # the deadline: SIGKILL for what is left
    assert h.sink.named("shutdown_timeout") and [sig for _, sig in h.procs.signals][-2:] == [signal.SIGKILL] * 2
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == 128 + signal.SIGTERM


def test_a_signal_once_done_changes_nothing():
    h = Harness(config()).start()
    h.exit(0, 0), h.exit(1, 0)
    h.node.on_signal(signal.SIGTERM)
    assert h.phase is Phase.DONE and h.state.exit_code == 0 and not h.sink.named("signal")


# ------------------------------------------------------------------ process-level restarts
def test_a_worker_failure_restarts_every_worker_while_the_budget_lasts():
    h = Harness(config(max_restarts=1)).start()
    h.exit(1, 3)
    assert h.phase is Phase.STOPPING and h.procs.signals == [(0, signal.SIGTERM)]
    h.settle()
    assert h.phase is Phase.RUNNING and h.state.generation == 1 and h.sink.named("restart_done")
    h.exit(0, 5)
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == 5 and "exit code 5" in h.sink.named("job_failed")[0]["msg"]
