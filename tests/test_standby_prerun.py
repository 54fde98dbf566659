"""Standby pre-run (--standby-prerun, agent/workers/prerun.py, hyperpodrun/runtime/park.py) with real jobs: 3 ranks of
DDP on gloo under --inprocess-restart with one standby per local rank, the model built at the script's top
(tests/scripts/ckpt_worker.py, BUILD_OUTSIDE=1). A SIGKILLed rank is replaced by its slot's standby, which ran the
script's top before the fault and not again after it; the job goes on from the committed step and ends bitwise
equal to the fault-free run. A script that reads RANK at its top is not run ahead (one line says why) and still
ends exact; `--standby-prerun off` behaves as before (the standby runs the script after the fault). The same with
Lightning (tests/scripts/lightning_worker.py, MODEL_OUTSIDE=1: the LightningModule built at the top, the Trainer
inside the function): the standby builds the module ahead and the run ends bitwise equal to the fault-free one."""
from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from test_checkpoint import HYPERPODRUN, WORKER, events
from test_standby import alive, ready_standbys, wait_for
from conftest import assert_same_ckpt_state

NPROC = 3
VICTIM = 1
FAULT_STEP = 4
BASE_ENV = {"MODE": "ddp", "BUILD_OUTSIDE": "1", "STEPS": "8", "DIM": "64"}


LIGHTNING = os.path.join(os.path.dirname(WORKER), "lightning_worker.py")
LIGHTNING_ENV = {"MODEL_OUTSIDE": "1", "STEPS": "12"}


def run(tmp_path, name: str, worker_env: dict, flags: tuple = (), started=None, timeout: float = 300,
        worker: str = WORKER) -> tuple[int, str, str]:
    """`worker` (ckpt_worker.py with BASE_ENV, or lightning_worker.py with LIGHTNING_ENV) on NPROC ranks under
    `hyperpodrun --inprocess-restart`: (exit code, OUT_DIR, agent's stderr)."""
    out = tmp_path / name
    out.mkdir()
    base = BASE_ENV if worker == WORKER else dict(LIGHTNING_ENV, CACHE_DIR=str(tmp_path / f"cache-{name}"))
    env = dict(os.environ, OUT_DIR=str(out), HYPERPODRUN_SHM_DIR=str(tmp_path / "shm"), **base, **worker_env)
    cmd = [HYPERPODRUN, "--nproc-per-node", str(NPROC), "--inprocess-restart", "--heartbeat-interval", "0.5",
           "--heartbeat-timeout", "10", "--inprocess-timeout", "90", "--log-dir", str(tmp_path / f"logs-{name}"),
           "--rdzv-id", name, *flags, worker]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if started is not None:
        started(proc)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"job {name} timed out:\n{stderr.decode()[-3000:]}")
    return proc.returncode, str(out), stderr.decode()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("prerun-ref")
    rc, out, err = run(tmp, "ref", {}, flags=("--standby-workers", "0"))
    assert rc == 0, err[-3000:]
    return out


def killed_job(tmp_path, name: str, flags: tuple, extra: dict, prerun: bool,
               worker: str = WORKER) -> tuple[str, str, dict]:
    """The job with rank VICTIM SIGKILLed at the top of step FAULT_STEP, once every local rank has a ready standby
    (`prerun`: one that ran the script ahead): (OUT_DIR, the agent's stderr, what the driver saw)."""
    out = tmp_path / name
    box: dict = {}

    def drive() -> None:
        try:
            box["standbys"] = wait_for(lambda: (r := ready_prerun(tmp_path, name, prerun)) and len(r) == NPROC and r,
                                       180, "a ready standby per local rank")
        except BaseException as exc:   # reported by the test thread
            box["error"] = exc
        finally:
            for gate in ("gate", "unpause"):   # the victim may die now; the others go on into the step
                (out / gate).touch()
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    rc, outdir, err = run(tmp_path, name, {"FAULTS": f"kill:{VICTIM}:{FAULT_STEP}:top", "PAUSE_AT": str(FAULT_STEP),
                                           "FAULT_GATE": str(out / "gate"), "PROCESS_LOG": str(out / "processes"),
                                           **extra}, flags=("--standby-workers", "1", *flags), worker=worker)
    driver.join(10)
    if "error" in box:
        raise box["error"]
    assert rc == 0, err[-3000:]
    return outdir, err, box


