"""A standalone coordinator (`hyperpodrun coordinator`): its command line, two jobs on one coordinator, and the
loss of the node that would have hosted the store (CPU, gloo, --inprocess-restart with CheckpointManager, 2
nodes x 2 ranks, each node in its own pid and mount namespaces: tests/nodes.py).

With the node-hosted store, node 0 (the rendezvous host) is the one node whose loss ends the job; with a
coordinator it is lost and replaced like any other, and the result is bitwise equal to a fault-free run.
"""
from __future__ import annotations

import datetime
import signal
from pathlib import Path

import pytest

from conftest import HYPERPODRUN, Launcher, assert_same_ckpt_state as assert_same_state, free_port, wait_until
from nodes import unavailable
from hyperpodrun.agent.coordination import store_schema as K
from test_node_loss import KILL_AT, Cluster, assert_survivors_kept_processes

namespaced = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def start_coordinator(launcher: Launcher, port: int):
    proc = launcher.start(["coordinator", "--host", "127.0.0.1", "--port", str(port)], log_dir=False)
    wait_until(lambda: "serving the coordination store" in proc.err() or proc.popen.poll() is not None, 60,
               message="the coordinator serves")
    assert proc.popen.poll() is None, proc.err()
    return proc


def on_coordinator(launcher: Launcher, tmp: Path, name: str, port: int) -> Cluster:
    job = Cluster(launcher, tmp, name, "c10d")
    job.port = port
    return job


def test_coordinator_command_line(launcher, tmp_path):
    """--help exits 0; bad input exits 2 with one line; a taken port exits 1 with one line naming the fix; a
    SIGTERM ends it with 128 + 15, as the launcher does, and nothing is left running."""
    helped = launcher.run(["coordinator", "--help"], log_dir=False)
    assert helped.rc == 0 and "--rdzv-endpoint" in helped.out, helped
    for args, words in ((["--host", "127.0.0.1", "--port", "0"], "--port"),
                        (["--host", "192.0.2.77", "--port", "29500"], "not an address of this machine"),
                        (["--port", "29500"], "--host")):
        bad = launcher.run(["coordinator", *args], log_dir=False)
        lines = bad.err.strip().splitlines()
        assert bad.rc == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in bad.err, bad
    port = free_port()
    first = start_coordinator(launcher, port)
    taken = launcher.run(["coordinator", "--host", "127.0.0.1", "--port", str(port)], log_dir=False)
    assert taken.rc == 1 and "choose another --port" in taken.err and "Traceback" not in taken.err, taken
    first.popen.send_signal(signal.SIGTERM)
    assert first.wait(30).rc == 128 + signal.SIGTERM
    assert not launcher.leftovers()


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two 2-node jobs at once on one coordinator, fault-free: -> (coordinator port, the jobs, a raw store
    client of the coordinator, the launcher). The first job's output is the tests' fault-free reference."""
    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    import torch.distributed as dist
    tmp = tmp_path_factory.mktemp("coordinator-two-jobs")
    launcher = Launcher(tmp)
    try:
        port = free_port()
        coordinator = start_coordinator(launcher, port)
        jobs = [on_coordinator(launcher, tmp, name, port) for name in ("job-a", "job-b")]
        nodes = []
        for job in jobs:
            nodes.append(job.start(0))
            wait_until(lambda: "node 0 waiting" in nodes[-1].proc.err(), 60, message="node 0 joined")
        nodes += [job.start(1) for job in jobs]
        codes = [n.wait(240) for n in nodes]
        assert codes == [0, 0, 0, 0], "\n".join(j.describe() for j in jobs)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        yield port, jobs, store, coordinator
    finally:
        launcher.cleanup()


@namespaced
def test_two_jobs_on_one_coordinator_do_not_see_each_others_keys(two_jobs):
    """Each job counts only its own agents (2 each, not 4: no job's rendezvous saw the other's), hosts none of
    the coordination store, runs its workers' stores on its own agents, and both end bitwise equal."""
    import torch.distributed as dist
    _, jobs, store, coordinator = two_jobs
    for job in jobs:
        mine = dist.PrefixStore(K.run_prefix(job.name), store)   # as the agents of that job see the store
        assert int(mine.add(K.RDZV_COUNTER, 0)) == 2, job.name
        assert mine.check([K.worker_store(0), K.AUTH]), job.name
        for node in job.nodes:
            assert "standalone coordinator: this agent hosts none" in node.proc.err(), node.describe()
        started = [e for n in job.nodes for e in n.events("workers_started")]
        assert started and all("store 127.0.0.1:" in e["msg"] for e in started), started
    assert not store.check([K.RDZV_COUNTER]) and not store.check([K.GENERATION])   # nothing outside a run's prefix
    assert coordinator.popen.poll() is None                          # jobs end; the coordinator serves on
    assert_same_state(jobs[0].out, jobs[1].out)


