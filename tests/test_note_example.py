"""The product note's complete example (its section 6), with only the package prefix of its imports changed and
its Trainer on CPU (tests/scripts/note_example/training_script.py; MyModel and MyDataModule in my_project.py),
runs under `hyperpodrun --inprocess-restart` on 4 ranks (gloo) with 2 optimizer instances (the optimizer state
sharded within each instance, as Megatron's partial distributed optimizer): a rank SIGKILLed
mid-run together with its snapshots comes back with its state from its peer in the other instance, the other
ranks keep their processes, and every rank ends bitwise equal to the fault-free run."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "scripts", "note_example")
HYPERPODRUN = os.path.join(os.path.dirname(sys.executable), "hyperpodrun")

pytest.importorskip("omegaconf")
pytest.importorskip("pytorch_lightning")


def run_example(tmp_path, name: str, fault: str = "") -> tuple[int, str, str]:
    """The example in its own working directory (config.yaml, Lightning's logs): (exit code, OUT_DIR, stderr)."""
    work = tmp_path / name
    out = work / "out"
    out.mkdir(parents=True)
    shutil.copy(os.path.join(EXAMPLE, "config.yaml"), work / "config.yaml")
    env = dict(os.environ, OUT_DIR=str(out), HYPERPODRUN_SHM_DIR=str(tmp_path / "shm"), NOTE_FAULT=fault,
               PYTHONPATH=os.pathsep.join(p for p in (EXAMPLE, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [HYPERPODRUN, "--nproc-per-node", "4", "--inprocess-restart", "--heartbeat-interval", "0.5",
           "--heartbeat-timeout", "10", "--inprocess-timeout", "60", "--log-dir", str(tmp_path / f"logs-{name}"),
           "--rdzv-id", name, os.path.join(EXAMPLE, "training_script.py")]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _stdout, stderr = proc.communicate()
        pytest.fail(f"the example timed out:\n{stderr.decode()[-3000:]}")
    return proc.returncode, str(out), stderr.decode(errors="replace")


def lines(out: str, name: str, rank: int) -> list[list[str]]:
    with open(os.path.join(out, f"{name}.rank{rank}")) as fh:
        return [line.split() for line in fh.read().splitlines()]


@pytest.mark.slow
def test_the_notes_complete_example_restores_a_killed_rank_from_the_other_instance(tmp_path):
    rc, ref, err = run_example(tmp_path, "ref")
    assert rc == 0, err[-4000:]
    rc, got, err = run_example(tmp_path, "fault", fault="1:5")
    assert rc == 0, err[-4000:]
    # rank 1 came back at step 5 with its state from rank 3 (its peer in the other instance); the others kept
    # their own objects' state, in their own processes
    assert lines(got, "restores", 1) == [["0", "0", "None"], ["1", "5", "replica"]], lines(got, "restores", 1)
    for rank in (0, 2, 3):
        gens = lines(got, "restores", rank)
        assert [g[:2] for g in gens] == [["0", "0"], ["1", "5"]] and gens[1][2] != "replica", (rank, gens)
        assert len({pid for _gen, pid in lines(got, "pids", rank)}) == 1, f"rank {rank} was restarted"
    assert len({pid for _gen, pid in lines(got, "pids", 1)}) == 2
    # the strategy's num_distributed_optimizer_instances=2 is the CheckpointManager's replica map: rank 1's peer
    # is rank 3 (the other instance), not any DDP rank
    for rank in range(4):
        with open(os.path.join(got, f"groups.rank{rank}")) as fh:
            assert fh.read() == "[[0, 2], [1, 3]]"
    # the optimizer state is sharded within each instance ({0,1} and {2,3}): ranks 1 and 3 hold the same share,
    # ranks 0 and 1 different ones - only rank 3 could give rank 1 its state back
    share = {r: set(torch.load(os.path.join(ref, f"rank{r}.pt"))["opt"]) for r in range(4)}
    assert share[1] == share[3] and share[0] == share[2] and share[0] and share[1] and not share[0] & share[1], share
    for rank in range(4):
        a = torch.load(os.path.join(ref, f"rank{rank}.pt"))
        b = torch.load(os.path.join(got, f"rank{rank}.pt"))
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), f"rank {rank}: parameter {k} differs"
        for pid, st in a["opt"].items():
            for n, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(v, b["opt"][pid][n]), f"rank {rank}: optimizer state {pid}.{n} differs"
