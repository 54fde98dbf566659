"""Process supervision with real processes: kill -9 of the agent, SIGTERM, failures, restarts (issue 2)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import (HYPERPODRUN, count_files, describe_pids, is_alive, read_events, read_markers, script,
                      session_members, the_run_dir, wait_until, write_script)

BEHAVE = script("behave.py")


def _ready(out_dir, n, gen=0):
    return lambda: count_files(out_dir, f"ready_{gen}_*.json") >= n


def test_kill9_of_agent_leaves_no_worker_or_dataloader_worker(launcher, out_dir):
    """kill -9 of hyperpodrun while workers run DataLoaders with worker processes: their sessions are
    empty 2 s later (workers, DataLoader workers, and a grandchild that left the process group)."""
    proc = launcher.start(["--nproc-per-node", "2", script("dataloader.py"), out_dir])
    wait_until(lambda: count_files(out_dir, "ready_*.json") == 2 or proc.popen.poll() is not None, 60,
               message="workers running their DataLoaders")
    assert proc.popen.poll() is None, f"hyperpodrun ended early:\n{proc.err()}"
    ready = read_markers(out_dir, "ready_*.json")
    sids = set()
    for r in ready:
        assert r["sid"] == r["pid"], "each worker must lead its own session"
        sids.add(r["sid"])
        members = set(session_members({r["sid"]}))
        # the worker, its 2 DataLoader workers and the `sleep` grandchild are all in the worker's session
        assert {r["pid"], r["grandchild"], *r["loader_pids"]} <= members, describe_pids(members)
    assert len(session_members(sids)) >= 8

    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert proc.popen.wait(5) == -signal.SIGKILL
    try:
        wait_until(lambda: not session_members(sids), 2.0)
    except AssertionError:
        raise AssertionError("processes of the workers' sessions still alive "
                             f"{time.monotonic() - killed_at:.1f}s after kill -9 of the agent:\n"
                             + describe_pids(session_members(sids)))
    # nothing else the job started (the reaper included) stays behind either
    wait_until(lambda: not launcher.leftovers(), 3.0, message="every process of the job gone")


def test_sigterm_forwarded_then_sigkill_after_shutdown_timeout(launcher, out_dir):
    """SIGTERM to hyperpodrun whose workers ignore SIGTERM, --shutdown-timeout 2: every worker gets the
    SIGTERM (so it could save), everything is gone within 3 s, exit code 143."""
    proc = launcher.start(["--nproc-per-node", "4", "--shutdown-timeout", "2", BEHAVE, "--out", out_dir,
                           "--hold", "--term", "log", "--grandchild"])
    wait_until(lambda: _ready(out_dir, 4)() or proc.popen.poll() is not None, 30, message="4 workers ready")
    assert proc.popen.poll() is None, f"hyperpodrun ended early:\n{proc.err()}"
    ready = read_markers(out_dir, "ready_0_*.json")
    sids = {r["sid"] for r in ready}

    os.kill(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    try:
        rc = proc.popen.wait(timeout=3.0)
    except Exception:
        raise AssertionError(f"hyperpodrun still running 3 s after SIGTERM:\n{proc.err()}")
    took = time.monotonic() - sent
    left = session_members(sids) + launcher.leftovers()
    assert not left, f"alive {took:.1f}s after SIGTERM:\n{describe_pids(left)}"
    assert rc == 143, f"exit code {rc}, expected 128+SIGTERM\n{proc.err()}"
    # the signal reached every worker; SIGKILL came only after the shutdown timeout
    wait_until(lambda: count_files(out_dir, "term_0_*") == 4, 1.0, message="every worker received SIGTERM")
    assert took >= 1.5, f"workers were killed after {took:.2f}s, before --shutdown-timeout 2"
    assert "Traceback" not in proc.err()


def test_shutdown_is_logged_with_its_duration(launcher, out_dir):
    """The event log records a signal-initiated shutdown with its duration, as it does for a restart."""
    proc = launcher.start(["--nproc-per-node", "2", BEHAVE, "--out", out_dir, "--hold"])
    wait_until(lambda: _ready(out_dir, 2)() or proc.popen.poll() is not None, 30, message="2 workers ready")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(10).rc == 143
    events = read_events(launcher.log_dir)
    kinds = [e["event"] for e in events]
    after_signal = events[kinds.index("signal"):]
    assert [e for e in after_signal if "duration_s" in e], kinds


@pytest.mark.parametrize("how, code, cause", [
    ("exit", 7, "exit code 7"),
    ("signal", 128 + signal.SIGKILL, "SIGKILL"),
])
def test_failing_worker_sets_exit_code_and_is_named(launcher, out_dir, how, code, cause):
    """A worker that exits 7 (or dies by SIGKILL) with --max-restarts 0: hyperpodrun exits with that code
    (a signal death as 128+N) and stderr names the rank and the cause."""
    fail = ["--fail-code", "7"] if how == "exit" else ["--fail-signal", str(int(signal.SIGKILL))]
    res = launcher.run(["--nproc-per-node", "4", "--max-restarts", "0", BEHAVE, "--out", out_dir,
                        "--fail-rank", "2", "--wait-peers", "4", *fail], timeout=30)
    assert res.rc == code, res
    failure_lines = [ln for ln in res.err.splitlines() if "rank 2" in ln and cause in ln]
    assert failure_lines, f"stderr does not name rank 2 and {cause!r}:\n{res}"
    assert "Traceback" not in res.err
    assert not launcher.leftovers()
    events = read_events(launcher.log_dir)
    faults = [e for e in events if e["event"] == "fault"]
    assert [f["rank"] for f in faults] == [2], faults
    assert not [e for e in events if e["event"] == "restart_begin"], "no restart with --max-restarts 0"


def test_worker_traceback_from_record_error_file_is_reported(launcher, tmp_path):
    """A worker decorated with torch's @record: the failure report carries its traceback."""
    path = tmp_path / "boom.py"
    path.write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise ValueError('boom-7f3a from the worker')\n"
        "main()\n")
    res = launcher.run(["--nproc-per-node", "1", path], timeout=30)
    assert res.rc == 1, res
    assert "rank 0" in res.err and "exit code 1" in res.err, res
    assert "worker traceback" in res.err, res
    report = res.err[res.err.index("worker traceback"):]
    assert "ValueError: boom-7f3a from the worker" in report, res


