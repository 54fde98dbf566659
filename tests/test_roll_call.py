"""The roll call against real processes: an outsider (another uid, `setpriv` to nobody) joins a generation's
store as rank 1 while the real rank 1 is slow to start (Issue: security, acceptance 1); and two workers that
disagree on the key. The proof logic itself: tests/unit/test_roll_call_unit.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_events, wait_until, write_script
from hyperpodrun.env import BOOT_DIR
from hyperpodrun.errors import EXIT_INTRUDER

IS_ROOT = os.geteuid() == 0
SECRET_VALUE = 7.25            # rank 0's "secret" initial weights: the outsider must never see it

TRAIN = """
import gc, json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def run(out, rank, gen):
    if rank == 1 and gen == 0:     # slow to start: until the test has let the outsider in (with a deadline)
        deadline = time.monotonic() + 120
        while not (out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(SECRET if rank == 0 else 0.0)    # DDP broadcasts rank 0's weights to every rank
        model.bias.fill_(SECRET if rank == 0 else 0.0)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x = torch.full((2, 4), float(rank + 1 + step))
        loss = (ddp(x) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    (out / f"final{rank}.json").write_text(json.dumps([p.detach().flatten().tolist() for p in model.parameters()]))
    # DDP, the last loss (its graph holds the reducer) and the collectives' tensors go before the group, then a
    # barrier: a gloo thread must not free a tensor while Python exits (torch can abort the process then)
    del ddp, opt, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()

""".replace("SECRET", repr(SECRET_VALUE))
WORKER = TRAIN + 'run(Path(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"]))\n'
# the same training inside HPWrapper, for --inprocess-restart: each generation re-enters main()
WORKER_INPROCESS = TRAIN + """
from hyperpodrun import HPWrapper


@HPWrapper()
def main(caller=None):
    run(Path(sys.argv[1]), caller.rank, caller.iteration)


main()
"""

OUTSIDER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
port = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                        timeout=timedelta(seconds=20))
print("joined as rank 1", flush=True)
try:    # it runs the job's model under DDP, as the real rank 1 would: DDP broadcasts rank 0's weights
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    print("GOT", [p.detach().flatten().tolist() for p in model.parameters()], flush=True)
except Exception as exc:
    print("DDP:", type(exc).__name__, flush=True)
"""


def expected_final() -> list[list[float]]:
    """The training of WORKER without any outsider: DDP averages the two ranks' gradients."""
    import torch
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(SECRET_VALUE)
        model.bias.fill_(SECRET_VALUE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        losses = [(model(torch.full((2, 4), float(r + 1 + step))) - 1.0).pow(2).mean() for r in (0, 1)]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _nobody_can_run_torch() -> bool:
    try:
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                               "import torch.distributed"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="acting as another user needs root")
@pytest.mark.parametrize("inprocess", [False, True], ids=["process-restart", "inprocess-restart"])
def test_outsider_in_place_of_a_slow_rank_gets_nothing_and_is_named(launcher, tmp_path: Path, inprocess: bool) -> None:
    if not _nobody_can_run_torch():
        pytest.skip("uid 65534 cannot import torch from this interpreter")
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, "train.py", WORKER_INPROCESS if inprocess else WORKER)
    # --max-restarts 0 and --max-step-failures 1: the retry after a failed roll call is counted against neither
    mode = ["--inprocess-restart", "--max-step-failures", "1"] if inprocess else []
    job = launcher.start(["--nproc-per-node", "2", "--max-restarts", "0", *mode, str(script), str(out)])

    def store_port() -> int:
        for e in read_events(launcher.log_dir):
            if e["event"] == "workers_started" and e.get("generation") == 0:
                return int(re.search(r"store [^ ]+:(\d+)", e["msg"]).group(1))
        return 0
    port = wait_until(store_port, timeout=60, message="the job's generation 0 store")
    outsider = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                               OUTSIDER, str(port)], capture_output=True, text=True, timeout=120, cwd="/")
    (out / "release").touch()      # the real rank 1 may start now
    result = job.wait(timeout=180)

    assert "joined as rank 1" in outsider.stdout, outsider.stdout + outsider.stderr
    assert str(SECRET_VALUE) not in outsider.stdout, outsider.stdout   # no model state reached it
    events = read_events(launcher.log_dir)
    failed = [e for e in events if e["event"] == "roll_call_failed"]
    # its wrong proof names its rank; when it is slower than the roll call's 2 s with it at the ports, it is
    # named as the member that did not answer
    assert failed and re.search(r"(took rank 1's place in|joined the worker group of) generation 0 \(uid 65534\)",
                                failed[0]["msg"]), [(e["event"], e.get("msg")) for e in events]
    assert any(e["event"] == "foreign_connection" and e.get("uid") == 65534 for e in events), events
    assert result.rc == 0, result.err[-4000:]
    for rank in (0, 1):
        got = json.loads((out / f"final{rank}.json").read_text())
        for g, want in zip(got, expected_final()):
            assert g == pytest.approx(want, rel=1e-6, abs=1e-6)


WRONG_KEY = """
import torch.distributed as dist
dist.init_process_group("gloo")
print("passed", flush=True)
"""


def test_two_workers_with_different_keys_refuse_each_other(tmp_path: Path) -> None:
    """No agent, no other uid: two workers as the agent starts them (its environment, the sitecustomize),
    one with another key. Both refuse the group and exit EXIT_INTRUDER with the plain message."""
    from conftest import free_port
    script = write_script(tmp_path, "w.py", WRONG_KEY)
    port = free_port()
    procs = []
    for rank, key in ((0, "aa" * 32), (1, "bb" * 32)):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERPODRUN_", "TORCHELASTIC_"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   TORCHELASTIC_RUN_ID="r", HYPERPODRUN_RUN_DIR=str(tmp_path), HYPERPODRUN_GENERATION="3",
                   HYPERPODRUN_JOB_KEY=key, PYTHONPATH=BOOT_DIR, TORCHELASTIC_ERROR_FILE=str(tmp_path / f"e{rank}"))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, results)):
        assert p.returncode == EXIT_INTRUDER, stderr
        assert "passed" not in stdout
        other = 1 - rank
        assert f"took rank {other}'s place in generation 3" in stderr, stderr
        assert "RollCallError" in (tmp_path / f"e{rank}").read_text()