def ready_prerun(tmp_path, name: str, prerun: bool) -> dict[int, int]:
    """local rank -> pid of its ready standby, counting only those that did (`prerun`) or did not run the
    script ahead."""
    ready = ready_standbys(tmp_path, name)
    flags = {e["pid"]: bool(e.get("prerun")) for e in events_of(tmp_path, name) if e["event"] == "standby_ready"}
    return {lr: pid for lr, pid in ready.items() if flags.get(pid) == prerun}


def events_of(tmp_path, name: str) -> list[dict]:
    try:
        return events(tmp_path, name)
    except ValueError:   # a line being written
        return []


def process_log(out: str) -> list[tuple[str, ...]]:
    with open(os.path.join(out, "processes")) as fh:
        return [tuple(line.split()) for line in fh if line.strip()]


def replacement(tmp_path, name: str) -> dict:
    """The one worker_start of a later generation: the killed rank's replacement."""
    later = [e for e in events(tmp_path, name) if e["event"] == "worker_start" and e["generation"] > 0]
    assert len(later) == 1 and later[0]["rank"] == VICTIM, later
    return later[0]


def entries(out: str, rank: int) -> list[tuple[int, int, int]]:
    """(generation, the step it started from, pid) per entry of `rank` into the wrapped function."""
    with open(os.path.join(out, f"entries.rank{rank}")) as fh:
        return [(int(g), int(s), int(p.split("@")[0])) for g, s, p in (line.split() for line in fh)]


def assert_resumed(out: str, pid: int) -> None:
    """Every rank entered generation 1 at the same committed step (not 0), the victim as `pid`."""
    starts = {}
    for rank in range(NPROC):
        gen1 = [e for e in entries(out, rank) if e[0] == 1]
        assert len(gen1) == 1, (rank, entries(out, rank))
        starts[rank] = gen1[0][1]
        if rank == VICTIM:
            assert gen1[0][2] == pid, (gen1, pid)
    assert len(set(starts.values())) == 1 and 0 < starts[VICTIM] <= FAULT_STEP, starts


@pytest.mark.slow
def test_a_prerun_standby_takes_over_without_running_the_top_again(tmp_path, fault_free):
    out, err, box = killed_job(tmp_path, "ahead", (), {"IMPORT_CHILD": "1"}, prerun=True)
    evs = events(tmp_path, "ahead")
    assert not [e for e in evs if e["event"] in ("standby_prerun", "standby_lost")], \
        [e for e in evs if e["event"] in ("standby_prerun", "standby_lost")]
    new = replacement(tmp_path, "ahead")
    assert new["source"] == "standby" and new["pid"] == box["standbys"][VICTIM], (new, box)
    log = process_log(out)
    killed = log.index(next(x for x in log if x[0] == "kill"))
    imports = [i for i, x in enumerate(log) if x == ("import", str(new["pid"]))]
    # the standby ran the script's top once, before the fault, and never again as the rank
    assert len(imports) == 1 and imports[0] < killed, log
    assert_resumed(out, new["pid"])
    assert_same_ckpt_state(fault_free, out, NPROC)
    # what the standby printed at the script's top reached the rank's log after its promotion
    logs = tmp_path / "logs-ahead" / "ahead" / "attempt_1" / f"rank_{VICTIM}" / "stdout.log"
    assert f"imported in {new['pid']}" in logs.read_text(), logs.read_text()[-2000:]
    # nothing outlives the job: the standbys that were not used, and the children their script's top started
    others = [pid for lr, pid in box["standbys"].items() if lr != VICTIM]
    children = [int(x[1]) for x in log if x[0] == "child"]
    assert len(children) >= NPROC * 2, log
    wait_for(lambda: not any(alive(p) for p in others + children), 20,
             f"the standbys {others} and the children {children} to go with the job")


