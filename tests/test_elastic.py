"""Elastic jobs (`--nnodes 1:2`, c10d, CPU, gloo, --inprocess-restart with CheckpointManager, 2 ranks per node):
a lost node that nothing replaces within --replace-timeout is dropped and the job goes on alone from the
committed step; a node that joins a running job is admitted at the next generation and the job grows; state
that is sharded (ZeRO) is refused at another world size with one clear line. Each node runs in its own pid
and mount namespaces (tests/nodes.py). The surviving ranks keep their processes throughout.

The end state is compared with a local re-computation of the same training at the world sizes the job ran at
(4 ranks up to the step of the change, 2 after it, or the other way round): a step lost or done twice would
move every parameter by about the learning rate, far above the tolerance (the all-reduce's summation order is
the only difference).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import SCRIPTS, free_port, wait_until
from nodes import Node, unavailable
from hyperpodrun.errors import EXIT_STATE_LOST

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

WORKER = str(SCRIPTS / "ckpt_worker.py")
STEPS = 40
DIM = 64
FAST = ["--nproc-per-node", "2", "--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
        "--inprocess-timeout", "30", "--node-timeout", "3"]


class ElasticJob:
    def __init__(self, launcher, tmp: Path, name: str, mode: str = "ddp", replace_timeout: float = 3) -> None:
        self.launcher, self.tmp, self.name = launcher, tmp, name
        self.port = free_port()
        self.out = tmp / f"out-{name}"
        self.out.mkdir()
        self.nodes: list[Node] = []
        self.env = {"OUT_DIR": str(self.out), "MODE": mode, "STEPS": str(STEPS), "DIM": str(DIM), "STEP_SLEEP": "0.1"}
        self.replace_timeout = replace_timeout

    def start(self, label: str, last_call: float = 30) -> Node:
        args = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-conf", f"last_call_timeout={last_call:g}", *FAST, "--replace-timeout",
                f"{self.replace_timeout:g}", "--rdzv-id", self.name, WORKER]
        node = Node(self.launcher, args, self.tmp / f"logs-{self.name}-{label}", env=self.env)
        self.nodes.append(node)
        return node

    def step(self, rank: int) -> int:
        try:
            return int((self.out / f"progress.rank{rank}").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    def wait_step(self, step: int, ranks, timeout: float = 90) -> None:
        wait_until(lambda: all(self.step(r) >= step for r in ranks), timeout, message=f"ranks {list(ranks)} at "
                   f"step {step}\n" + self.describe())

    def entries(self, rank: int) -> list[tuple[int, int, str]]:
        text = (self.out / f"entries.rank{rank}").read_text()
        return [(int(it), int(start), proc) for it, start, proc in (line.split() for line in text.splitlines())]

    def describe(self) -> str:
        return "\n".join(n.describe() for n in self.nodes)


def simulate(worlds: list[int]) -> dict[str, torch.Tensor]:
    """ckpt_worker.py's DDP training re-computed in this process: step s averages the gradients of ranks
    0..worlds[s]-1 (DDP divides each by the world size, then sums)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 4 * DIM), nn.GELU(),
                          nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step, world in enumerate(worlds):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, DIM, generator=g)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
            model.zero_grad()
            loss.backward()
            for acc, p in zip(grads, model.parameters()):
                acc += p.grad / world
        for acc, p in zip(grads, model.parameters()):
            p.grad = acc
        opt.step()
    return {f"module.{k}": v for k, v in model.state_dict().items()}


def assert_trained_as(out: Path, ranks, worlds: list[int], info: str) -> None:
    want = simulate(worlds)
    for rank in ranks:
        got = torch.load(os.path.join(out, f"rank{rank}.pt"))["model"]
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), \
                f"rank {rank}: {k} differs by {(got[k] - v).abs().max():.3g}\n{info}"


def restored(node: Node) -> list[dict]:
    return node.events("state_restored")


