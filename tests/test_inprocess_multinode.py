"""In-process restart across two agents on loopback (issue 3 acceptance): 2 nodes x 2 ranks, one job."""
from __future__ import annotations

import os
import signal

import pytest

from conftest import free_port
from inprocess_helpers import FAST, Job, assert_only_replaced, entries, events_named, pids


def _two_nodes(launcher, tmp_path, out_dir, train_args=()):
    port = free_port()
    jobs = []
    for node in (0, 1):
        hpr = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               *FAST]
        jobs.append(Job(launcher, out_dir, hpr, list(train_args), nproc=2, log_dir=tmp_path / f"logs{node}"))
    return jobs


def _describe(jobs):
    return "\n".join(f"===== node {n}\n{job.describe()}" for n, job in enumerate(jobs))


@pytest.mark.slow
def test_sigkill_on_node1_keeps_node0_ranks(launcher, tmp_path, out_dir):
    """SIGKILL of rank 3 (node 1): node 1's agent replaces it in-process, node 0's ranks and rank 2 keep their
    PIDs, the whole job moves to generation 1 together and both agents exit 0."""
    jobs = _two_nodes(launcher, tmp_path, out_dir)
    started = jobs[1].wait_step(range(4), step=20)
    os.kill(started[3], signal.SIGKILL)
    results = [job.result() for job in jobs]
    info = _describe(jobs)
    assert [r.rc for r in results] == [0, 0], info
    assert_only_replaced(out_dir, {3}, info=info)
    node0, node1 = jobs[0].log_dir, jobs[1].log_dir
    assert not events_named(node0, "respawn") and not events_named(node0, "kill"), info
    assert [e["rank"] for e in events_named(node1, "respawn")] == [3], info
    for log_dir in (node0, node1):
        go = events_named(log_dir, "go")
        assert [e["generation"] for e in go] == [1], info
        assert not events_named(log_dir, "restart_begin"), info
        # one root cause per restart, on both nodes: the death on node 1, not node 0's "connection reset"
        assert "rank 3" in go[0]["root_cause"] and "SIGKILL" in go[0]["root_cause"], info


def test_simultaneous_faults_on_both_nodes_make_one_generation(launcher, tmp_path, out_dir):
    """Ranks 1 (node 0) and 2 (node 1) raise at the same step: the two agents agree on one new generation
    (not two): every rank re-enters once, with iteration 1, in its own process."""
    jobs = _two_nodes(launcher, tmp_path, out_dir, ["--raise-rank", "1,2", "--raise-step", "8"])
    results = [job.result() for job in jobs]
    info = _describe(jobs)
    assert [r.rc for r in results] == [0, 0], info
    assert_only_replaced(out_dir, set(), info=info)
    for rank in range(4):
        pid = pids(out_dir, rank)[0]
        assert entries(out_dir, rank) == [(pid, 0), (pid, 1)], info
    for job in jobs:
        assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1], info
        assert [e["generation"] for e in events_named(job.log_dir, "restart_signal")] == [1], info
