"""Standby workers (--standby-workers, agent/workers/standby.py) with real jobs: 4 ranks of DDP on gloo under
--inprocess-restart. A rank that dies is replaced by its slot's standby and the job ends bitwise equal to
the fault-free run; a standby that dies is replaced; standbys are never ranks; none outlives the agent."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from test_checkpoint import HYPERPODRUN, WORKER, assert_same, events, launch, reference  # noqa: F401 (fixture)

STANDBY = ("--standby-workers", "1")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def safe_events(tmp_path, name: str) -> list[dict]:
    try:
        return events(tmp_path, name)
    except ValueError:   # a line being written
        return []


def ready_standbys(tmp_path, name: str) -> dict[int, int]:
    """local rank -> pid of its newest standby that is ready and neither lost nor used since."""
    ready: dict[int, int] = {}
    for e in safe_events(tmp_path, name):
        if e["event"] == "standby_ready":
            ready[e["local_rank"]] = e["pid"]
        elif e["event"] == "standby_lost" and ready.get(e["local_rank"]) == e["pid"]:
            del ready[e["local_rank"]]
        elif e["event"] == "worker_start" and e.get("source") == "standby":
            ready = {k: v for k, v in ready.items() if v != e["pid"]}
    return ready


@pytest.mark.slow
def test_a_dead_rank_is_replaced_by_its_standby_and_a_dead_standby_is_replaced(tmp_path, reference):
    victim = 2
    gate = tmp_path / "gate"
    box: dict = {}

    def drive() -> None:
        try:
            first = wait_for(lambda: (r := ready_standbys(tmp_path, "sb")) and len(r) == 4 and r, 120,
                             "a ready standby per local rank")
            os.kill(first[victim], signal.SIGKILL)   # a standby dies: another takes its place
            wait_for(lambda: ready_standbys(tmp_path, "sb").get(victim) not in (None, first[victim]), 60,
                     "the lost standby's replacement")
            box["standbys"] = ready_standbys(tmp_path, "sb")
            gate.touch()                               # now the rank may die
        except BaseException as exc:   # reported by the test thread
            box["error"] = exc
            gate.touch()
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    rc, out, err = launch(tmp_path, "sb", WORKER, {"MODE": "ddp", "FAULTS": f"kill:{victim}:4:top", "STEPS": "10",
                                                   "DIM": "64", "FAULT_GATE": str(gate)}, flags=STANDBY)
    driver.join(10)
    if "error" in box:
        raise box["error"]
    assert rc == 0, err[-3000:]
    evs = events(tmp_path, "sb")
    lost = [e for e in evs if e["event"] == "standby_lost"]
    assert [e["local_rank"] for e in lost] == [victim], lost
    started = [e for e in evs if e["event"] == "worker_start"]
    assert len([e for e in started if e["generation"] == 0]) == 4
    respawned = [e for e in started if e["generation"] > 0]
    assert [(e["rank"], e["source"], e["pid"]) for e in respawned] == [(victim, "standby", box["standbys"][victim])], \
        f"the dead rank did not come from its standby: {respawned}\n{err[-3000:]}"
    assert_same(reference("ddp"), out)   # 4 ranks (never a standby among them), bitwise the fault-free run
    assert not any(alive(pid) for pid in box["standbys"].values() if pid != box["standbys"][victim]), \
        "a standby outlived the job"


@pytest.mark.slow
def test_no_standby_outlives_a_killed_agent(tmp_path):
    box: dict = {}

    def kill_agent(proc: subprocess.Popen) -> None:
        try:
            box["standbys"] = wait_for(lambda: (r := ready_standbys(tmp_path, "kill9")) and len(r) == 4 and r, 120,
                                       "a ready standby per local rank")
            os.kill(proc.pid, signal.SIGKILL)
        except BaseException as exc:
            box["error"] = exc
            os.killpg(proc.pid, signal.SIGKILL)
    rc, out, err = launch(tmp_path, "kill9", WORKER, {"MODE": "ddp", "STEPS": "1000", "DIM": "64",
                                                      "STEP_SLEEP": "0.05"}, flags=STANDBY, started=kill_agent)
    if "error" in box:
        raise box["error"]
    assert rc == -signal.SIGKILL
    wait_for(lambda: not any(alive(pid) for pid in box["standbys"].values()), 20,
             f"the standbys {sorted(box['standbys'].values())} to go with their agent")


def test_standbys_need_an_in_process_restart_and_a_script():
    for flags, expected in ((["--standby-workers", "1"], "needs --inprocess-restart"),
                            (["--standby-workers", "1", "--inprocess-restart", "-m"], "needs a script entry point"),
                            (["--standby-workers", "-1", "--inprocess-restart"], "--standby-workers"),
                            (["--standby-workers", "foo", "--inprocess-restart"],
                             "--standby-workers 'foo': must be auto")):
        res = subprocess.run([HYPERPODRUN, "--nproc-per-node", "1", *flags, "train"], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and expected in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