def test_restart_honours_shutdown_timeout(launcher, out_dir):
    """--max-restarts 3, one worker fails once while its peers ignore SIGTERM, --shutdown-timeout 2: the job
    finishes after one restart that costs about the shutdown timeout (2 s), not torchrun's 30 s."""
    res = launcher.run(["--nproc-per-node", "4", "--max-restarts", "3", "--shutdown-timeout", "2", BEHAVE,
                        "--out", out_dir, "--fail-rank", "1", "--wait-peers", "4", "--term", "ignore"], timeout=40)
    assert res.rc == 0, res
    assert res.seconds < 15, f"job took {res.seconds:.1f}s\n{res}"
    done = read_markers(out_dir, "done_*.json")
    assert sorted((d["gen"], d["rank"]) for d in done) == [(1, r) for r in range(4)], done
    events = read_events(launcher.log_dir)
    assert len([e for e in events if e["event"] == "restart_begin"]) == 1, events
    stopped = [e for e in events if e["event"] == "workers_stopped"]
    assert len(stopped) == 1, events
    # peers ignored SIGTERM, so they were SIGKILLed once the 2 s shutdown timeout passed
    assert 1.5 <= stopped[0]["duration_s"] < 10, stopped
    assert [e for e in events if e["event"] == "shutdown_timeout"], "expected a SIGKILL after the timeout"
    assert not launcher.leftovers()


@pytest.mark.slow
def test_twenty_restarts_each_reform_the_gloo_group(launcher, out_dir):
    """20 process-level restarts in a row: every generation re-forms the gloo group and all-reduces
    correctly, and no grandchild of any attempt is alive when the job ends."""
    n = 20
    res = launcher.run(["--nproc-per-node", "2", "--max-restarts", str(n), "--shutdown-timeout", "2",
                        script("regroup.py"), out_dir, str(n)], timeout=280)
    assert res.rc == 0, res
    missing = [(g, r) for g in range(n + 1) for r in range(2) if not (out_dir / f"ok_{g}_{r}").exists()]
    assert not missing, f"generations without a correct all-reduce: {missing}\n{res}"
    events = read_events(launcher.log_dir)
    assert len([e for e in events if e["event"] == "restart_begin"]) == n
    run_dir = the_run_dir(launcher.log_dir)
    assert sorted(int(p.name.split("_")[1]) for p in run_dir.glob("attempt_*")) == list(range(n + 1))
    grandchildren = [int((out_dir / f"gc_{g}_{r}").read_text()) for g in range(n + 1) for r in range(2)]
    alive = [pid for pid in grandchildren if is_alive(pid)]
    assert not alive, describe_pids(alive)
    assert not launcher.leftovers(), describe_pids(launcher.leftovers())


