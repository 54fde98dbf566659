"""Multi-node forms on loopback: two agents, 2 workers each, one 4-rank job (issue 2)."""
from __future__ import annotations

import os
import signal

import pytest

from conftest import count_files, free_port, read_events, read_markers, script, the_run_dir, wait_until


def _two_nodes(launcher, tmp_path, per_node_args, worker_args, timeout=90):
    """Start two agents at once (node n logs to <tmp>/logs<n>), wait for both; returns both results."""
    procs = [launcher.start([*per_node_args(n), *worker_args], log_dir=tmp_path / f"logs{n}") for n in (0, 1)]
    return [p.wait(timeout) for p in procs]


def _static(port):
    return lambda n: ["--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port",
                      str(port), "--nproc-per-node", "2"]


def _c10d(port, run_id):
    return lambda n: ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      "--rdzv-id", run_id, "--nproc-per-node", "2"]


@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_agents_form_one_gloo_group(launcher, tmp_path, out_dir, form):
    """`--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1` and `--rdzv-backend c10d --rdzv-endpoint
    127.0.0.1:PORT --nnodes 2`: one 4-rank job, ranks assigned node by node, one gloo group."""
    port = free_port()
    node_args = _static(port) if form == "static" else _c10d(port, f"job-{port}")
    results = _two_nodes(launcher, tmp_path, node_args, [script("allreduce.py"), out_dir])
    for res in results:
        assert res.rc == 0, res
        assert "Traceback" not in res.err, res
    found = read_markers(out_dir, "result_*.json")
    assert sorted(r["rank"] for r in found) == [0, 1, 2, 3], found
    for r in found:
        env = r["env"]
        assert r["world"] == 4 and r["sum"] == 1 + 2 + 3 + 4, r
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "2"
        assert int(env["RANK"]) == 2 * int(env["GROUP_RANK"]) + int(env["LOCAL_RANK"]), env
    assert len({r["env"]["MASTER_PORT"] for r in found}) == 1, "every rank dials the same worker store"
    # each node's agent wrote its own event log and its own ranks' files
    nodes = set()
    for n in (0, 1):
        run = the_run_dir(tmp_path / f"logs{n}")
        node_files = sorted(p.name for p in run.glob("node*.events.jsonl"))
        assert len(node_files) == 1, node_files
        nodes.add(node_files[0])
        ranks = sorted(int(p.name[5:]) for p in (run / "attempt_0").glob("rank_*"))
        assert ranks in ([0, 1], [2, 3]), ranks
    assert nodes == {"node0.events.jsonl", "node1.events.jsonl"}


def test_failure_on_one_node_restarts_both_nodes(launcher, tmp_path, out_dir):
    """A worker on node 1 fails, --max-restarts 1: the workers of both nodes restart (generation 1) and the
    job finishes on both."""
    port = free_port()
    results = _two_nodes(launcher, tmp_path, lambda n: [*_static(port)(n), "--max-restarts", "1"],
                         [script("behave.py"), "--out", out_dir, "--fail-rank", "3", "--wait-peers", "4"])
    for res in results:
        assert res.rc == 0, res
    done = read_markers(out_dir, "done_*.json")
    assert sorted((d["gen"], d["rank"]) for d in done) == [(1, r) for r in range(4)], done
    restarted = read_markers(out_dir, "ready_1_*.json")
    assert sorted(r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in restarted) == ["1"] * 4
    assert count_files(out_dir, "ready_0_*.json") == 4
    events0, events1 = read_events(tmp_path / "logs0"), read_events(tmp_path / "logs1")
    assert [e["rank"] for e in events1 if e["event"] == "fault"] == [3]
    assert not [e for e in events0 if e["event"] == "fault"]
    assert [e for e in events0 if e["event"] == "restart_remote"], "node 0 should restart for node 1's fault"
    for events in (events0, events1):
        started = [e["generation"] for e in events if e["event"] == "workers_started"]
        assert started == [0, 1], started
    assert not launcher.leftovers()


def test_failure_beyond_budget_fails_both_nodes(launcher, tmp_path, out_dir):
    """The restart budget is job-wide: a rank on node 1 that keeps failing with --max-restarts 1 ends the job
    on both nodes with its exit code, after exactly one restart."""
    port = free_port()
    results = _two_nodes(launcher, tmp_path, lambda n: [*_static(port)(n), "--max-restarts", "1"],
                         [script("behave.py"), "--out", out_dir, "--fail-rank", "2", "--fail-code", "9",
                          "--fail-until", "99", "--wait-peers", "4"])
    assert [r.rc for r in results] == [9, 9], results
    assert count_files(out_dir, "ready_1_*.json") == 4 and count_files(out_dir, "ready_2_*.json") == 0
    for res in results:
        assert "rank 2" in res.err and "exit code 9" in res.err, res
    assert not launcher.leftovers()


def test_sigterm_while_waiting_for_the_other_nodes(launcher, tmp_path):
    """A node stopped while it waits for its peers exits at once with 128+SIGTERM."""
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    proc = launcher.start(["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                           str(free_port()), "--rdzv-conf", "join_timeout=20", ok])
    wait_until(lambda: "waiting for 2 node(s)" in proc.err() or proc.popen.poll() is not None, 30,
               message="node 0 waiting for node 1")
    os.kill(proc.pid, signal.SIGTERM)
    res = proc.wait(4)
    assert res.rc == 143, res
