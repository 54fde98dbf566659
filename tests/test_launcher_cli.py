"""The command line: usage errors, version, spellings, PET_* defaults, log routing, `logs`, pre/post scripts."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

import hyperpodrun
from conftest import (count_files, describe_pids, is_alive, read_events, read_markers, script, the_run_dir,
                      wait_until)

BEHAVE = script("behave.py")


# ------------------------------------------------------------------------------------------ usage errors
def _assert_usage_error(res, *needles):
    """Exit 2, a short message that names what is wrong, no traceback, nothing on stdout."""
    assert res.rc == 2, res
    assert "Traceback" not in res.err, res
    assert res.out == "", res
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 4, f"not a short message:\n{res.err}"
    error = lines[-1]
    assert error.startswith("Error: "), res.err
    assert len(error) < 250, f"message too long: {error}"
    for needle in needles:
        assert needle in error, f"{needle!r} not in {error!r}"


BAD_FLAGS = [
    (["--nnodes", "abc"], ["--nnodes"]),
    (["--nnodes", "0"], ["--nnodes"]),
    (["--nnodes", "2:1"], ["--nnodes"]),
    (["--nproc-per-node", "abc"], ["--nproc-per-node"]),
    (["--nproc-per-node", "0"], ["--nproc-per-node"]),
    (["--max-restarts", "-1"], ["--max-restarts"]),
    (["--max-restarts", "x"], ["--max-restarts"]),
    (["--monitor-interval", "0"], ["--monitor-interval"]),
    (["--node-rank", "-1"], ["--node-rank"]),
    (["--node-rank", "1"], ["--node-rank"]),
    (["--nnodes", "2", "--node-rank", "2"], ["--node-rank"]),
    (["--master-port", "70000"], ["--master-port"]),
    (["--master-port", "http"], ["--master-port"]),
    (["--nnodes", "2", "--master-port", "0"], ["--master-port"]),
    (["--shutdown-timeout", "-1"], ["--shutdown-timeout"]),
    (["--shutdown-timeout", "soon"], ["--shutdown-timeout"]),
    (["--shutdown-signal", "SIGFOO"], ["--shutdown-signal"]),
    (["--shutdown-signal", "999"], ["--shutdown-signal"]),
    (["--signals-to-handle", "SIGTERM,BOGUS"], ["--signals-to-handle"]),
    (["-r", "5"], ["--redirects"]),
    (["--redirects", "0:9"], ["--redirects"]),
    (["-t", "x"], ["--tee"]),
    (["-t", "7:3"], ["--tee", "7"]),
    (["--local-ranks-filter", "x"], ["--local-ranks-filter"]),
    (["--local-ranks-filter", "4"], ["--local-ranks-filter"]),
    (["--rdzv-conf", "join_timeout"], ["--rdzv-conf"]),
    (["--rdzv-conf", "join_timeout=abc"], ["--rdzv-conf", "join_timeout"]),
    (["--rdzv-conf", "join_timeout=-5"], ["--rdzv-conf", "join_timeout"]),
    (["--rdzv-backend", "c10d"], ["--rdzv-endpoint"]),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:abc"], ["--rdzv-endpoint"]),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"], ["--rdzv-endpoint"]),
    (["--standalone", "--nnodes", "2"], ["--standalone"]),
    (["--start-method", "bogus"], ["--start-method"]),
    (["--event-log-handler", "syslog"], ["--event-log-handler"]),
    (["--inprocess-timeout", "0"], ["--inprocess-timeout"]),
    (["--heartbeat-interval", "0"], ["--heartbeat-interval"]),
    (["--max-step-failures", "0"], ["--max-step-failures"]),
    (["--inprocess-restart", "--standby-workers", "foo"], ["--standby-workers 'foo'", "auto", "0 turns them off"]),
    (["--inprocess-restart", "--standby-workers", "-1"], ["--standby-workers '-1'", "from 0 to 8"]),
    (["--inprocess-restart", "--standby-workers", "9"], ["--standby-workers '9'", "from 0 to 8"]),
    (["--progress-timeout", "0"], ["--progress-timeout"]),
    (["--inprocess-restart", "--heartbeat-interval", "5", "--heartbeat-timeout", "2"], ["--heartbeat-interval"]),
    (["--pre-train-script", "no-such-hook.sh"], ["--pre-train-script"]),
    (["--post-train-script", "no-such-hook.sh"], ["--post-train-script"]),
    (["--pre-train-args", "'unclosed"], ["--pre-train-args"]),
    (["--post-train-args", "a \"b"], ["--post-train-args"]),
    # refused: conflicting, unsupported, elastic, unknown backend, unknown flag
    (["--no-python", "-m"], ["--no-python", "--module"]),
    (["--numa-binding", "bogus"], ["--numa-binding", "'bogus' is not one of"]),
    (["--logs-specs", "my_specs"], ["--logs-specs 'my_specs'", "accepted: default"]),
    (["--nnodes", "1:2"], ["--nnodes 1:2", "c10d"]),
    (["--rdzv-backend", "etcd-v2"], ["--rdzv-backend", "etcd-v2", "not supported"]),
    (["--no-such-flag"], ["--no-such-flag"]),
]


@pytest.mark.parametrize("flags, needles", BAD_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_flag_is_a_short_usage_error(launcher, tmp_path, flags, needles):
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    _assert_usage_error(launcher.run([*flags, ok], timeout=30), *needles)


@pytest.mark.parametrize("env, needles", [
    ({"PET_NPROC_PER_NODE": "many"}, ["--nproc-per-node"]),
    ({"PET_NNODES": "x"}, ["--nnodes"]),
    ({"PET_MAX_RESTARTS": "-3"}, ["--max-restarts"]),
    ({"HYPERPODRUN_SHUTDOWN_SIGNAL": "SIGNOPE"}, ["--shutdown-signal"]),
    ({"HYPERPODRUN_STANDBY_WORKERS": "many"}, ["--standby-workers", "HYPERPODRUN_STANDBY_WORKERS"]),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "later"}, ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_bad_environment_default_is_a_short_usage_error(launcher, tmp_path, env, needles):
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    _assert_usage_error(launcher.run([ok], env=env, timeout=30), *needles)


def test_a_bad_standby_count_is_exactly_one_line(launcher, tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    res = launcher.run(["--inprocess-restart", "--standby-workers", "foo", ok], timeout=30)
    _assert_usage_error(res, "--standby-workers 'foo': must be auto, or a whole number")
    assert len(res.err.strip().splitlines()) == 1, res.err


def test_standby_workers_auto_is_the_default_and_never_fails_a_launch(launcher, tmp_path):
    """`auto` parses, says at start what it chose (here no GPU is visible: off), and resolves to 0 silently
    where standbys cannot run (-m, no --inprocess-restart) instead of the error an explicit number gives."""
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    res = launcher.run(["--inprocess-restart", "--standby-workers", "auto", ok], env=hidden, timeout=60)
    assert res.rc == 0, res
    assert "standby workers: off (auto: CUDA_VISIBLE_DEVICES='' hides every GPU" in res.err, res.err
    res = launcher.run(["--inprocess-restart", "--standby-workers", "0", ok], timeout=60)
    assert res.rc == 0 and "standby workers: off (--standby-workers 0)" in res.err, res
    (tmp_path / "hpr_auto_mod.py").write_text("pass\n")
    for flags in (["--inprocess-restart", "-m", "hpr_auto_mod"], [ok]):
        res = launcher.run(flags, env=hidden, cwd=tmp_path, timeout=60)
        assert res.rc == 0, res


def test_missing_script(launcher, tmp_path):
    _assert_usage_error(launcher.run([tmp_path / "nope.py"], timeout=30), "nope.py", "does not exist")


def test_missing_program_with_no_python(launcher, tmp_path):
    _assert_usage_error(launcher.run(["--no-python", "no-such-program-3f9a"], timeout=30), "no-such-program-3f9a")


def test_no_script_at_all(launcher):
    res = launcher.run([], timeout=30)
    assert res.rc == 2 and "Traceback" not in res.err and "TRAINING_SCRIPT" in res.err, res


def test_unwritable_log_dir(launcher, tmp_path):
    """A --log-dir that cannot be created (a path under a regular file)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ok = tmp_path / "ok.py"
    ok.write_text("pass\n")
    res = launcher.run([ok], log_dir=blocker / "logs", timeout=30)
    _assert_usage_error(res, "--log-dir", str(blocker / "logs"))


