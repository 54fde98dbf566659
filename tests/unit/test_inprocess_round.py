"""The in-process round, transition by transition, on fake ports and a fake clock: fault -> RESTART -> READY
from every rank -> GO; a rank dying during the round; folded secondary faults; a generation moved by another
node (also one beyond the round under way: the round restarts towards it); escalation on --inprocess-timeout
(with and without budget); completion; ranks that cannot be reached on the control socket; a fault that is not
retried and the same step failing --max-step-failures times (the round ends the job)."""
from __future__ import annotations

import signal

from fakes import Harness, config, job

from hyperpodrun import protocol as P
from hyperpodrun.agent.state import Phase
from hyperpodrun.errors import EXIT_RESTARTS_EXHAUSTED, EXIT_STEP_KEEPS_FAILING


def running(**overrides: object) -> Harness:
    h = Harness(config(**{"inprocess_restart": True, "max_restarts": 1, **overrides})).start()
    h.hello_all()
    return h


def go_messages(h: Harness) -> list[P.Go]:
    return [m for _, m in h.control.of(P.Go)]


def test_fault_restart_ready_go():
    h = running()
    assert h.phase is Phase.RUNNING and h.launcher.warm_started == 1   # every rank said HELLO: zygote starts
    h.fault(1, generation=0, summary="bad batch")
    assert h.phase is Phase.RESTARTING and h.inproc is not None and h.inproc.round is not None
    assert [(i, m.generation) for i, m in h.control.of(P.Restart)] == [(h.ident(0), 1), (h.ident(1), 1)]
    assert h.wstores is not None and 1 in h.wstores.opened       # generation 1's store is up before GO
    h.ready(0, 1)
    h.tick()
    assert h.phase is Phase.RESTARTING and not go_messages(h)    # rank 1 is not ready yet
    h.ready(1, 1)
    h.tick()
    assert h.phase is Phase.RUNNING and h.state.generation == 1 and h.inproc.round is None
    assert [(m.generation, m.master_port) for m in go_messages(h)] == [(1, 30001), (1, 30001)]
    go = h.sink.named("go")[0]
    assert "rank 1: RuntimeError: bad batch" in go["root_cause"] and h.coord.generation() == 1
    assert h.sink.names().count("fault") == 1 and h.coord.restarts_used() == 0   # no budget spent
    assert not h.procs.signals                                     # nobody was killed


def test_a_rank_dying_during_the_round_is_respawned_into_it():
    h = running()
    h.fault(1, generation=0)
    old = h.proc(0).pid
    old_ident = h.ident(0)
    h.exit(0, -signal.SIGKILL)                       # rank 0 dies while the others abort
    new = h.proc(0)
    assert new.pid != old and new.generation == 1 and new.source == "warm"
    assert h.launcher.spawned[-1] == (0, 1, 30001, True)
    assert h.sink.named("fault_folded") and h.sink.named("respawn")[0]["warm"] is True
    h.hello(0)                                       # the new process starts in generation 1: no RESTART for it
    assert [i for i, _ in h.control.of(P.Restart)] == [old_ident, h.ident(1)]
    h.ready_all(1)
    h.tick()
    assert h.phase is Phase.RUNNING and [i for i, _ in h.control.of(P.Go)] == [h.ident(0), h.ident(1)]


def test_secondary_faults_are_folded_and_a_real_cause_becomes_the_root():
    h = running()
    h.fault(0, generation=0, secondary=True, exc="DistNetworkError", summary="Connection closed by peer")
    h.fault(1, generation=0, summary="CUDA error: an illegal memory access")
    assert h.inproc is not None and h.inproc.round is not None and h.inproc.round.folded == 1
    assert h.coord.generation() == 1 and len(h.control.of(P.Restart)) == 2    # one round, one RESTART each
    h.ready_all(1)
    h.tick()
    go = h.sink.named("go")[0]
    assert "illegal memory access" in go["root_cause"] and "1 secondary fault(s) folded" in go["msg"]


def test_a_late_fault_of_an_older_generation_starts_nothing():
    h = running()
    h.fault(1, generation=0)
    h.ready_all(1)
    h.tick()
    h.fault(0, generation=0)                         # reported before it saw GO(1)
    assert h.phase is Phase.RUNNING and h.coord.generation() == 1


