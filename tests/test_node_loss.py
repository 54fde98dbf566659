"""Node loss (CPU, gloo, --inprocess-restart with CheckpointManager, 2 nodes x 2 ranks): a node dies whole -
agent, workers and its /dev/shm - the other node's ranks keep their processes, the lost node's ranks come
back in new processes on a replacement (the same command started again, or a c10d hot spare) and get their
state from the surviving node's peer copies; the job ends with parameters bitwise equal to a fault-free run.
A replaced agent that comes back is fenced. Each node runs in its own pid and mount namespaces (tests/nodes.py).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Optional

import pytest
import torch

from conftest import SCRIPTS, assert_same_ckpt_state as assert_same_state, free_port, wait_until
from nodes import Node, unavailable
from hyperpodrun.errors import EXIT_FENCED
from inprocess_helpers import STANDBY   # HYPERPODRUN_TEST_STANDBY_WORKERS=N: standbys on

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

WORKER = str(SCRIPTS / "ckpt_worker.py")
STEPS = 60
KILL_AT = 20
FAST = ["--nproc-per-node", "2", "--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
        "--inprocess-timeout", "30", "--node-timeout", "3", "--replace-timeout", "60", *STANDBY]


class Cluster:
    """Nodes of one job; `out` holds what the workers write (rank<r>.pt, entries.rank<r>, progress.rank<r>)."""

    def __init__(self, launcher, tmp: Path, name: str, backend: str = "static", worker: str = WORKER) -> None:
        self.launcher = launcher
        self.tmp = tmp
        self.name = name
        self.backend = backend
        self.worker = worker
        self.port = free_port()
        self.out = tmp / f"out-{name}"
        self.out.mkdir()
        self.nodes: list[Node] = []
        self.extra: list[str] = []    # more agent flags (e.g. --rdzv-conf)
        self.env = {"OUT_DIR": str(self.out), "MODE": "allreduce", "STEPS": str(STEPS), "DIM": "64",
                    "STEP_SLEEP": "0.1"}

    def start(self, node_rank: int, label: Optional[str] = None) -> Node:
        if self.backend == "static":
            where = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                     "--master-port", str(self.port)]
        else:
            where = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        node = Node(self.launcher, [*where, *FAST, *self.extra, "--rdzv-id", self.name, self.worker],
                    self.tmp / f"logs-{self.name}-{label or len(self.nodes)}", env=self.env)
        self.nodes.append(node)
        return node

    def step(self, rank: int) -> int:
        try:
            return int((self.out / f"progress.rank{rank}").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    def resources(self, rank: int) -> tuple[int, int, int]:
        """(generation, threads, open descriptors) of the rank's process at its last progress report."""
        _, gen, _, threads, fds = (self.out / f"progress.rank{rank}").read_text().split()
        return int(gen), int(threads), int(fds)

    def wait_step(self, step: int, ranks=range(4), timeout: float = 90) -> None:
        def reached() -> bool:
            if not all(n.alive() for n in self.nodes):
                raise AssertionError("a node ended early\n" + self.describe())
            return all(self.step(r) >= step for r in ranks)
        wait_until(reached, timeout, message=f"every rank at step {step}")

    def entries(self, rank: int) -> list[tuple[int, int, str]]:
        """(iteration, start step, process: pid@start time) per entry of the training function."""
        text = (self.out / f"entries.rank{rank}").read_text()
        return [(int(it), int(start), proc) for it, start, proc in (line.split() for line in text.splitlines())]

    def describe(self) -> str:
        return "\n".join(n.describe() for n in self.nodes)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The fault-free run of the same 2-node job."""
    from conftest import Launcher
    tmp = tmp_path_factory.mktemp("node-loss-ref")
    launcher = Launcher(tmp)
    try:
        job = Cluster(launcher, tmp, "ref")
        nodes = [job.start(0), job.start(1)]
        codes = [n.wait(180) for n in nodes]
        assert codes == [0, 0], job.describe()
        return job.out
    finally:
        launcher.cleanup()


def assert_survivors_kept_processes(job: Cluster, lost_ranks=(2, 3), generations=(0, 1)) -> None:
    for rank in range(4):
        entries = job.entries(rank)
        assert [e[0] for e in entries] == list(generations), f"rank {rank}: {entries}\n{job.describe()}"
        pids = {e[2] for e in entries}
        if rank in lost_ranks:
            assert len(pids) == 2, f"rank {rank} should run in a new process: {entries}"
            assert entries[-1][1] >= KILL_AT, f"rank {rank} restored an older step: {entries}"
        else:
            assert len(pids) == 1, f"rank {rank} should have kept its process: {entries}"


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_node_killed_whole_and_started_again(launcher, tmp_path, reference, backend):
    """Node 1 is killed whole mid-training and its command started again 1 s later: both agents exit 0, node
    0's ranks keep their processes, ranks 2 and 3 run in new processes from the committed step (from node
    0's peer copies: node 1's /dev/shm went with it), and the result is bitwise equal to the fault-free run.
    An exception on rank 0 at step 8 comes first, so that the survivors' threads and descriptors can be compared
    between two generations after a restart: the node loss leaves them as they were (no leak)."""
    job = Cluster(launcher, tmp_path, f"kill-{backend}", backend)
    job.env["FAULTS"] = "raise:0:8:top"
    node0 = job.start(0)
    if backend == "c10d":   # node ranks go in join order: node 0 first
        wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start(1)
    job.wait_step(KILL_AT)
    before = {r: job.resources(r) for r in (0, 1)}
    node1.kill()
    assert node1.wait(30) != 0
    replacement = job.start(1, label="replacement")
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert_survivors_kept_processes(job, generations=(0, 1, 2))
    for rank in (0, 1):   # no leak in the survivors: the same threads and descriptors in the new generation
        (g0, t0, f0), (g1, t1, f1) = before[rank], job.resources(rank)
        assert (g0, g1) == (1, 2) and t1 <= t0 and f1 <= f0, \
            f"rank {rank}: threads {t0} -> {t1}, fds {f0} -> {f1} across the node loss\n{info}"
    lost = node0.events("node_lost")
    assert lost and lost[0]["node"] == 1 and "declared lost" in lost[0]["msg"], info
    go = node0.events("go")
    assert [e["generation"] for e in go] == [1, 2] and "node 1 lost" in go[-1]["root_cause"], info
    assert replacement.events("replacing"), info
    restored = node0.events("state_restored") + replacement.events("state_restored")
    # at most the step in flight is lost: a step every rank completed is committed only once node 1's peer
    # copies of it reached node 0, and a kill between the two leaves the step before as the newest committed
    assert restored and all(e["lost_steps"] <= 1 for e in restored), info
    assert_same_state(reference, job.out)


def test_hot_spare_takes_over_a_lost_node(launcher, tmp_path, reference):
    """c10d, three agents for a two-node job: the third waits as a hot spare (not in the world size); node 1
    is killed whole and the spare takes its ranks - nothing is started again; bitwise equal."""
    job = Cluster(launcher, tmp_path, "spare", "c10d")
    first = job.start(0)
    wait_until(lambda: "node 0 waiting" in first.proc.err(), 60, message="node 0 joined")
    second = job.start(1)
    first.wait_event("agent_start")
    second.wait_event("agent_start")
    spare = job.start(2, label="spare")
    wait_until(lambda: "hot spare" in spare.proc.err(), 60, message="the spare says it waits")
    first.wait_event("spare_waiting")            # the job's event log lists it
    job.wait_step(KILL_AT)
    second.kill()
    codes = [first.wait(180), spare.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert spare.events("replacing"), info
    assert "ranks 2..3 of 4" in spare.wait_event("agent_start")["msg"], "the spare took node 1's ranks\n" + info
    assert_survivors_kept_processes(job)
    assert_same_state(reference, job.out)


def test_replacement_killed_before_its_ranks_joined(launcher, tmp_path, reference):
    """Node 1 is killed; its first replacement takes over the node rank and is killed too before its ranks
    joined; a second replacement finishes the job; bitwise equal."""
    job = Cluster(launcher, tmp_path, "second")
    node0 = job.start(0)
    node1 = job.start(1)
    job.wait_step(KILL_AT)
    node1.kill()
    first = job.start(1, label="replacement1")
    first.wait_event("replacing")
    first.kill()
    wait_until(lambda: len(node0.events("node_lost")) >= 2, 60, message="the first replacement declared lost")
    second = job.start(1, label="replacement2")
    codes = [node0.wait(180), second.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert [e["generation"] for e in node0.events("go")] == [1], info
    assert_survivors_kept_processes(job)
    assert_same_state(reference, job.out)


def test_a_replaced_agent_that_comes_back_is_fenced(launcher, tmp_path, reference):
    """Node 1's agent is SIGSTOPped until it is declared lost and replaced, then SIGCONTed: it does not
    disturb the job (one generation, bitwise equal) and leaves with one clear line and exit code 80."""
    job = Cluster(launcher, tmp_path, "fence")
    node0 = job.start(0)
    node1 = job.start(1)
    job.wait_step(KILL_AT)
    node1.signal_agent(signal.SIGSTOP)
    replacement = job.start(1, label="replacement")
    replacement.wait_event("replacing", timeout=60)
    node1.signal_agent(signal.SIGCONT)
    assert node1.wait(60) == EXIT_FENCED, job.describe()
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert "declared lost" in node1.proc.err() and "another agent" in node1.proc.err(), info
    assert [e["generation"] for e in node0.events("go")] == [1], info
    for rank in (0, 1):
        assert len({e[2] for e in job.entries(rank)}) == 1, info
    assert_same_state(reference, job.out)


def test_node_killed_during_a_recovery_round(launcher, tmp_path, reference):
    """Rank 2 (node 1) raises at step 20; while that in-process round runs, node 1 is killed whole: the loss
    is folded into the same round (one generation), its replacement joins it; bitwise equal."""
    job = Cluster(launcher, tmp_path, "during")
    job.env["FAULTS"] = f"raise:2:{KILL_AT}:top"
    gate = tmp_path / "round-may-end"
    job.env["FINALIZE_GATE"] = str(gate)    # node 0's ranks stay in the round until node 1 is gone
    node0 = job.start(0)
    node1 = job.start(1)
    node1.wait_event("restart_signal", timeout=90)
    node1.kill()
    gate.touch()
    replacement = job.start(1, label="replacement")
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert [e["generation"] for e in node0.events("go")] == [1], info
    assert node0.events("node_lost") and replacement.events("replacing"), info
    assert_survivors_kept_processes(job)
    assert_same_state(reference, job.out)


def test_a_spare_that_was_not_needed_leaves_with_the_job(launcher, tmp_path):
    """c10d, a hot spare for a job that loses no node: the job finishes, and the spare exits 0 with one line
    (it never joined the world size)."""
    job = Cluster(launcher, tmp_path, "idle-spare", "c10d")
    job.env["STEPS"] = "30"
    first = job.start(0)
    wait_until(lambda: "node 0 waiting" in first.proc.err(), 60, message="node 0 joined")
    second = job.start(1)
    first.wait_event("agent_start")
    spare = job.start(2, label="spare")
    wait_until(lambda: "hot spare" in spare.proc.err(), 60, message="the spare says it waits")
    codes = [first.wait(180), second.wait(180), spare.wait(60)]
    info = job.describe()
    assert codes == [0, 0, 0], info
    assert "this agent was not needed" in spare.proc.err(), info
    assert not spare.events("agent_start"), "the spare never took a node rank\n" + info


def test_a_replacement_nodes_data_cache_resumes_at_the_restored_step(launcher, tmp_path):
    """MMAPDataLoader (tests/scripts/mmap_worker.py) with its cache in each node's own /dev/shm: node 1 is killed
    whole and replaced; the replacement's ranks start with an empty cache, read their first batch at the
    restored step from it, and every rank of the job trains on exactly the batches of a fault-free run."""
    import hashlib
    import sys
    sys.path.insert(0, str(SCRIPTS))
    import mmap_worker
    steps = 24
    job = Cluster(launcher, tmp_path, "mmap", worker=str(SCRIPTS / "mmap_worker.py"))
    job.env = {"OUT_DIR": str(job.out), "CACHE_DIR": "/dev/shm/hpr-test-cache", "STEPS": str(steps),
               "STEP_SLEEP": "0.15"}

    def recs(rank: int) -> list[dict]:
        path = job.out / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    node0, node1 = job.start(0), job.start(1)
    wait_until(lambda: any(r["ev"] == "batch" and r["step"] >= 8 for r in recs(2)), 90,
               message="rank 2 at step 8\n" + job.describe())
    node1.kill()
    assert node1.wait(30) != 0
    replacement = job.start(1, label="replacement")
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    for rank in range(4):
        dl, want, epoch = mmap_worker.data_loader(rank), {}, 0
        while len(want) < steps:
            dl.sampler.set_epoch(epoch)
            for batch in dl:
                want.setdefault(len(want), mmap_worker.digest(batch, hashlib.sha256()).hexdigest())
            epoch += 1
        batches = [r for r in recs(rank) if r["ev"] == "batch"]
        wrong = [r["step"] for r in batches if r["h"] != want[r["step"]]]
        assert not wrong, f"rank {rank} trained on other batches at steps {wrong}\n{info}"
        assert max(r["step"] for r in batches) == steps - 1, info
        pids = {r["pid"] for r in batches}
        if rank in (2, 3):
            entry = [r for r in recs(rank) if r["ev"] == "enter"][-1]
            first = next(r for r in batches if r["pid"] == entry["pid"])
            assert len(pids) == 2 and entry["start"] >= 8 and first["step"] == entry["start"], \
                f"rank {rank}: {entry}, first batch {first}\n{info}"
            assert first["src"] == "cached", f"rank {rank}: the first batch after the loss bypassed the cache\n{info}"
        else:
            assert len(pids) == 1, f"rank {rank} should have kept its process\n{info}"


def test_a_layout_with_both_copies_of_a_shard_on_one_node_is_refused_at_start(launcher, tmp_path):
    """2 pipeline stages x 2 data-parallel ranks with 2 optimizer instances, in Megatron's default order (rank =
    dp + 2 * stage), on 2 nodes of 2: both copies of stage 0's state are on node 0, both of stage 1's on node 1 -
    either node's loss would lose a stage. The CheckpointManager refuses when it is built, before any step, in
    one line naming the rank order that spreads the copies; the job ends with exit code 2."""
    job = Cluster(launcher, tmp_path, "onenode")
    job.env.update(MODE="pipeline", STEPS="4", STEP_SLEEP="0")
    nodes = [job.start(0), job.start(1)]
    codes = [n.wait(120) for n in nodes]
    info = job.describe()
    assert 2 in codes and all(c != 0 for c in codes), info
    assert "puts every copy of a shard on one node" in info and "'tp-cp-pp-ep-dp'" in info, info
    assert "Traceback" not in info, info
    assert not list(job.out.glob("entries.rank*")), "a rank started training"


def test_a_node_lost_whole_gets_its_pipeline_state_from_the_other_instance(launcher, tmp_path):
    """The same job in the order that spreads the copies (RANK_ORDER=tp-cp-pp-ep-dp: rank = stage + 2 * dp, the
    CheckpointManager given pipeline_model_parallel_size=2 and that order): each node holds one data-parallel
    rank of both stages, and the replicas are across nodes. Node 1 is killed whole (its /dev/shm with it) and
    started again: its ranks get their state from their replicas in the other instance on node 0 (source
    "replica", not the peer copies), node 0's ranks keep their processes, and every rank ends bitwise equal to
    the fault-free run."""
    env = {"MODE": "pipeline", "RANK_ORDER": "tp-cp-pp-ep-dp"}
    ref = Cluster(launcher, tmp_path, "pp-ref")
    ref.env.update(env)
    ref_nodes = [ref.start(0), ref.start(1)]
    assert [n.wait(180) for n in ref_nodes] == [0, 0], ref.describe()
    job = Cluster(launcher, tmp_path, "pp-loss")
    job.env.update(env)
    node0, node1 = job.start(0), job.start(1)
    job.wait_step(KILL_AT)
    node1.kill()
    assert node1.wait(30) != 0
    replacement = job.start(1, label="replacement")
    codes = [node0.wait(180), replacement.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    assert_survivors_kept_processes(job)
    restored = node0.events("state_restored")
    assert restored and restored[-1]["source"] == "replica", f"{restored}\n{info}"
    assert_same_state(ref.out, job.out)
