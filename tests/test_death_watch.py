"""A worker is declared dead when its death begins, not when its teardown ends (agent/workers/death_watch.py).

A GPU worker's teardown (unmapping pinned memory, the driver destroying its CUDA context) takes 0.5-1 s
before the kernel reports the exit. Here the teardown is held as long as the test likes (tests/dying.py:
ptrace's exit stop), with real processes: the supervisor must report the failure while the process is still
held, reap it once it really ends, and an in-process job must replace the rank and train on meanwhile.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from dying import HeldDeath
from hyperpodrun.agent.workers.supervisor import Reaper, Supervisor
from test_checkpoint import WORKER, assert_same, events, launch, reference  # noqa: F401 (fixture)
from test_standby import STANDBY, wait_for

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


@pytest.fixture
def sup():
    s = Supervisor(Reaper())
    yield s
    for p in s.live():
        os.killpg(p.pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while s.live() and time.monotonic() < end:
        s.poll_exits()
        time.sleep(0.01)
    s.close()
    s.reaper.close()


def started(proc) -> bool:
    """The child runs its own program (not still between fork and exec)."""
    try:
        return os.readlink(f"/proc/{proc.pid}/exe") == os.path.realpath(sys.executable)
    except OSError:
        return False


def test_a_failure_is_reported_while_the_dying_process_is_held_and_reaped_when_it_ends(sup):
    woken = threading.Event()
    sup.watch_deaths(woken.set)
    proc = sup.spawn(0, 0, 0, SLEEPER, dict(os.environ), None, None)
    wait_for(lambda: started(proc), 30, "the worker to start")
    held = HeldDeath(proc.pid)
    try:
        assert woken.wait(10), "the death watch did not wake its loop"
        done = wait_for(lambda: sup.poll_exits(), 10, "the failure to be reported")
        assert done == [proc] and proc.returncode == -signal.SIGALRM
        assert held.state() == "t", "the process should still be held in its exit"
        assert proc in sup.live(), "a dying process is still running: stops must wait for it"
        assert sup.poll_exits() == [], "reported once"
    finally:
        held.release()
    wait_for(lambda: sup.poll_exits() == [] and not sup.live(), 30, "the reap")
    assert not os.path.exists(f"/proc/{proc.pid}"), "reaped"


def test_without_the_death_watch_the_same_death_is_seen_only_when_it_ends(sup):
    proc = sup.spawn(0, 0, 0, SLEEPER, dict(os.environ), None, None)
    wait_for(lambda: started(proc), 30, "the worker to start")
    held = HeldDeath(proc.pid)
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:   # a bounded look, not a wait: nothing may be reported while held
            assert sup.poll_exits() == []
            time.sleep(0.02)
    finally:
        held.release()
    assert wait_for(lambda: sup.poll_exits(), 30, "the exit") == [proc]
    assert proc.returncode == -signal.SIGALRM


@pytest.mark.slow
@pytest.mark.parametrize("flags", [STANDBY, ("--standby-workers", "0")], ids=["standby", "respawn"])
def test_a_job_replaces_a_rank_and_trains_on_while_the_dead_rank_is_still_tearing_down(tmp_path, reference, flags):
    victim = 1
    box: dict = {}

    def drive() -> None:
        try:
            park = tmp_path / "held" / f"park.{victim}"
            pid = int(wait_for(lambda: park.exists() and park.read_text(), 120, "the victim to park"))
            held = HeldDeath(pid)
            try:
                def replacement_trained() -> bool:
                    try:
                        step, gen, who = (tmp_path / "held" / f"progress.rank{victim}").read_text().split()[:3]
                    except (OSError, ValueError):
                        return False
                    return int(gen) >= 1 and int(who) != pid
                wait_for(replacement_trained, 90, "the replacement to train a step while the victim is held")
                box["state_then"] = held.state()
            finally:
                held.release()
        except BaseException as exc:   # reported by the test thread
            box["error"] = exc
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    rc, out, err = launch(tmp_path, "held", WORKER, {"MODE": "ddp", "FAULTS": f"park:{victim}:4:top", "STEPS": "10",
                                                     "DIM": "64", "PAUSE_AT": "4", "STEP_SLEEP": "0.02"},
                          flags=flags)
    driver.join(30)
    if "error" in box:
        raise AssertionError(f"{box['error']}\n{err[-3000:]}")
    assert box.get("state_then") == "t", box
    assert rc == 0, err[-3000:]
    exits = [e for e in events(tmp_path, "held") if e["event"] == "worker_exit" and e["rank"] == victim]
    assert exits and exits[0]["exit_code"] == -signal.SIGALRM, exits
    assert_same(reference("ddp"), out)   # bitwise the fault-free run