def test_another_nodes_generation_starts_a_round_here():
    n0, n1 = job(2, inprocess_restart=True, max_restarts=1)
    n0.start(), n1.start()
    n0.hello_all(), n1.hello_all()
    n1.fault(1, generation=0, summary="the real cause")      # global rank 3, on node 1
    assert n1.phase is Phase.RESTARTING and n1.coord.generation() == 1
    n0.sync()                                                 # the watcher sees generation 1
    assert n0.phase is Phase.RESTARTING and n0.inproc is not None and n0.inproc.round is not None
    assert n0.inproc.round.root.remote and len(n0.control.of(P.Restart)) == 2
    n0.ready_all(1), n1.ready_all(1)
    n0.tick()
    assert n0.phase is Phase.RESTARTING       # node 1 has not said its ranks are ready: GO waits
    n1.tick()
    n0.tick()
    assert n0.phase is n1.phase is Phase.RUNNING
    assert go_messages(n0)[0].master_port == go_messages(n1)[0].master_port == 30001
    # node 0 saw only "another node started generation 1": it reports node 1's cause at GO
    assert "the real cause (node 1)" in n0.sink.named("go")[0]["root_cause"]


def test_a_rank_that_dies_after_its_node_was_counted_ready_holds_go_back():
    n0, n1 = job(2, inprocess_restart=True)
    n0.start(), n1.start()
    n0.hello_all(), n1.hello_all()
    n1.fault(0, generation=0)
    n0.sync()
    n0.ready_all(1), n1.ready_all(1)
    n0.tick()                                 # node 0 marks itself ready (node 1 not yet)
    n0.exit(1, -signal.SIGKILL)               # ... then loses a rank: the mark is taken back
    n1.tick()
    assert n1.phase is Phase.RESTARTING and n0.coord.ready_count(1) == 1
    n0.hello(1), n0.ready(1, 1)
    n0.tick(), n1.tick()
    assert n0.phase is n1.phase is Phase.RUNNING