def test_restart_budget_is_exhausted(launcher, out_dir):
    """A rank that keeps failing: --max-restarts 1 allows one restart, then the job fails with its code."""
    res = launcher.run(["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "2", BEHAVE,
                        "--out", out_dir, "--fail-rank", "0", "--fail-code", "5", "--fail-until", "99",
                        "--wait-peers", "2"], timeout=30)
    assert res.rc == 5, res
    assert count_files(out_dir, "ready_1_*.json") == 2 and count_files(out_dir, "ready_2_*.json") == 0, res
    assert "rank 0" in res.err and "exit code 5" in res.err
    assert not launcher.leftovers()


ORPHAN = """
import os, sys, time
out = sys.argv[1]
r, w = os.pipe()
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(0.3)          # by now its parent is gone: it was re-parented to the agent
        os._exit(0)
    os.write(w, str(grandchild).encode())
    os._exit(0)
os.waitpid(child, 0)
grandchild = int(os.read(r, 64))
state = "?"
end = time.monotonic() + 10
while time.monotonic() < end:
    try:
        with open(f"/proc/{grandchild}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "reaped"
        break
    time.sleep(0.02)
open(os.path.join(out, "orphan"), "w").write(state)
"""


def test_reparented_orphans_are_reaped(launcher, tmp_path, out_dir):
    """A worker's grandchild whose parent exited is re-parented to the agent (a subreaper, as PID 1 would be)
    and reaped when it exits: no zombie accumulates."""
    orphan = write_script(tmp_path, "orphan.py", ORPHAN)
    res = launcher.run(["--nproc-per-node", "1", orphan, out_dir], timeout=30)
    assert res.rc == 0, res
    assert (out_dir / "orphan").read_text() == "reaped", "the orphan stayed a zombie"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_sigterm_as_pid1_of_a_container(launcher, tmp_path, out_dir):
    """hyperpodrun as PID 1 of its own PID namespace (a container's entrypoint): SIGTERM from outside is
    forwarded, SIGKILL follows after --shutdown-timeout, exit code 143."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {probe.stderr.decode().strip()}")
    proc = launcher.start(["--log-dir", launcher.log_dir, "--nproc-per-node", "2", "--shutdown-timeout", "2", BEHAVE,
                           "--out", out_dir, "--hold", "--term", "log"],
                          cmd=["unshare", "--pid", "--fork", "--mount-proc", HYPERPODRUN])
    wait_until(lambda: _ready(out_dir, 2)() or proc.popen.poll() is not None, 30, message="2 workers ready")
    assert proc.popen.poll() is None, proc.err()
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
        (agent,) = [int(x) for x in fh.read().split()]
    assert "hyperpodrun" in open(f"/proc/{agent}/cmdline").read()
    with open(f"/proc/{agent}/status") as fh:
        nspid = [line.split()[1:] for line in fh if line.startswith("NSpid:")][0]
    assert nspid[-1] == "1", f"hyperpodrun is not PID 1 in its namespace: NSpid {nspid}"
    os.kill(agent, signal.SIGTERM)
    res = proc.wait(6)
    assert res.rc == 143, res
    assert count_files(out_dir, "term_0_*") == 2, "SIGTERM not forwarded to the workers"
    assert not launcher.leftovers(), describe_pids(launcher.leftovers())


# ------------------------------------------------------------------------------------------ root cause
_PEER_ABORTS_FIRST = r'''
import os, sys, time
rank, out = int(os.environ["RANK"]), sys.argv[1]

def wait_for(pred, what):
    end = time.monotonic() + 30
    while not pred():
        if time.monotonic() > end:
            sys.exit(f"rank {rank}: timed out waiting for {what}")
        time.sleep(0.005)

def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None   # reaped

open(os.path.join(out, f"pid_{rank}"), "w").write(str(os.getpid()))
if rank == 0:
    # sees its peer's connection close, says so on stderr and aborts, as gloo's teardown does
    wait_for(lambda: os.path.exists(os.path.join(out, "closing")), "rank 1 closing")
    print("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242",
          file=sys.stderr, flush=True)
    os.abort()
else:
    # the real failure: its exit comes only after the peer's abort has been reaped by the agent
    wait_for(lambda: os.path.exists(os.path.join(out, "pid_0")), "rank 0's pid")
    peer = int(open(os.path.join(out, "pid_0")).read())
    open(os.path.join(out, "closing"), "w").close()
    print("rank 1 failing for real with code 3", file=sys.stderr, flush=True)
    wait_for(lambda: state(peer) is None, "rank 0 reaped")
    sys.exit(3)
'''


def test_first_real_failure_is_named_when_a_peer_aborts_first(launcher, tmp_path, out_dir):
    """Rank 1 fails (exit code 3), its peer dies of SIGABRT with "Connection closed by peer" on stderr, and
    the peer's exit is reaped before rank 1's: the fault, the failure summary and the exit code are rank 1's."""
    path = write_script(tmp_path, "peer_aborts_first.py", _PEER_ABORTS_FIRST)
    res = launcher.run(["--nproc-per-node", "2", "--max-restarts", "0", "--shutdown-timeout", "5", path, out_dir],
                       timeout=60)
    events = read_events(launcher.log_dir)
    exits = [(e["rank"], e["exit_code"]) for e in events if e["event"] == "worker_exit"]
    assert exits[:1] == [(0, -signal.SIGABRT)], f"the race did not happen as staged: {exits}\n{res}"
    faults = [e for e in events if e["event"] == "fault"]
    assert [(f["rank"], f["exit_code"]) for f in faults] == [(1, 3)], faults
    assert exits == [(0, -signal.SIGABRT), (1, 3)], exits
    assert "rank 0 SIGABRT" in faults[0]["msg"], faults[0]
    assert res.rc == 3, res
    failed = [e for e in events if e["event"] == "job_failed"]
    assert failed and failed[0]["msg"].startswith("rank 1 "), failed


