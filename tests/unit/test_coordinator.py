"""The job-wide restart budget, on one in-memory store shared by two agents: whichever agent asks, and in
whichever order, the verdict for a generation is the same; the agent that lost the race to claim a restart
learns the winner's cause; the node then ends the job with it."""
from __future__ import annotations

import signal

from fakes import KEY, RUN, job, shared_store
import torch.distributed as dist

from hyperpodrun.agent.coordination.job_state import Coordinator
from hyperpodrun.agent.state import Phase
from hyperpodrun.agent.coordination.store_schema import FailureInfo


def two_agents(max_restarts: int) -> tuple[Coordinator, Coordinator]:
    store = dist.PrefixStore(f"hyperpodrun/{RUN}/", shared_store())
    a, b = (Coordinator(store, 2, max_restarts, key=KEY, run_id=RUN, node_rank=n, on_forged=print) for n in (0, 1))
    return a, b


def test_budget_exhausted_on_the_first_agent():
    a, _ = two_agents(max_restarts=1)
    grant = a.request_restart(0, FailureInfo(rank=0, summary="first"))
    assert (grant.generation, grant.started, grant.budget_ok) == (1, True, True) and a.generation() == 1
    grant = a.request_restart(1, FailureInfo(rank=0, summary="second"))
    assert (grant.generation, grant.started, grant.budget_ok) == (2, True, False)
    assert a.generation() == 1 and a.restarts_used() == 2        # the spent restart does not move the job


def test_budget_exhausted_is_told_to_a_later_agent_too():
    """The agent that is second to ask for the restart into a generation gets the same verdict: the budget is
    spent (it used to be told the budget was fine, and began a restart nobody else made)."""
    a, b = two_agents(max_restarts=0)
    first = a.request_restart(0, FailureInfo(rank=3, exit_code=9, summary="rank 3 failed"))
    assert first.started and not first.budget_ok
    later = b.request_restart(0, FailureInfo(rank=0, exit_code=134, summary="rank 0: a symptom"))
    assert (later.generation, later.started, later.budget_ok) == (1, False, False)
    assert later.cause.rank == 3 and later.cause.exit_code == 9            # the winner's cause
    assert a.restarts_used() == b.restarts_used() == 1                     # counted once


def test_budget_is_counted_once_per_generation_whoever_counts_it():
    a, b = two_agents(max_restarts=1)
    assert b.request_restart(0, FailureInfo(rank=1)).budget_ok           # b first this time
    assert a.request_restart(0, FailureInfo(rank=0)).budget_ok           # the generation moved: fold
    assert a.restarts_used() == 1 and a.generation() == 1
    assert not a.request_restart(1, FailureInfo(rank=0)).budget_ok
    assert not b.request_restart(1, FailureInfo(rank=1)).budget_ok
    assert b.restarts_used() == 2


def test_inprocess_rounds_do_not_spend_the_budget():
    a, b = two_agents(max_restarts=0)
    grant = a.request_restart(0, FailureInfo(rank=0), count_budget=False)
    assert grant.started and grant.budget_ok and a.generation() == 1 and a.restarts_used() == 0
    assert b.request_restart(0, FailureInfo(rank=2), count_budget=False).generation == 1


def test_failure_record_first_report_wins():
    a, b = two_agents(max_restarts=0)
    assert a.failure() is None
    assert a.report_failure(FailureInfo(rank=1, exit_code=9)).rank == 1
    assert b.report_failure(FailureInfo(rank=2, exit_code=3)).rank == 1   # the winning one comes back
    assert b.failure() == FailureInfo(rank=1, exit_code=9)


def test_a_later_node_ends_the_job_with_the_first_nodes_cause():
    """Process level, --max-restarts 0, two nodes: rank 3 (node 1) fails with exit code 9; a rank of node 0 then
    fails as a consequence. Both nodes end the job with exit code 9 and rank 3 as the cause; neither starts a
    restart."""
    n0, n1 = job(2, max_restarts=0)
    n0.start(), n1.start()
    n1.exit(1, 9)
    assert n1.state.exiting and n1.state.first_failure.rank == 3
    n0.exit(0, -signal.SIGABRT)
    assert n0.state.exiting and not n0.sink.named("restart_begin")
    assert n0.state.first_failure is not None and n0.state.first_failure.rank == 3
    for n in (n0, n1):
        n.settle()
        assert n.phase is Phase.DONE and n.state.exit_code == 9, n.sink.names()
        assert "rank 3" in n.sink.named("job_failed")[0]["msg"]
    assert n0.coord.generation() == 0


def test_a_failure_on_one_node_restarts_both():
    n0, n1 = job(2, max_restarts=1)
    n0.start(), n1.start()
    n1.exit(0, 3)
    assert n1.sink.named("restart_begin") and n1.state.restarting_to == 1
    n0.sync()                                            # the watcher sees generation 1
    assert n0.sink.named("restart_remote") and n0.state.restarting_to == 1
    n0.settle(), n1.settle()
    assert n0.phase is n1.phase is Phase.RUNNING and n0.state.generation == n1.state.generation == 1
    assert n0.coord.restarts_used() == 1