# ------------------------------------------------------------------------------------------ version, help
def test_version(launcher):
    res = launcher.run(["--version"], log_dir=False, timeout=30)
    assert res.rc == 0, res
    assert res.out.strip() == f"hyperpodrun, version {hyperpodrun.__version__}"


def test_python_dash_m_version(launcher):
    res = launcher.run(["-m", "hyperpodrun", "--version"], cmd=[sys.executable], timeout=30)
    assert res.rc == 0, res
    assert res.out.strip() == f"hyperpodrun, version {hyperpodrun.__version__}"


def test_help_lists_torchrun_flags_and_ours(launcher):
    res = launcher.run(["--help"], log_dir=False, timeout=30)
    assert res.rc == 0, res
    for flag in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--max-restarts", "--shutdown-timeout",
                 "--shutdown-signal", "--local-ranks-filter", "--pre-train-script"):
        assert flag in res.out, flag
    # refused values of torchrun flags are listed after the options
    options, refused = res.out.split("Refused torchrun flags", 1)
    assert "--numa-binding" in options and "--rdzv-backend other than static" in refused


# ------------------------------------------------------------------------------------------ spellings, env
def _world(out_dir):
    ready = read_markers(out_dir, "ready_0_*.json")
    return sorted(int(r["env"]["WORLD_SIZE"]) for r in ready), sorted(r["rank"] for r in ready)