def test_a_lone_symptom_is_still_the_cause_after_the_grace(launcher, tmp_path, out_dir):
    """A rank that aborts with a peer-failure symptom while no other rank fails: after the short grace
    (HYPERPODRUN_EXIT_GRACE_S) it is the cause, and the job restarts."""
    path = write_script(tmp_path, "lone_symptom.py", """
        import os, sys
        gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if gen == 0 and os.environ["RANK"] == "1":
            print("RuntimeError: Connection reset by peer", file=sys.stderr, flush=True)
            os.abort()
    """)
    res = launcher.run(["--nproc-per-node", "2", "--max-restarts", "1", path], timeout=60,
                       env={"HYPERPODRUN_EXIT_GRACE_S": "0.5"})
    assert res.rc == 0, res
    events = read_events(launcher.log_dir)
    faults = [e for e in events if e["event"] == "fault"]
    assert [(f["rank"], f["exit_code"]) for f in faults] == [(1, 128 + signal.SIGABRT)], faults
    waited = faults[0]["ts"] - next(e["ts"] for e in events if e["event"] == "worker_exit" and e["rank"] == 1)
    assert 0.4 <= waited < 5, f"the cause waited {waited:.2f}s for a real failure (grace 0.5 s)"


def test_cause_window_prefers_the_first_real_failure():
    """Unit: a symptom waits for a real failure (which ends the wait at once), else it is the cause."""
    from hyperpodrun.agent.observe.report import CauseWindow, exit_is_symptom
    from hyperpodrun.agent.coordination.store_schema import FailureInfo as F
    window = CauseWindow(2.0)
    assert window.add(F(rank=0, cause="SIGABRT (6)", symptom=True), now=0.0) is None and window.open
    assert window.due(1.9) is None
    cause = window.add(F(rank=1, cause="exit code 3", symptom=False), now=1.0)
    assert cause is not None and cause.rank == 1 and cause.folded == ("rank 0 SIGABRT (6)",)
    assert not window.open
    assert window.add(F(rank=2, cause="exit code 1", symptom=True), now=5.0) is None
    assert window.due(7.0).rank == 2
    assert CauseWindow(0).add(F(rank=3, symptom=True), now=0.0).rank == 3   # no grace: at once
    assert exit_is_symptom(1, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert not exit_is_symptom(3, "ValueError: the real bug")
    assert exit_is_symptom(-signal.SIGABRT, None) and not exit_is_symptom(-signal.SIGSEGV, None)
