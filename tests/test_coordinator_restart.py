"""A standalone coordinator killed and started again at the same address mid-run (as Kubernetes restarts a
Deployment behind a Service): the agents reconnect, write back what they hold, and the job goes on (CPU,
gloo, --inprocess-restart with CheckpointManager, 2 nodes x 2 ranks, each node in its own pid and mount
namespaces: tests/nodes.py).

Training does not need the coordinator (the workers' store is hosted by an agent), so the outage restarts
no worker; a fault while it is away waits for it; a coordinator that stays away past --rdzv-conf
coordinator_timeout ends the job with one line and nothing left running.
"""
from __future__ import annotations

import signal

import pytest

from conftest import Launcher, assert_same_ckpt_state as assert_same_state, free_port, wait_until
from nodes import unavailable
from test_node_loss import KILL_AT, Cluster, assert_survivors_kept_processes
from test_standalone_coordinator import on_coordinator, start_coordinator

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

FAULT_AT = KILL_AT + 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run of the same job on a coordinator that stays up."""
    tmp = tmp_path_factory.mktemp("coordinator-restart-ref")
    launcher = Launcher(tmp)
    try:
        port = free_port()
        start_coordinator(launcher, port)
        job = on_coordinator(launcher, tmp, "ref", port)
        nodes = [job.start(0)]
        wait_until(lambda: "node 0 waiting" in nodes[0].proc.err(), 60, message="node 0 joined")
        nodes.append(job.start(1))
        assert [n.wait(180) for n in nodes] == [0, 0], job.describe()
        yield job.out
    finally:
        launcher.cleanup()


def start_job(launcher, tmp_path, name: str, **env: str):
    port = free_port()
    coordinator = start_coordinator(launcher, port)
    job = on_coordinator(launcher, tmp_path, name, port)
    job.env.update(env)
    node0 = job.start(0)
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start(1)
    return port, coordinator, job, [node0, node1]


def rank_log(node, rank: int) -> str:
    """What rank `rank` of `node` wrote to its stderr in generation 0."""
    return "".join(p.read_text() for p in node.log_dir.glob(f"*/attempt_0/rank_{rank}/stderr.log"))


def kill(coordinator) -> None:
    coordinator.popen.send_signal(signal.SIGKILL)
    coordinator.wait(30)


def test_coordinator_killed_and_started_again_mid_run(launcher, tmp_path, reference):
    """SIGKILL the coordinator mid-training: both agents tell the outage, training goes on while it is away,
    the coordinator is started again at the same host:port, and the job ends with exit 0, bitwise equal to
    the fault-free run, no worker restarted (each rank ran generation 0 only, in one process)."""
    port, coordinator, job, nodes = start_job(launcher, tmp_path, "restart")
    job.wait_step(KILL_AT)
    kill(coordinator)
    for node in nodes:
        node.wait_event("coordinator_lost")
    job.wait_step(KILL_AT + 10)                  # training goes on without the coordinator
    start_coordinator(launcher, port)
    codes = [n.wait(180) for n in nodes]
    info = job.describe()
    assert codes == [0, 0], info
    for node in nodes:
        assert node.events("coordinator_back"), info
        assert not node.events("fault") and not node.events("go") and not node.events("node_lost"), info
    for rank in range(4):
        entries = job.entries(rank)
        assert [e[0] for e in entries] == [0] and len({e[2] for e in entries}) == 1, f"rank {rank}: {entries}"
    assert_same_state(reference, job.out)


def test_a_fault_while_the_coordinator_is_away_waits_for_it(launcher, tmp_path, reference):
    """The coordinator is killed; while it is away rank 1 raises at step FAULT_AT: its round waits for the
    coordinator, which is started again; the ranks recover in-process (every rank keeps its process, one new
    generation), both agents exit 0, and the state is bitwise equal to the fault-free run."""
    gate = tmp_path / "gate"
    port, coordinator, job, nodes = start_job(launcher, tmp_path, "fault-away", FAULTS=f"raise:1:{FAULT_AT}:top",
                                              FAULT_GATE=str(gate))
    job.wait_step(FAULT_AT - 1)
    kill(coordinator)
    for node in nodes:
        node.wait_event("coordinator_lost")
    gate.touch()                                  # the fault fires now, with the coordinator away
    wait_until(lambda: "RuntimeError in generation 0" in rank_log(nodes[0], 1), 60, message="rank 1 raised")
    assert not nodes[0].events("go"), job.describe()   # the round cannot go on without the coordinator
    start_coordinator(launcher, port)
    codes = [n.wait(180) for n in nodes]
    info = job.describe()
    assert codes == [0, 0], info
    go = nodes[0].events("go")
    assert [e["generation"] for e in go] == [1], info
    back = nodes[0].events("coordinator_back")
    assert back and back[0]["ts"] <= go[0]["ts"], info
    assert_survivors_kept_processes(job, lost_ranks=(), generations=(0, 1))
    assert_same_state(reference, job.out)


def test_a_coordinator_that_stays_away_ends_the_job(launcher, tmp_path):
    """With --rdzv-conf coordinator_timeout=4, a coordinator killed for good ends the job once a fault needs
    it: every agent exits 1 with one line naming the coordinator and the setting, and nothing is left running."""
    gate = tmp_path / "gate"
    port = free_port()
    coordinator = start_coordinator(launcher, port)
    job: Cluster = on_coordinator(launcher, tmp_path, "away", port)
    job.extra = ["--rdzv-conf", "coordinator_timeout=4"]
    job.env.update(FAULTS=f"raise:1:{FAULT_AT}:top", FAULT_GATE=str(gate))
    node0 = job.start(0)
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    nodes = [node0, job.start(1)]
    job.wait_step(FAULT_AT - 1)
    kill(coordinator)
    gate.touch()
    codes = [n.wait(90) for n in nodes]
    info = job.describe()
    assert codes == [1, 1], info
    for node in nodes:
        lines = [line for line in node.proc.err().splitlines() if "has been unreachable for" in line]
        assert len(lines) == 1 and "coordinator_timeout 4s" in lines[0] and "Traceback" not in node.proc.err(), info
    wait_until(lambda: not launcher.leftovers(), 30, message="nothing left running")