def test_pet_nproc_per_node_is_the_default(launcher, out_dir):
    res = launcher.run([BEHAVE, "--out", out_dir], env={"PET_NPROC_PER_NODE": "3"}, timeout=30)
    assert res.rc == 0, res
    assert _world(out_dir) == ([3, 3, 3], [0, 1, 2])


def test_flag_beats_pet_environment(launcher, out_dir):
    res = launcher.run(["--nproc-per-node", "2", BEHAVE, "--out", out_dir], env={"PET_NPROC_PER_NODE": "3"},
                       timeout=30)
    assert res.rc == 0, res
    assert _world(out_dir) == ([2, 2], [0, 1])


def test_underscore_spellings(launcher, tmp_path, out_dir):
    """torchrun's old spellings: --nproc_per_node, --max_restarts, --log_dir, --local_ranks_filter."""
    log_dir = tmp_path / "underscored"
    res = launcher.run(["--nproc_per_node", "2", "--max_restarts", "1", "--log_dir", log_dir,
                        "--local_ranks_filter", "1", "--shutdown_timeout", "3",
                        BEHAVE, "--out", out_dir, "--fail-rank", "0", "--wait-peers", "2"],
                       log_dir=False, timeout=30)
    assert res.rc == 0, res
    assert sorted((d["gen"], d["rank"]) for d in read_markers(out_dir, "done_*.json")) == [(1, 0), (1, 1)]
    assert the_run_dir(log_dir)
    assert "out from rank 1" in res.out and "out from rank 0" not in res.out, res