def test_lost_node_not_replaced_the_job_shrinks_and_finishes(launcher, tmp_path):
    """--nnodes 1:2: node 1 killed whole, nothing replaces it; after --replace-timeout node 0 goes on alone
    (world size 2) from the committed step - its ranks keep their processes - and finishes with exit 0."""
    job = ElasticJob(launcher, tmp_path, "shrink")
    node0 = job.start("0")
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start("1")
    assert "ranks 2..3 of 4" in node1.wait_event("agent_start")["msg"], job.describe()
    job.wait_step(15, range(4))
    node1.kill()
    assert node0.wait(180) == 0, job.describe()
    info = job.describe()
    shrunk = node0.events("job_shrunk")
    assert len(shrunk) == 1 and shrunk[0]["world_size"] == 2 and shrunk[0]["previous_world_size"] == 4, info
    back = restored(node0)
    assert len(back) == 1 and back[0]["source"] == "resized" and back[0]["lost_steps"] == 0, info
    at = back[0]["step"]
    for rank in (0, 1):
        entries = job.entries(rank)
        assert [e[0] for e in entries] == [0, 1] and len({e[2] for e in entries}) == 1, f"rank {rank}: {entries}"
        assert entries[1][1] == at, f"rank {rank} restarted at {entries[1][1]}, not the committed step {at}"
    assert at >= 15, info
    assert_trained_as(job.out, (0, 1), [4] * at + [2] * (STEPS - at), info)


def test_a_node_that_joins_a_running_job_is_admitted_and_the_job_grows(launcher, tmp_path):
    """--nnodes 1:2: the job forms with node 0 alone (last_call_timeout 0); a second agent started mid-run is
    admitted at the next generation: ranks 2 and 3 join from the committed step with node 0's state, node 0's
    ranks keep their processes, and the job finishes on 4 ranks."""
    job = ElasticJob(launcher, tmp_path, "grow")
    node0 = job.start("0", last_call=0)
    assert "ranks 0..1 of 2" in node0.wait_event("agent_start")["msg"], job.describe()
    job.wait_step(10, range(2))
    node1 = job.start("1")
    codes = [node0.wait(180), node1.wait(180)]
    info = job.describe()
    assert codes == [0, 0], info
    admitted = node0.events("node_admitted")
    assert len(admitted) == 1 and admitted[0]["node"] == 1 and admitted[0]["world_size"] == 4, info
    assert node1.events("admitted") and "ranks 2..3 of 4" in node1.wait_event("agent_start")["msg"], info
    back = restored(node0) + restored(node1)
    assert back and all(e["source"] == "resized" and e["lost_steps"] == 0 for e in back), info
    at = back[0]["step"]
    for rank in (0, 1):
        entries = job.entries(rank)
        assert [e[0] for e in entries] == [0, 1] and len({e[2] for e in entries}) == 1, f"rank {rank}: {entries}"
        assert entries[1][1] == at, f"rank {rank}: {entries}"
    for rank in (2, 3):
        assert [e[1] for e in job.entries(rank)] == [at], f"rank {rank}: {job.entries(rank)}"
    assert_trained_as(job.out, range(4), [2] * at + [4] * (STEPS - at), info)


def test_sharded_state_is_refused_at_another_world_size(launcher, tmp_path):
    """ZeRO-1 (each rank holds its share of the optimizer state): after the shrink CheckpointManager cannot
    restore it at the new world size and says so in one line; the job ends with exit code 75."""
    job = ElasticJob(launcher, tmp_path, "zero", mode="zero")
    node0 = job.start("0")
    wait_until(lambda: "node 0 waiting" in node0.proc.err(), 60, message="node 0 joined")
    node1 = job.start("1")
    node1.wait_event("agent_start")
    job.wait_step(10, range(4))
    node1.kill()
    assert node0.wait(180) == EXIT_STATE_LOST, job.describe()
    assert node0.events("job_shrunk"), job.describe()
    err = node0.proc.err()
    assert "restores at another world size only state that every rank holds whole" in err, job.describe()