def _recovering_until(h: Harness, seconds: float) -> None:
    """The ranks keep sending heartbeats while they recover, but never get READY."""
    for _ in range(int(seconds // 5)):
        h.clock.advance(5)
        for lr in h.procs.workers:
            h.beat(lr, 0, step=7, seq=3, state="recovering")
        h.tick()


def test_a_round_past_inprocess_timeout_escalates_to_a_process_level_restart():
    h = running(inprocess_timeout=60.0)
    h.fault(1, generation=0)
    _recovering_until(h, 55)
    assert h.phase is Phase.RESTARTING
    _recovering_until(h, 5)
    timeout = h.sink.named("inprocess_timeout")[0]
    assert "rank 0" in timeout["msg"] and "rank 1" in timeout["msg"] and h.phase is Phase.STOPPING
    assert sorted(h.procs.signals) == [(0, signal.SIGTERM), (1, signal.SIGTERM)]
    assert h.coord.restarts_used() == 1
    h.settle()                                # both exit on SIGTERM; generation 2 starts at once (store host)
    assert h.phase is Phase.RESTARTING and h.state.generation == 2 and h.sink.named("restart_done")
    assert [g for _, g, _, _ in h.launcher.spawned[-2:]] == [2, 2]
    h.hello_all()
    h.ready_all(2)
    h.tick()
    assert h.phase is Phase.RUNNING and go_messages(h)[-1].generation == 2


def test_escalation_with_the_budget_spent_ends_the_job():
    h = running(inprocess_timeout=60.0, max_restarts=0)
    h.fault(1, generation=0)
    _recovering_until(h, 60)
    assert h.state.exiting and h.coord.failure() is not None
    assert h.coord.failure().exit_code == EXIT_RESTARTS_EXHAUSTED
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == EXIT_RESTARTS_EXHAUSTED and h.sink.named("job_failed")
    assert h.state.first_failure is not None
    assert "the restart budget (--max-restarts 0) is spent" in h.state.first_failure.summary


def test_a_silent_rank_is_killed_and_replaced():
    h = running()
    h.clock.advance(11)
    h.beat(0, 0, step=3, seq=9)
    h.tick()                                            # rank 1: no heartbeat for 11 s
    assert (1, signal.SIGKILL) in h.procs.signals and h.phase is Phase.RESTARTING
    assert "sent no heartbeat" in h.sink.named("fault")[0]["msg"]
    h.settle()
    assert h.proc(1).generation == 1 and h.proc(1).alive


def test_completion_releases_every_rank_and_the_node_succeeds():
    h = running()
    h.done(0, 0)
    h.tick()
    assert not h.control.of(P.Shutdown)                 # rank 1 is still training
    h.done(1, 0)
    h.tick()
    assert len(h.control.of(P.Shutdown)) == 2 and h.launcher.warm_ended == 1
    h.exit(0, 0)
    h.exit(1, -signal.SIGABRT)                          # gloo's teardown abort after DONE: not a failure
    assert h.phase is Phase.DONE and h.state.exit_code == 0 and h.succeeded == 1
    assert h.sink.named("teardown_abort")


def test_a_fault_while_stopping_is_not_a_round():
    h = running()
    h.obey = False
    h.node.on_signal(signal.SIGTERM)
    h.fault(1, generation=0)                           # the rank reports the signal's interruption
    assert h.phase is Phase.STOPPING and h.coord.generation() == 0 and h.inproc.round is None


# ------------------------------------------------------------------ ranks that cannot be reached
def test_a_rank_that_cannot_take_restart_is_killed_and_respawned():
    h = running()
    h.control.unreachable.add(h.ident(0))
    h.fault(1, generation=0)
    assert (0, signal.SIGKILL) in h.procs.signals          # at once, not after a grace period
    assert h.sink.named("rank_unreachable")[0]["rank"] == 0
    h.settle()
    assert h.proc(0).generation == 1 and h.proc(0).alive
    h.hello(0)
    h.ready_all(1)
    h.tick()
    assert h.phase is Phase.RUNNING and [i for i, _ in h.control.of(P.Go)] == [h.ident(0), h.ident(1)]


def test_a_rank_that_cannot_take_go_is_replaced_in_a_new_round():
    h = running()
    h.fault(1, generation=0)
    h.ready_all(1)
    h.control.unreachable.add(h.ident(1))
    h.tick()
    assert h.sink.named("go") and h.sink.named("rank_unreachable")[0]["kind"] == "GO"
    assert h.phase is Phase.RESTARTING and h.inproc.round is not None and h.inproc.round.target == 2
    assert (1, signal.SIGKILL) in h.procs.signals
    h.settle()
    assert h.proc(1).generation == 2


def test_a_done_rank_that_cannot_take_shutdown_is_killed_without_failing_the_job():
    h = running()
    h.done(0, 0), h.done(1, 0)
    h.control.unreachable.add(h.ident(1))
    h.tick()
    assert (1, signal.SIGKILL) in h.procs.signals
    h.exit(0, 0)
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == 0 and not h.sink.named("fault")


def _stuck_after_restart(h: Harness, grace: float) -> None:
    """Rank 1 raised; rank 0 keeps heart-beating in generation 0 but never leaves its collective."""
    h.fault(1, generation=0)
    h.ready(1, 1)
    for _ in range(int(grace) - 1):
        h.clock.advance(1)
        h.beat(0, 0, step=3, seq=9)
        h.beat(1, 1, step=3, seq=9, state="waiting")
        h.tick()
    assert not h.procs.signals, "killed before the grace was over"
    h.clock.advance(1.5)
    h.beat(0, 0, step=3, seq=9)
    h.beat(1, 1, step=3, seq=9, state="waiting")
    h.tick()
    assert (0, signal.SIGKILL) in h.procs.signals
    assert f"did not respond to RESTART within {grace:g}s" in h.sink.named("kill")[0]["msg"]


def test_a_rank_that_does_not_leave_the_failed_step_is_killed_after_the_grace():
    """Default grace: min(--heartbeat-timeout, --inprocess-timeout / 4) = 10 s here."""
    _stuck_after_restart(running(), 10)


def test_the_restart_grace_setting_overrides_the_default(monkeypatch):
    """HYPERPODRUN_RESTART_GRACE_S: a longer wait (above a gloo group's timeout, say) before the kill."""
    monkeypatch.setenv("HYPERPODRUN_RESTART_GRACE_S", "25")
    _stuck_after_restart(running(), 25)


# ------------------------------------------------------------------ a round replaced, fatal faults, the step guard
def test_a_generation_beyond_the_round_under_way_restarts_the_round_towards_it():
    """RESTARTING -> RESTARTING: node 0 is in its round towards generation 1 when node 1, whose GO to a rank
    failed, has claimed generation 2; node 0's watcher sees 2 before its loop sent GO(1)."""
    n0, n1 = job(2, inprocess_restart=True, max_restarts=1)
    n0.start(), n1.start()
    n0.hello_all(), n1.hello_all()
    n1.fault(1, generation=0)
    n0.sync()
    assert n0.phase is Phase.RESTARTING and n0.inproc is not None and n0.inproc.round is not None
    assert n0.inproc.round.target == 1
    n0.ready_all(1), n1.ready_all(1)
    n0.tick()                                        # node 0 counts itself ready; node 1 not yet
    n1.control.unreachable.add(n1.ident(1))
    n1.tick()                                        # node 1: GO(1) cannot reach rank 3 -> a round towards 2
    assert n1.phase is Phase.RESTARTING and n1.coord.generation() == 2
    n0.sync()                                        # before node 0's next tick
    assert n0.phase is Phase.RESTARTING and n0.inproc.round is not None and n0.inproc.round.target == 2
    assert [m.generation for _, m in n0.control.of(P.Restart)][-2:] == [2, 2]
    assert not go_messages(n0)                       # GO(1) never went out here
    n1.settle()                                      # rank 3 is killed and respawned into generation 2
    n1.hello(1)
    n0.ready_all(2), n1.ready_all(2)
    n0.tick(), n1.tick(), n0.tick()
    assert n0.phase is n1.phase is Phase.RUNNING and n0.state.generation == n1.state.generation == 2
    assert [m.generation for m in go_messages(n0)] == [2, 2]


def test_a_fault_that_is_not_retried_ends_the_job_during_a_round():
    """RESTARTING -> STOPPING without escalation: a rank raises one of HPWrapper's fatal exceptions."""
    h = running()
    h.fault(1, generation=0)
    assert h.phase is Phase.RESTARTING
    h.fault(0, generation=1, retryable=False, exit_code=3, exc="KeyboardInterrupt", summary="stop")
    assert h.phase is Phase.STOPPING and h.state.exiting and h.sink.named("fault_fatal")
    assert h.coord.failure() is not None and h.coord.failure().exit_code == 3 and h.coord.restarts_used() == 0
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == 3 and not go_messages(h)


def test_the_same_step_failing_max_step_failures_times_ends_the_job():
    h = running(max_step_failures=2)
    h.fault(1, generation=0, step=5)
    h.ready_all(1)
    h.tick()
    assert h.phase is Phase.RUNNING and h.state.generation == 1          # the first failure of step 5: GO
    h.fault(1, generation=1, step=5)
    h.ready_all(2)
    h.tick()                                                             # the second in a row: no GO(2)
    assert h.sink.named("step_keeps_failing") and "step 5 failed 2 times in a row" in h.state.first_failure.summary
    assert h.phase is Phase.STOPPING and [m.generation for m in go_messages(h)] == [1, 1]
    h.settle()
    assert h.phase is Phase.DONE and h.state.exit_code == EXIT_STEP_KEEPS_FAILING


def test_a_failure_at_another_step_starts_the_count_again():
    h = running(max_step_failures=2)
    for gen, step in enumerate((5, 6, 5), start=1):
        h.fault(1, generation=gen - 1, step=step)
        h.ready_all(gen)
        h.tick()
        assert h.phase is Phase.RUNNING and h.state.generation == gen
    assert not h.sink.named("step_keeps_failing")


def test_node_losses_with_training_between_them_are_not_one_step_failing() -> None:
    """A node lost again and again while the job trains between the losses is not a step that keeps failing: a
    loss is counted at the step this node's ranks were at (found by scripts/bench/soak.py, where the third loss
    of a node in a row ended the job with 77 - the losses had no step, so they all counted as "the same point").
    A node lost twice at the same step still is."""
    from hyperpodrun.agent.rankstate import StepGuard
    h = running(max_step_failures=2, nnodes=2)
    h.beat(0, 0, 10, 1)
    h.beat(1, 0, 12, 1)
    assert h.inproc is not None and h.inproc.node_lost(1, "inc1", "no lease renewal") == 1
    assert h.inproc.round is not None
    root = h.inproc.round.root
    assert root.cause == "node lost" and root.step == 12
    guard = StepGuard(2)
    assert guard.count(root) is None and guard.count(root.with_(step=40)) is None
    assert "step 40 failed 2 times" in (guard.count(root.with_(step=40)) or "")


def test_lost_steps_reported_are_those_trained_again_even_when_no_process_knows() -> None:
    """A rank SIGKILLed in step 9 (its heartbeat said so) and a replacement that restores step 4: the replacement
    cannot know where its predecessor was and says 0 steps lost - the agent, which saw step 9 in progress when the
    round began, reports the 5 steps the job trains again."""
    h = running()
    h.beat(0, 0, step=9, seq=1)
    h.beat(1, 0, step=9, seq=1)
    h.exit(0, -signal.SIGKILL)
    h.hello(0)
    h.ready_all(1)
    h.tick()
    h.send(0, P.Restored(rank=0, pid=h.proc(0).pid, generation=1, step=4, lost_steps=0, source="memory"))
    restored = h.sink.named("state_restored")
    assert [(e["step"], e["lost_steps"]) for e in restored] == [(4, 5)], restored
    assert "5 step(s) to train again" in restored[0]["msg"]
