"""In-process restart with real processes (issue 3 acceptance): 4 gloo workers, one fault each; the healthy
ranks keep their process, only what died or hung is replaced, and the job finishes."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from conftest import HYPERPODRUN
from inprocess_helpers import FAST, Job, assert_only_replaced, entries, events_named, first, pids, records


@pytest.mark.parametrize("victim", [0, 2])
def test_sigkill_of_one_rank_replaces_only_that_rank(launcher, out_dir, victim):
    """SIGKILL of one rank mid-training (rank 0 included): the other ranks keep their PIDs, only the killed
    rank is a new process, every rank finishes generation 1, exit code 0."""
    job = Job(launcher, out_dir, FAST)
    started = job.wait_step(range(4), step=20)
    os.kill(started[victim], signal.SIGKILL)
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {victim}, info=info)
    assert pids(out_dir, victim)[0] == started[victim]
    respawns = events_named(job.log_dir, "respawn")
    assert [e["rank"] for e in respawns] == [victim], info
    assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1], info
    assert not events_named(job.log_dir, "restart_begin"), "no process-level restart expected\n" + info


def test_killed_rank_is_forked_warm_with_its_own_environment_and_logs(launcher, out_dir):
    """Once the warm spawner has done its imports, a SIGKILLed rank is forked from it: a new process in its own
    session, with the rank's environment (RANK, the new generation), writing to its own attempt's log files;
    the job finishes. HYPERPODRUN_WARM_RESPAWN=0 starts it the normal way."""
    for warm in (True, False):
        out = out_dir / ("warm" if warm else "cold")
        out.mkdir()
        job = Job(launcher, out, FAST, ["--hello-line"], log_dir=out / "logs",
                  env=None if warm else {"HYPERPODRUN_WARM_RESPAWN": "0"})
        started = job.wait_step(range(4), step=10)
        if warm:
            job.wait_event("warm_ready", timeout=60)
        os.kill(started[1], signal.SIGKILL)
        res = job.result()
        info = job.describe()
        assert res.rc == 0, info
        assert_only_replaced(out, {1}, info=info)
        respawn = events_named(job.log_dir, "respawn")
        assert [(e["rank"], e["warm"]) for e in respawn] == [(1, warm)], info
        new_pid = respawn[0]["pid"]
        assert new_pid != started[1] and pids(out, 1) == [started[1], new_pid], info
        start = [r for r in records(out, 1) if r["ev"] == "start" and r["pid"] == new_pid]
        assert start and start[0]["gen0"] == 1, info     # HYPERPODRUN_GENERATION of the respawned rank
        assert first(out, 1, "done", it=1) is not None, info
        logs = list(job.log_dir.glob("*/attempt_1/rank_1/stdout.log"))
        assert len(logs) == 1 and logs[0].read_text() == f"hello from rank 1 pid {new_pid} generation 1\n", info
        assert not events_named(job.log_dir, "restart_begin"), info


def test_exception_reenters_every_rank_in_place_and_releases_peers_fast(launcher, out_dir):
    """An exception in rank 2 at step 8: every rank re-enters with iteration 1, no process is restarted, and
    the ranks blocked in the all-reduce with it left it within a second of the raise (gloo: the raising rank
    tears its group down first). `hyperpodrun logs --events` then shows the restart's timeline. The workers
    take longer than --heartbeat-timeout to exit once released: that is not a hang (no third generation)."""
    job = Job(launcher, out_dir, FAST, ["--raise-rank", "2", "--raise-step", "8", "--exit-delay", "4"])
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, set(), info=info)
    for rank in range(4):
        pid = pids(out_dir, rank)[0]
        assert entries(out_dir, rank) == [(pid, 0), (pid, 1)], info
    assert not events_named(job.log_dir, "respawn") and not events_named(job.log_dir, "kill"), info
    assert [e["generation"] for e in events_named(job.log_dir, "restart_signal")] == [1], info

    raised = first(out_dir, 2, "raise")
    assert raised is not None and raised["step"] == 8, info
    for rank in (0, 1, 3):
        left = first(out_dir, rank, "abort", it=0)   # noted once the main thread is out of the collective
        assert left is not None, info
        assert left["t"] - raised["t"] < 1.0, f"rank {rank} left the collective {left['t'] - raised['t']:.3f}s " \
                                               f"after the raise\n{info}"

    faults = events_named(job.log_dir, "fault")
    assert len(faults) == 1 and faults[0]["rank"] == 2 and "boom at step 8" in faults[0]["root_cause"], info
    go = events_named(job.log_dir, "go")
    assert len(go) == 1 and go[0]["generation"] == 1 and 0 < go[0]["downtime_s"] < 10, info
    assert "RuntimeError" in go[0]["root_cause"] and "rank 2" in go[0]["root_cause"], info

    timeline = subprocess.run([HYPERPODRUN, "logs", str(job.log_dir), "--events"], capture_output=True,
                              text=True, timeout=30, env=launcher.env())
    assert timeline.returncode == 0, timeline.stderr
    lines = timeline.stdout.splitlines()

    def line_of(event: str) -> str:
        found = [ln for ln in lines if f" {event} " in ln]
        assert found, f"no {event} line in:\n{timeline.stdout}"
        return found[0]
    assert "boom at step 8" in line_of("fault")
    assert "generation 0 -> 1" in line_of("restart_signal")
    assert "generation=1" in line_of("barrier_complete")
    go_line = line_of("go")
    assert "downtime_s=" in go_line and "recovered in" in go_line and "boom at step 8" in go_line, go_line
    order = [next(i for i, ln in enumerate(lines) if f" {ev} " in ln)
             for ev in ("fault", "restart_signal", "barrier_complete", "go")]
    assert order == sorted(order), timeline.stdout
    assert not any(ln.lstrip().startswith("{") for ln in lines), "the timeline should be readable, not JSON"


def test_symptom_reported_before_the_real_cause_does_not_name_the_round(launcher, out_dir):
    """Rank 1 reports "connection closed by peer" (a symptom) and only then does rank 2 raise the real error:
    the fault the log names, and the GO line's root cause, are rank 2's; the symptom is folded. (The grace is
    raised so that a loaded machine cannot make rank 2 later than it.)"""
    job = Job(launcher, out_dir, FAST, ["--symptom-rank", "1", "--raise-rank", "2", "--raise-step", "6"],
              env={"HYPERPODRUN_SYMPTOM_GRACE_S": "10"})
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    symptom, raised = first(out_dir, 1, "symptom"), first(out_dir, 2, "raise")
    assert symptom is not None and raised is not None and symptom["t"] <= raised["t"], info
    faults = events_named(job.log_dir, "fault")
    assert len(faults) == 1 and faults[0]["rank"] == 2 and "boom at step 6" in faults[0]["root_cause"], info
    folded = events_named(job.log_dir, "fault_folded")
    assert 1 in [e["rank"] for e in folded], info
    go = events_named(job.log_dir, "go")
    assert len(go) == 1 and "rank 2" in go[0]["root_cause"], info
    assert_only_replaced(out_dir, set(), info=info)


def test_python_loop_hang_is_interrupted_in_process(launcher, out_dir):
    """A rank spinning in a Python loop, --progress-timeout 3: it is interrupted in-process (keeps its PID)
    and so are the ranks waiting for it; nothing is killed."""
    job = Job(launcher, out_dir, [*FAST, "--progress-timeout", "3"])
    job.inject(1, "hang", step=15)
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, set(), info=info)
    assert not events_named(job.log_dir, "kill") and not events_named(job.log_dir, "respawn"), info
    faults = events_named(job.log_dir, "fault")
    assert len(faults) == 1 and faults[0]["rank"] == 1 and "no progress" in faults[0]["root_cause"], info


def test_c_call_holding_the_gil_is_killed_and_replaced(launcher, out_dir):
    """A rank stuck in a C call that holds the GIL sends no heartbeat: after --heartbeat-timeout it is killed
    and replaced; the ranks blocked in the all-reduce waiting for it keep their PIDs."""
    job = Job(launcher, out_dir, FAST)
    job.inject(2, "hang-gil", step=15)
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {2}, info=info)
    kills = events_named(job.log_dir, "kill")
    assert [e["rank"] for e in kills] == [2] and "heartbeat" in kills[0]["msg"], info
    blocked = [first(out_dir, r, "abort", it=0) for r in (0, 1, 3)]
    assert all(blocked), info


@pytest.mark.slow
def test_c_call_without_the_gil_only_the_hung_rank_is_replaced(launcher, out_dir):
    """A rank hung inside a C call that releases the GIL (like a stuck collective) keeps heart-beating;
    --progress-timeout finds it as the rank whose collective sequence lags; only it is killed and replaced."""
    job = Job(launcher, out_dir, [*FAST, "--progress-timeout", "3"])
    job.inject(3, "hang-c", step=15)
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {3}, info=info)
    assert [e["rank"] for e in events_named(job.log_dir, "kill")] == [3], info
    faults = events_named(job.log_dir, "fault")
    assert faults and faults[0]["rank"] == 3 and "culprit rank(s) 3 " in faults[0]["root_cause"], info
