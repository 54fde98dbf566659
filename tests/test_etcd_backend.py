"""The etcd backend (`--rdzv-backend etcd`, 3 real etcd members on loopback: tests/etcd_cluster.py) with real
jobs: CPU, gloo, --inprocess-restart with CheckpointManager, 2 nodes x 2 ranks, each node in its own pid and
mount namespaces (tests/nodes.py).

- The etcd leader is SIGKILLed mid-run, then a training node is lost whole and its command started again:
  exit 0, the other node's ranks keep their processes, the state bitwise equal to the fault-free run.
- Every etcd member is SIGKILLed for longer than the agents' deadline (--rdzv-conf coordinator_timeout):
  each agent ends with one line saying so and its exit code, and nothing of the job is left running.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import assert_same_ckpt_state as assert_same_state, wait_until
from etcd_cluster import EtcdCluster, unavailable as etcd_unavailable
from nodes import Node, unavailable
from hyperpodrun.errors import EXIT_AGENT_ERROR
from test_node_loss import FAST, KILL_AT, Cluster, assert_survivors_kept_processes, reference  # noqa: F401

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))]


class EtcdJob(Cluster):
    """A 2-node job whose agents meet in the etcd cluster `etcd` (node ranks in join order)."""

    def __init__(self, launcher, tmp: Path, name: str, etcd: EtcdCluster) -> None:
        super().__init__(launcher, tmp, name, "etcd")
        self.etcd = etcd

    def start(self, node_rank: int, label: Optional[str] = None) -> Node:
        where = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoints]
        node = Node(self.launcher, [*where, *FAST, *self.extra, "--rdzv-id", self.name, self.worker],
                    self.tmp / f"logs-{self.name}-{label or len(self.nodes)}", env=self.env)
        self.nodes.append(node)
        return node

    def start_both(self) -> tuple[Node, Node]:
        node0 = self.start(0)
        wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
        return node0, self.start(1)


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_etcd_leader_lost_then_a_node_lost_and_replaced(launcher, tmp_path, reference, etcd):  # noqa: F811
    """The etcd leader - the member the agents talk to first - is SIGKILLed while the job trains (the two
    members left elect another, the agents go on to them), then node 1 is killed whole and its command started
    again: both agents exit 0, node 0's ranks keep their processes, ranks 2 and 3 run in new processes from
    the committed step, and the state is bitwise equal to the fault-free run. Neither agent hosts the
    coordination store; the workers' stores are on the agents."""
    job = EtcdJob(launcher, tmp_path, "etcd-leader", etcd)
    leader = etcd.members[0]
    etcd.make_leader(leader)     # the first endpoint: the member every agent talks to until it fails
    node0, node1 = job.start_both()
    job.wait_step(5)
    assert etcd.leader() is leader
    leader.kill()
    wait_until(lambda: etcd.leader() not in (None, leader), 30, message="a new etcd leader")
    job.wait_step(KILL_AT)
    node1.kill()
    assert node1.wait(30) != 0
    replacement = job.start(1, label="replacement")
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert_survivors_kept_processes(job)
    for node in (node0, node1, replacement):
        assert "the coordination store is the etcd cluster" in node.proc.err(), info
    lost = node0.events("node_lost")
    assert lost and lost[0]["node"] == 1, info
    assert replacement.events("replacing"), info
    started = [e for n in (node0, replacement) for e in n.events("workers_started")]
    etcd_ports = {str(m.client) for m in etcd.members} | {str(m.peer) for m in etcd.members}
    ports = {e["msg"].rsplit("store 127.0.0.1:", 1)[-1].rstrip(")") for e in started}
    assert started and all("store 127.0.0.1:" in e["msg"] for e in started), started
    assert not ports & etcd_ports, (ports, etcd_ports)   # the workers' stores are on the agents, never etcd
    assert_same_state(reference, job.out)


def test_every_etcd_member_lost_past_the_deadline_ends_the_job(launcher, tmp_path, etcd):
    """All three members are SIGKILLed while the job trains and stay away past --rdzv-conf coordinator_timeout:
    training goes on meanwhile, then each agent ends with exit code 1 and one line that says no etcd member
    answered (the outage itself is one warning before it), and nothing of the job is left running."""
    job = EtcdJob(launcher, tmp_path, "etcd-gone", etcd)
    job.env["STEPS"] = "100000"      # the job would train for hours: only the outage ends it
    deadline = 4.0
    job.extra = ["--rdzv-conf", f"coordinator_timeout={deadline:g}"]
    nodes = job.start_both()
    job.wait_step(5)
    etcd.stop()
    gone = time.monotonic()
    step_then = min(job.step(r) for r in range(4))
    codes = [n.wait(60) for n in nodes]
    took = time.monotonic() - gone
    info = job.describe()
    assert codes == [EXIT_AGENT_ERROR, EXIT_AGENT_ERROR], info
    assert deadline <= took < deadline + 30, f"ended {took:.1f}s after etcd went away\n{info}"
    assert min(job.step(r) for r in range(4)) > step_then, "training stopped with etcd\n" + info
    for node in nodes:
        err = node.proc.err()
        ending = [line for line in err.splitlines() if "answered for" in line]
        assert len(ending) == 1 and "coordinator_timeout" in ending[0], err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert len([line for line in err.splitlines() if "no etcd member" in line and "answers (" in line]) <= 1
    assert not launcher.leftovers(), info


def test_etcd_owner_node_lost_whole_and_replaced(launcher, tmp_path, reference, etcd):  # noqa: F811
    """With etcd, the node whose agent was elected (compare-and-set on a key) to watch every lease is killed
    whole: the other agent takes the duty over and the job ends bitwise equal (test_standalone_coordinator)."""
    from test_standalone_coordinator import lose_the_owner
    job = EtcdJob(launcher, tmp_path, "etcd-owner", etcd)
    lose_the_owner(job, job.start_both(), reference)