@namespaced
def test_node_zero_lost_whole_and_replaced(launcher, tmp_path, two_jobs):
    """With a coordinator, node 0 (ranks 0 and 1: the node that would host a node-hosted store) is killed whole
    mid-training and its command started again: both agents exit 0, node 1's ranks keep their processes,
    ranks 0 and 1 run in new processes from the committed step, and the state is bitwise equal to the
    fault-free run."""
    import torch.distributed as dist
    port, jobs, store, _ = two_jobs
    job = on_coordinator(launcher, tmp_path, "lose-node0", port)
    node0 = job.start(0)
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start(1)
    job.wait_step(KILL_AT)
    node0.kill()
    assert node0.wait(30) != 0
    replacement = job.start(0, label="replacement")
    codes = [node1.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert_survivors_kept_processes(job, lost_ranks=(0, 1), generations=(0, 1))
    lost = node1.events("node_lost")
    assert lost and lost[0]["node"] == 0 and "declared lost" in lost[0]["msg"], info
    assert replacement.events("replacing"), info
    claims = dist.PrefixStore(K.run_prefix(job.name), store)   # generation 1's workers' store: on the survivor
    assert b"=node1:" in bytes(claims.get(K.worker_store_host(1))), info
    assert_same_state(jobs[0].out, job.out)


def lose_the_owner(job: Cluster, nodes: tuple, reference: Path) -> None:
    """Kill whole the node whose agent owns the lease watch (agent/coordination/owner.py) mid-training and start
    its command again: the survivor takes the watch over, declares the owner's node lost itself, both agents
    exit 0, the survivor's ranks keep their processes, and the state is bitwise equal to `reference`."""
    def owner() -> object:
        found = [n for n in nodes if n.events("owner")]
        return found[0] if len(found) == 1 else None
    wait_until(owner, 60, message="one agent owns the lease watch")
    job.wait_step(KILL_AT)
    boss = owner()
    assert boss is not None, job.describe()
    lost_node = boss.events("owner")[0]["node"]
    survivor = next(n for n in nodes if n is not boss)
    boss.kill()
    assert boss.wait(30) != 0
    replacement = job.start(lost_node, label="replacement")
    codes = [survivor.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    lost_ranks = (0, 1) if lost_node == 0 else (2, 3)
    assert_survivors_kept_processes(job, lost_ranks=lost_ranks, generations=(0, 1))
    took = survivor.events("owner")
    assert took and took[0]["node"] == 1 - lost_node, info              # the survivor took the watch over
    lost = survivor.events("node_lost")
    assert lost and lost[0]["node"] == lost_node and f"by node {1 - lost_node}" in lost[0]["msg"], info
    assert replacement.events("replacing"), info
    assert_same_state(reference, job.out)


@namespaced
def test_the_owner_node_lost_whole_and_replaced(launcher, tmp_path, two_jobs):
    """With a coordinator, the node whose agent was elected to watch every lease is killed whole: the other
    agent notices the owner's lease stop, takes the duty over, declares the node lost, and the job ends
    bitwise equal to the fault-free run (lose_the_owner)."""
    port, jobs, _, _ = two_jobs
    job = on_coordinator(launcher, tmp_path, "lose-owner", port)
    node0 = job.start(0)
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start(1)
    lose_the_owner(job, (node0, node1), jobs[0].out)
