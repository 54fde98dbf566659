"""In-process restart when recovery itself goes wrong, and the guards (issue 3 acceptance): a second death
during a recovery, the same step failing again and again, a script without HPWrapper, a rank stuck in
finalize past --inprocess-timeout."""
from __future__ import annotations

import os
import signal

import pytest

from conftest import script
from inprocess_helpers import FAST, Job, assert_only_replaced, events_named, first, pids, records
from hyperpodrun.errors import EXIT_STEP_KEEPS_FAILING


def test_rank_dying_in_finalize_during_recovery_is_folded_in(launcher, out_dir):
    """Rank 1 raises; during that recovery rank 3 dies in its finalize: the death is folded into the round
    in progress (one new generation), rank 3 alone is replaced and the job finishes."""
    job = Job(launcher, out_dir, FAST, ["--raise-rank", "1", "--raise-step", "8", "--finalize-exit-rank", "3"])
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert first(out_dir, 3, "finalize_exit") is not None, info
    assert_only_replaced(out_dir, {3}, info=info)
    assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1], info
    # rank 3 may first report the collective its peer's fault broke ("connection closed"), then its death
    folded = events_named(job.log_dir, "fault_folded", rank=3)
    assert any("exit code 5" in e["msg"] for e in folded), info
    faults = events_named(job.log_dir, "fault")
    assert len(faults) == 1 and faults[0]["rank"] == 1, "one root cause per restart\n" + info


def test_slow_recovery_of_the_faulting_rank_is_not_mistaken_for_a_hang(launcher, out_dir):
    """Rank 1 raises and then spends 5 s in its finalize inside a C call that keeps the GIL (no heartbeat
    says it is recovering; the last one said "running"). Its FAULT told the agent it left the function: it is
    not killed as "stuck in a C call" once the 4 s grace for RESTART has passed; nothing is replaced."""
    hpr = ["--inprocess-restart", "--heartbeat-interval", "2", "--heartbeat-timeout", "9", "--inprocess-timeout", "16"]
    job = Job(launcher, out_dir, hpr, ["--raise-rank", "1", "--raise-step", "8", "--finalize-hold-gil-rank", "1",
                                       "--hold-gil-s", "5"])
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert first(out_dir, 1, "finalize_hold_gil") is not None, info
    assert not events_named(job.log_dir, "kill"), info
    assert_only_replaced(out_dir, set(), info=info)


@pytest.mark.slow
def test_second_kill_while_the_replacement_starts(launcher, out_dir, tmp_path):
    """SIGKILL of rank 0; while its replacement is on its way (held at a gate by the test) and the others wait
    for GO, rank 2 is killed too: both are replaced in the same round, ranks 1 and 3 keep their PIDs."""
    gate = tmp_path / "gate"
    job = Job(launcher, out_dir, FAST, ["--gate", str(gate)])
    started = job.wait_step(range(4), step=20)
    os.kill(started[0], signal.SIGKILL)
    job.wait_event("respawn", rank=0)
    for rank in (1, 2, 3):   # the survivors have recovered and wait for GO
        job.wait_event("rank_ready", rank=rank, generation=1)
    assert not events_named(job.log_dir, "go"), job.describe()
    os.kill(started[2], signal.SIGKILL)
    job.wait_event("respawn", rank=2)
    gate.touch()
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {0, 2}, info=info)
    assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1], info
    assert not events_named(job.log_dir, "restart_begin"), info


def test_same_step_failing_again_ends_the_job_with_77(launcher, out_dir):
    """Rank 1 raises at step 3 in every generation, --max-step-failures 3: after the third attempt the job
    ends with exit code 77 and a message that names the step and the exception."""
    job = Job(launcher, out_dir, [*FAST, "--max-step-failures", "3"],
              ["--raise-rank", "1", "--raise-step", "3", "--raise-always"])
    res = job.result()
    info = job.describe()
    assert res.rc == EXIT_STEP_KEEPS_FAILING == 77, info
    raised = [(r["it"], r["step"]) for r in records(out_dir, 1) if r["ev"] == "raise"]
    assert raised == [(0, 3), (1, 3), (2, 3)], info
    stop = events_named(job.log_dir, "step_keeps_failing")
    assert len(stop) == 1, info
    assert "step 3" in stop[0]["msg"] and "RuntimeError" in stop[0]["msg"] and "boom at step 3" in stop[0]["msg"], \
        stop[0]["msg"]
    said = [ln for ln in res.err.splitlines() if "step 3 failed 3 times" in ln]
    assert said and "RuntimeError: boom at step 3" in said[0], res.err[-3000:]
    assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1, 2], info
    assert not launcher.leftovers()