@pytest.mark.slow
def test_a_script_that_reads_its_rank_at_the_top_is_not_run_ahead(tmp_path, fault_free):
    out, err, box = killed_job(tmp_path, "rank-read", (), {"READ_RANK_AT_IMPORT": "1"}, prerun=False)
    evs = events(tmp_path, "rank-read")
    gave_up = [e for e in evs if e["event"] == "standby_prerun"]
    assert gave_up and all("RANK" in e["why"] and "ckpt_worker.py:" in e["why"] for e in gave_up), gave_up
    said = [line for line in err.splitlines() if "do not run this script ahead" in line]
    assert len(said) == 1, err[-3000:]   # one line, however many standbys gave up
    assert not [e for e in evs if e["event"] == "standby_lost"]
    new = replacement(tmp_path, "rank-read")
    assert new["source"] == "standby" and new["pid"] == box["standbys"][VICTIM], (new, box)
    log = process_log(out)
    killed = log.index(next(x for x in log if x[0] == "kill"))
    imports = [i for i, x in enumerate(log) if x == ("import", str(new["pid"]))]
    assert len(imports) == 1 and imports[0] > killed, log   # it ran the script after the fault, as without pre-run
    assert_resumed(out, new["pid"])
    assert_same_ckpt_state(fault_free, out, NPROC)


@pytest.mark.slow
def test_prerun_off_runs_the_script_after_the_fault(tmp_path, fault_free):
    out, err, box = killed_job(tmp_path, "off", ("--standby-prerun", "off"), {}, prerun=False)
    evs = events(tmp_path, "off")
    assert not [e for e in evs if e["event"] in ("standby_prerun", "standby_lost")]
    assert "runs the script ahead" not in next(e["msg"] for e in evs if e["event"] == "standby_workers")
    new = replacement(tmp_path, "off")
    assert new["source"] == "standby" and new["pid"] == box["standbys"][VICTIM], (new, box)
    log = process_log(out)
    killed = log.index(next(x for x in log if x[0] == "kill"))
    assert [i for i, x in enumerate(log) if x == ("import", str(new["pid"]))] > [killed], log
    assert_resumed(out, new["pid"])
    assert_same_ckpt_state(fault_free, out, NPROC)


def test_the_flag_takes_auto_or_off():
    res = subprocess.run([HYPERPODRUN, "--nproc-per-node", "1", "--inprocess-restart", "--standby-prerun", "maybe",
                          "train"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--standby-prerun" in res.stderr, res.stderr
    res = subprocess.run([HYPERPODRUN, "--nproc-per-node", "1", "--inprocess-restart", "train"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, HYPERPODRUN_STANDBY_PRERUN="sometimes"))
    assert res.returncode == 2 and "--standby-prerun" in res.stderr and "sometimes" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.fixture(scope="module")
def lightning_fault_free(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("prerun-lightning-ref")
    rc, out, err = run(tmp, "ref", {}, flags=("--standby-workers", "0"), worker=LIGHTNING)
    assert rc == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_a_lightning_module_built_at_the_top_is_built_ahead_by_the_standby(tmp_path, lightning_fault_free):
    import torch

    from test_lightning import batches
    out, err, box = killed_job(tmp_path, "lightning", (), {}, prerun=True, worker=LIGHTNING)
    evs = events(tmp_path, "lightning")
    assert not [e for e in evs if e["event"] in ("standby_prerun", "standby_lost")], err[-3000:]
    new = replacement(tmp_path, "lightning")
    assert new["source"] == "standby" and new["pid"] == box["standbys"][VICTIM], (new, box)
    log = process_log(out)
    killed = log.index(next(x for x in log if x[0] == "kill"))
    imports = [i for i, x in enumerate(log) if x == ("import", str(new["pid"]))]
    assert len(imports) == 1 and imports[0] < killed, log   # its module was built before the fault, once
    for rank in range(NPROC):
        a = torch.load(os.path.join(lightning_fault_free, f"rank{rank}.pt"))
        b = torch.load(os.path.join(out, f"rank{rank}.pt"))
        assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"])
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"rank {rank}: parameter {k} differs"
        for pid, st in a["opt"]["state"].items():
            for n, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(v, b["opt"]["state"][pid][n]), f"rank {rank}: optimizer {pid}.{n} differs"
        assert batches(lightning_fault_free, rank) == batches(out, rank), f"rank {rank} trained on other batches"