def test_module_and_no_python_entrypoints(launcher, tmp_path, out_dir):
    """-m runs `python -m MODULE`, --no-python runs the program itself (torchrun's rules)."""
    (tmp_path / "hpr_probe_mod.py").write_text(
        "import os, sys\nopen(os.path.join(sys.argv[1], 'mod_' + os.environ['RANK']), 'w').write(__name__)\n")
    res = launcher.run(["--nproc-per-node", "2", "-m", "hpr_probe_mod", out_dir], timeout=30)
    assert res.rc == 0, res
    assert [(out_dir / f"mod_{r}").read_text() for r in (0, 1)] == ["__main__", "__main__"]
    res = launcher.run(["--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "$RANK" > "$0/sh_$RANK"', out_dir],
                       timeout=30)
    assert res.rc == 0, res
    assert [(out_dir / f"sh_{r}").read_text() for r in (0, 1)] == ["0\n", "1\n"]


# ------------------------------------------------------------------------------------------ console vs files
def _console_lines(text, what):
    """Worker lines ('out from rank R gen G') on the console -> {rank: prefixed?}."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"(\[[^\]]+:(\d+)\]: )?{what} from rank (\d+) gen 0", line)
        if m:
            assert m.group(2) in (None, m.group(3)), line
            found[int(m.group(3))] = m.group(1) is not None
    return found


def _file_ranks(log_dir, stream):
    run = the_run_dir(log_dir)
    ranks = {}
    for path in sorted((run / "attempt_0").glob(f"rank_*/{stream}.log")):
        ranks[int(path.parent.name[5:])] = path.read_text()
    return ranks


@pytest.mark.parametrize("flags, console_out, console_err, files_out, files_err", [
    # default: every rank in its files and, prefixed, on the console
    ([], {0: True, 1: True}, {0: True, 1: True}, [0, 1], [0, 1]),
    # tee rank 0 (files + prefixed console); rank 1 untouched: straight to the console, no files
    (["-t", "0:3,1:0"], {0: True, 1: False}, {0: True, 1: False}, [0], [0]),
    # redirect rank 0's stdout to its file only; everything else straight to the console
    (["-r", "0:1"], {1: False}, {0: False, 1: False}, [0], []),
    # redirect everything: nothing on the console
    (["-r", "3"], {}, {}, [0, 1], [0, 1]),
    # tee stdout only
    (["--tee", "1"], {0: True, 1: True}, {0: False, 1: False}, [0, 1], []),
    # the filter hides ranks from the console; their files are still written
    (["--local-ranks-filter", "1"], {1: True}, {1: True}, [0, 1], [0, 1]),
    (["-t", "3", "--local-ranks-filter", "0"], {0: True}, {0: True}, [0, 1], [0, 1]),
], ids=["default", "tee-map", "redirect-map", "redirect-all", "tee-stdout", "filter", "tee-filter"])
def test_console_and_files(launcher, out_dir, flags, console_out, console_err, files_out, files_err):
    res = launcher.run(["--nproc-per-node", "2", *flags, BEHAVE, "--out", out_dir], timeout=30)
    assert res.rc == 0, res
    assert _console_lines(res.out, "out") == console_out, res
    assert _console_lines(res.err, "err") == console_err, res
    outs, errs = _file_ranks(launcher.log_dir, "stdout"), _file_ranks(launcher.log_dir, "stderr")
    assert sorted(outs) == files_out, outs
    assert sorted(errs) == files_err, errs
    for rank, text in outs.items():
        assert text == f"out from rank {rank} gen 0\n", text
    for rank, text in errs.items():
        assert text == f"err from rank {rank} gen 0\n", text


# ------------------------------------------------------------------------------------------ hyperpodrun logs
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-rank run with one restart (rank 1 failed in generation 0)."""
    from conftest import Launcher
    tmp = tmp_path_factory.mktemp("finished")
    lnch = Launcher(tmp)
    out = tmp / "out"
    out.mkdir()
    try:
        res = lnch.run(["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "3", BEHAVE,
                        "--out", out, "--fail-rank", "1", "--fail-code", "3", "--wait-peers", "2"], timeout=30)
        assert res.rc == 0, res
        yield lnch
    finally:
        lnch.cleanup()


def test_logs_events(launcher, finished_run):
    res = launcher.run(["logs", finished_run.log_dir, "--events"], log_dir=False, timeout=30)
    assert res.rc == 0, res
    lines = res.out.splitlines()
    kinds = [ln.split()[2] for ln in lines]
    for kind in ("agent_start", "worker_start", "workers_started", "worker_exit", "fault", "restart_begin",
                 "workers_stopped", "restart_done", "workers_done", "job_done"):
        assert kind in kinds, f"{kind} missing from:\n{res.out}"
    assert kinds.index("fault") < kinds.index("restart_begin") < kinds.index("restart_done") < kinds.index("job_done")
    assert all(re.match(r"\d\d:\d\d:\d\d\.\d{3} ", ln) for ln in lines), res.out
    fault = lines[kinds.index("fault")]
    assert "rank 1" in fault and "exit code 3" in fault
    assert re.search(r"downtime_s=\d+\.\d+", lines[kinds.index("restart_done")])
    assert kinds.count("worker_start") == 4


def test_logs_rank(launcher, finished_run):
    res = launcher.run(["logs", finished_run.log_dir, "--rank", "1"], log_dir=False, timeout=30)
    assert res.rc == 0, res
    assert res.out.splitlines() == [
        "[rank 1 attempt 0 stderr] err from rank 1 gen 0",
        "[rank 1 attempt 0 stderr] rank 1 failing on purpose",
        "[rank 1 attempt 0 stdout] out from rank 1 gen 0",
        "[rank 1 attempt 1 stderr] err from rank 1 gen 1",
        "[rank 1 attempt 1 stdout] out from rank 1 gen 1",
    ], res.out


def test_logs_all_ranks_of_newest_run_by_default(launcher, finished_run):
    """No LOG_DIR: the newest run under the default log dir (HYPERPODRUN_LOG_DIR here)."""
    res = launcher.run(["logs"], log_dir=False, env={"HYPERPODRUN_LOG_DIR": str(finished_run.log_dir)},
                       timeout=30)
    assert res.rc == 0, res
    assert str(the_run_dir(finished_run.log_dir)) in res.err
    for rank in (0, 1):
        for gen in (0, 1):
            assert f"[rank {rank} attempt {gen} stdout] out from rank {rank} gen {gen}" in res.out, res.out


def test_logs_unknown_rank_or_dir_is_a_usage_error(launcher, finished_run, tmp_path):
    res = launcher.run(["logs", finished_run.log_dir, "--rank", "7"], log_dir=False, timeout=30)
    assert res.rc == 2 and "Traceback" not in res.err and "rank 7" in res.err, res
    res = launcher.run(["logs", tmp_path], log_dir=False, timeout=30)
    assert res.rc == 2 and "Traceback" not in res.err and "no hyperpodrun run" in res.err, res


# ------------------------------------------------------------------------------------------ pre/post scripts
def test_pre_and_post_train_scripts_run_with_their_args(launcher, tmp_path, out_dir):
    pre = tmp_path / "pre.py"
    pre.write_text("import json, os, sys\n"
                   "json.dump({'args': sys.argv[1:], 'workers_started': len([f for f in os.listdir(sys.argv[1]) "
                   "if f.startswith('ready_')])}, open(os.path.join(sys.argv[1], 'pre.json'), 'w'))\n")
    post = tmp_path / "post.sh"
    post.write_text('ls "$1" | grep -c "^done_" > "$1/post.txt"\necho "$2" >> "$1/post.txt"\n')
    res = launcher.run(["--nproc-per-node", "2", "--pre-train-script", pre,
                        "--pre-train-args", f"{out_dir} 'two words'", "--post-train-script", post,
                        "--post-train-args", f"{out_dir} bye", BEHAVE, "--out", out_dir], timeout=30)
    assert res.rc == 0, res
    pre_seen = json.loads((out_dir / "pre.json").read_text())
    assert pre_seen == {"args": [str(out_dir), "two words"], "workers_started": 0}   # ran before the workers
    assert (out_dir / "post.txt").read_text().split() == ["2", "bye"]            # ran after them
    kinds = [e["event"] for e in read_events(launcher.log_dir)]
    assert kinds.index("pre-train_done") < kinds.index("workers_started")
    assert kinds.index("workers_done") < kinds.index("post-train_done")


def test_failing_pre_train_script_is_reported_and_no_worker_starts(launcher, tmp_path, out_dir):
    pre = tmp_path / "pre.sh"
    pre.write_text("echo preparing >&2\nexit 5\n")
    res = launcher.run(["--nproc-per-node", "2", "--pre-train-script", pre, BEHAVE, "--out", out_dir], timeout=30)
    assert res.rc == 5, res
    assert "Traceback" not in res.err
    assert re.search(r"pre-train script .*pre\.sh.* failed with exit code 5", res.err), res
    assert count_files(out_dir, "ready_*") == 0, "workers must not start after a failed pre-train script"
    assert not list(the_run_dir(launcher.log_dir).glob("attempt_*"))


def test_failing_post_train_script_sets_the_exit_code(launcher, tmp_path, out_dir):
    post = tmp_path / "post.sh"
    post.write_text("exit 4\n")
    res = launcher.run(["--nproc-per-node", "2", "--post-train-script", post, BEHAVE, "--out", out_dir], timeout=30)
    assert res.rc == 4, res
    assert re.search(r"post-train script .*post\.sh.* failed with exit code 4", res.err), res
    assert count_files(out_dir, "done_*") == 2


def _start_with_sleeping_pre_train(launcher, tmp_path, out_dir):
    """hyperpodrun whose pre-train script leaves a `sleep` running; returns once both are up."""
    pre = tmp_path / "pre.sh"
    pre.write_text(f'sleep 600 &\necho $! > "{out_dir}/.sleep"\nmv "{out_dir}/.sleep" "{out_dir}/sleep_pid"\nwait\n')
    proc = launcher.start(["--nproc-per-node", "2", "--shutdown-timeout", "2", "--pre-train-script", pre,
                           BEHAVE, "--out", out_dir])
    wait_until(lambda: (out_dir / "sleep_pid").exists() or proc.popen.poll() is not None, 30,
               message="pre-train script running")
    assert proc.popen.poll() is None, proc.err()
    return proc, int((out_dir / "sleep_pid").read_text())


def test_sigterm_during_pre_train_script_stops_it(launcher, tmp_path, out_dir):
    """A container stop while the pre-train script runs: the script gets the signal, no worker starts,
    hyperpodrun exits 143 at once instead of waiting for the script."""
    proc, sleep_pid = _start_with_sleeping_pre_train(launcher, tmp_path, out_dir)
    os.kill(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    rc = proc.wait(10).rc
    assert rc == 143, proc.err()
    assert time.monotonic() - sent < 3, proc.err()
    assert not is_alive(sleep_pid)
    assert count_files(out_dir, "ready_*") == 0
    assert "Traceback" not in proc.err()
    assert not launcher.leftovers(), describe_pids(launcher.leftovers())


def test_kill9_during_pre_train_script_leaves_nothing(launcher, tmp_path, out_dir):
    """kill -9 of hyperpodrun while the pre-train script runs: the script and its children go too."""
    proc, sleep_pid = _start_with_sleeping_pre_train(launcher, tmp_path, out_dir)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    wait_until(lambda: not launcher.leftovers(), 2.0, message="pre-train script and its sleep gone")
    assert not is_alive(sleep_pid)


@pytest.mark.parametrize("trap, expect_within", [
    ("trap 'exit 3' TERM", 3.0),   # the script handles SIGTERM and fails: hyperpodrun still exits 128+15
    ("trap '' TERM", 4.0),         # the script ignores SIGTERM: SIGKILL after --shutdown-timeout 2
], ids=["script-exits-3", "script-ignores"])
def test_sigterm_during_pre_train_script_exit_code_and_timeout(launcher, tmp_path, out_dir, trap, expect_within):
    pre = tmp_path / "pre.sh"
    pre.write_text(f'{trap}\nsleep 600 &\ntouch "{out_dir}/pre_running"\nwait\nwait\n')
    proc = launcher.start(["--shutdown-timeout", "2", "--pre-train-script", pre, BEHAVE, "--out", out_dir])
    wait_until(lambda: (out_dir / "pre_running").exists() or proc.popen.poll() is not None, 30,
               message="pre-train script running")
    os.kill(proc.pid, signal.SIGTERM)
    res = proc.wait(expect_within + 1)
    assert res.rc == 143, res