def test_script_without_hpwrapper_gets_a_process_level_restart_and_one_warning(launcher, out_dir):
    """A torch-free script that never says HELLO, --inprocess-restart --max-restarts 1: rank 1 fails, the
    whole node restarts (process level) and finishes; the log says why exactly once."""
    res = launcher.run(["--nproc-per-node", "4", *FAST, "--max-restarts", "1", script("behave.py"), "--out", out_dir,
                        "--fail-rank", "1", "--wait-peers", "4"], timeout=60)
    assert res.rc == 0, res
    events = events_named(launcher.log_dir, "not_wrapped")
    assert len(events) == 1, events
    warned = [ln for ln in res.err.splitlines() if "HPWrapper" in ln]
    assert len(warned) == 1, "\n".join(warned)
    assert len(events_named(launcher.log_dir, "restart_begin")) == 1
    assert not events_named(launcher.log_dir, "restart_signal"), "no in-process round without HELLO"
    done = sorted(p.name for p in out_dir.glob("done_*.json"))
    assert done == [f"done_1_{r}.json" for r in range(4)], done


@pytest.mark.slow
def test_rank_stuck_in_finalize_escalates_to_process_restart(launcher, out_dir):
    """Rank 1 raises; rank 2 never leaves its finalize: after --inprocess-timeout 5 the node escalates to a
    process-level restart that sends --shutdown-signal SIGUSR1 (rank 2 ignores it, the others die of it),
    SIGKILLs after --shutdown-timeout 2, and restarts every rank; the job finishes."""
    hpr = ["--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--inprocess-timeout", "5",
           "--max-restarts", "1", "--shutdown-signal", "SIGUSR1", "--shutdown-timeout", "2"]
    job = Job(launcher, out_dir, hpr, ["--raise-rank", "1", "--raise-step", "5", "--finalize-hang-rank", "2",
                                       "--usr1-log-rank", "2"])
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    ev = {name: events_named(job.log_dir, name) for name in
          ("fault", "inprocess_timeout", "restart_begin", "shutdown_timeout", "workers_stopped", "worker_exit")}
    for name in ("fault", "inprocess_timeout", "restart_begin", "shutdown_timeout", "workers_stopped"):
        assert len(ev[name]) == 1, f"{name}: {ev[name]}\n{info}"
    assert ev["fault"][0]["rank"] == 1, info
    waited = ev["inprocess_timeout"][0]["ts"] - ev["fault"][0]["ts"]
    assert 4.8 <= waited < 5 + 5, f"escalated {waited:.2f}s after the fault\n{info}"
    assert "SIGUSR1" in ev["restart_begin"][0]["msg"], info
    # the shutdown signal reached the stuck rank, which ignored it; SIGKILL came after --shutdown-timeout
    hung = first(out_dir, 2, "finalize_hang")
    usr1 = first(out_dir, 2, "sigusr1")
    assert hung is not None and usr1 is not None, info
    assert usr1["t"] >= ev["restart_begin"][0]["ts"] - 0.05, info
    stopped = ev["workers_stopped"][0]["duration_s"]
    assert 1.9 <= stopped < 2 + 3, f"workers stopped in {stopped:.2f}s with --shutdown-timeout 2\n{info}"
    first_gen = {e["rank"]: e["exit_code"] for e in ev["worker_exit"] if e["generation"] == 0}
    assert first_gen == {0: -signal.SIGUSR1, 1: -signal.SIGUSR1, 2: -signal.SIGKILL, 3: -signal.SIGUSR1}, info
    # a process-level restart: every rank is a new process, all in the next generation
    for rank in range(4):
        assert len(pids(out_dir, rank)) == 2, info
        assert [r["it"] for r in records(out_dir, rank) if r["ev"] == "done"] == [2], info
