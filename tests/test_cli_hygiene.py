"""Production hygiene of the command line: bounded numbers, `--` as torchrun, environment settings, --help,
one-line errors; and output that can never stop a job (full log filesystem, broken console), a lost
coordination store as one line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import HYPERPODRUN, TORCHRUN, free_port, read_events, wait_until, write_script


def _one_line_usage_error(res, *needles: str) -> str:
    """Exit 2, exactly one line on stderr (`Error: ...`), nothing on stdout, no traceback."""
    assert res.rc == 2, res
    assert "Traceback" not in res.err, res
    assert res.out == "", res
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"not one line:\n{res.err}"
    assert lines[0].startswith("Error: "), res.err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def ok_script(tmp_path: Path) -> Path:
    path = tmp_path / "ok.py"
    path.write_text("pass\n")
    return path


# ------------------------------------------------------------------------------------------ bounds
BOUNDS = [
    (["--nproc-per-node", "99999999999999999999"], ["--nproc-per-node", "1024"]),
    (["--nproc-per-node", "1025"], ["--nproc-per-node", "1024"]),
    (["--nnodes", "99999999999"], ["--nnodes", "65536"]),
    (["--nnodes", "99999999999:99999999999"], ["--nnodes"]),
    (["--max-restarts", "99999999999999999999"], ["--max-restarts", "1000000"]),
    (["--max-restarts", "1.5"], ["--max-restarts", "whole number"]),
    (["--max-step-failures", "1e3"], ["--max-step-failures"]),
    (["--shutdown-timeout", "1e400"], ["--shutdown-timeout", "'1e400'", "one week"]),
    (["--shutdown-timeout", "nan"], ["--shutdown-timeout", "finite"]),
    (["--shutdown-timeout", "604801"], ["--shutdown-timeout", "604800"]),
    (["--inprocess-timeout", "inf"], ["--inprocess-timeout", "finite"]),
    (["--heartbeat-timeout", "-inf"], ["--heartbeat-timeout"]),
    (["--progress-timeout", "1e9"], ["--progress-timeout", "one week"]),
    (["--monitor-interval", "nan"], ["--monitor-interval", "0.001"]),
    (["--monitor-interval", "1e-9"], ["--monitor-interval", "0.001"]),
    (["--heartbeat-interval", "1e400"], ["--heartbeat-interval"]),
    (["--health-interval", "inf"], ["--health-interval"]),
    (["--rdzv-conf", "join_timeout=inf"], ["--rdzv-conf", "join_timeout", "one week"]),
    (["--rdzv-conf", "timeout=1e400"], ["--rdzv-conf", "timeout"]),
    (["--node-rank", "99999999999999999999"], ["--node-rank"]),
]


@pytest.mark.parametrize("flags, needles", BOUNDS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_numeric_flag_out_of_bounds_is_one_line(launcher, ok_script, flags, needles):
    started = time.monotonic()
    _one_line_usage_error(launcher.run([*flags, ok_script], timeout=30), *needles)
    assert time.monotonic() - started < 20, "a usage error must not start an agent"


@pytest.mark.parametrize("env, needles", [
    ({"PET_NPROC_PER_NODE": "99999999999999999999"}, ["--nproc-per-node"]),
    ({"HYPERPODRUN_INPROCESS_TIMEOUT": "nan"}, ["--inprocess-timeout", "HYPERPODRUN_INPROCESS_TIMEOUT"]),
    ({"PET_MAX_RESTARTS": "1e400"}, ["--max-restarts", "PET_MAX_RESTARTS"]),
    ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1e400"}, ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_numeric_environment_default_out_of_bounds_names_the_variable(launcher, ok_script, env, needles):
    _one_line_usage_error(launcher.run([ok_script], env=env, timeout=30), *needles)


def test_launch_config_owns_the_bounds():
    from pydantic import ValidationError

    from hyperpodrun.launch.config import LaunchConfig, describe_validation_error
    for field, value in [("shutdown_timeout", float("inf")), ("inprocess_timeout", float("nan")),
                         ("nproc_per_node", 10 ** 20), ("max_restarts", 10 ** 7), ("join_timeout", 1e400),
                         ("monitor_interval", 0.0)]:
        with pytest.raises(ValidationError) as err:
            LaunchConfig(entrypoint="x.py", **{field: value})
        line = describe_validation_error(err.value)
        assert line.startswith("--") and "must be" in line and "\n" not in line, line
    assert LaunchConfig(entrypoint="x.py", shutdown_timeout=604800, nproc_per_node=1024).nproc_per_node == 1024


def test_mmap_prefetch_length_is_bounded():
    from hyperpodrun.data.config import MAX_PREFETCH_LENGTH, CacheResumeMMAPConfig
    from hyperpodrun.errors import ConfigError
    with pytest.raises(ConfigError, match=r"prefetch_length=1000000000000\): must be <= 4096"):
        CacheResumeMMAPConfig(cache_dir="/tmp/x", prefetch_length=10 ** 12)
    assert CacheResumeMMAPConfig(cache_dir="/tmp/x", prefetch_length=MAX_PREFETCH_LENGTH).window > 0


# ------------------------------------------------------------------------------------------ `--` as torchrun
DASHES = [
    ["s.py", "--", "a"], ["s.py", "a", "--", "b"], ["-m", "mod", "--", "a"], ["s.py", "--", "--", "a"],
    ["--", "s.py", "a"], ["--", "s.py", "--", "a"], ["s.py", "a", "--", "--", "b"], ["s.py", "--lr", "--", "x"],
    ["--nproc-per-node", "2", "s.py", "--"], ["s.py", "-x", "--", "b"], ["s.py", "--", "--lr", "0.5"],
    ["--max-restarts", "1", "s.py", "--", "--max-restarts", "3"], ["s.py"], ["s.py", "--x=--"],
]


@pytest.mark.parametrize("argv", DASHES, ids=" ".join)
def test_script_arguments_are_torchruns(argv):
    """What the script gets after TRAINING_SCRIPT, compared with torchrun's own parser (argparse REMAINDER)."""
    from torch.distributed.run import get_args_parser

    from hyperpodrun.cli import launch
    theirs = get_args_parser().parse_args(argv)
    with launch.make_context("hyperpodrun", list(argv)) as ctx:
        ours = (ctx.params["training_script"], list(ctx.params["training_script_args"]))
    assert ours == (theirs.training_script, theirs.training_script_args)


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_double_dash_reaches_an_argparse_script_as_under_torchrun(launcher, tmp_path, module):
    """`hyperpodrun script.py -- --lr 0.5` and `hyperpodrun -m module -- --lr 0.5`: the script's argparse sees
    --lr 0.5, as under torchrun."""
    path = write_script(tmp_path, "lr.py", """
        import argparse, json, os, sys
        p = argparse.ArgumentParser()
        p.add_argument("--lr", type=float)
        p.add_argument("rest", nargs="*")
        args = p.parse_args()
        json.dump({"argv": sys.argv[1:], "lr": args.lr, "rest": args.rest},
                  open(os.path.join(os.environ["OUT"], os.environ["WHO"] + ".json"), "w"))
    """)
    got = {}
    for who, cmd in (("hyperpodrun", None), ("torchrun", [TORCHRUN, "--nproc-per-node", "1"])):
        entry = ["-m", "lr"] if module else [path]     # -m: the module is found in the cwd (tmp_path)
        res = launcher.run([*entry, "--", "--lr", "0.5", "--", "x"], cmd=cmd, timeout=60, cwd=tmp_path,
                           env={"OUT": str(tmp_path), "WHO": who})
        assert res.rc == 0, res
        got[who] = (tmp_path / f"{who}.json").read_text()
    assert got["hyperpodrun"] == got["torchrun"]
    assert '"lr": 0.5' in got["hyperpodrun"] and '"argv": ["--lr", "0.5", "--", "x"]' in got["hyperpodrun"]


# ------------------------------------------------------------------------------------------ paths, settings
def test_script_that_is_a_directory(launcher, tmp_path):
    (tmp_path / "train").mkdir()
    _one_line_usage_error(launcher.run([tmp_path / "train"], timeout=30), "is a directory")


def test_pre_train_script_that_is_a_directory(launcher, tmp_path, ok_script):
    _one_line_usage_error(launcher.run(["--pre-train-script", tmp_path, ok_script], timeout=30),
                          "--pre-train-script", "is a directory")


@pytest.mark.parametrize("env, needles", [
    ({"HYPERPODRUN_LOG_LEVEL": "loud"}, ["HYPERPODRUN_LOG_LEVEL", "DEBUG"]),
    ({"HYPERPODRUN_LOG_LEVEL": "99"}, ["HYPERPODRUN_LOG_LEVEL"]),
    ({"HYPERPODRUN_WARM_RESPAWN": "maybe"}, ["HYPERPODRUN_WARM_RESPAWN", "1 or 0"]),
    ({"HYPERPODRUN_SYMPTOM_GRACE_S": "soon"}, ["HYPERPODRUN_SYMPTOM_GRACE_S"]),
    ({"HYPERPODRUN_EXIT_GRACE_S": "inf"}, ["HYPERPODRUN_EXIT_GRACE_S"]),
    ({"HYPERPODRUN_WARM_IMPORTS": "torch,9lives"}, ["HYPERPODRUN_WARM_IMPORTS", "9lives"]),
], ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_bad_setting_is_one_line(launcher, ok_script, env, needles):
    _one_line_usage_error(launcher.run([ok_script], env=env, timeout=30), *needles)


def test_settings_parse():
    import logging

    from hyperpodrun.launch import settings
    s = settings.load({"HYPERPODRUN_LOG_LEVEL": "debug", "HYPERPODRUN_WARM_RESPAWN": "off",
                       "HYPERPODRUN_WARM_IMPORTS": "torch, lightning.pytorch", "HYPERPODRUN_EXIT_GRACE_S": "0"})
    assert (s.log_level, s.warm_respawn, s.warm_imports, s.exit_grace_s) == \
        (logging.DEBUG, False, ("torch", "lightning.pytorch"), 0.0)
    assert settings.load({"HYPERPODRUN_LOG_LEVEL": "10"}).log_level == 10
    assert settings.load({}) == settings.Settings()


def test_numeric_log_level_is_accepted(launcher, ok_script):
    res = launcher.run([ok_script], env={"HYPERPODRUN_LOG_LEVEL": "10"}, timeout=60)
    assert res.rc == 0, res
    assert "started (pid" in res.err, "HYPERPODRUN_LOG_LEVEL=10 (DEBUG) logs every worker start"


# ------------------------------------------------------------------------------------------ --help, errors
def test_help_shows_defaults_and_refused_flags(launcher):
    res = launcher.run(["--help"], log_dir=False, timeout=30)
    assert res.rc == 0, res
    options, refused = res.out.split("Refused torchrun flags", 1)
    for flag, default in [("--nproc-per-node", "1"), ("--max-restarts", "0"), ("--monitor-interval", "0.1"),
                          ("--shutdown-timeout", "($TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)"),
                          ("--inprocess-timeout", "60"), ("--heartbeat-timeout", "10"), ("--health-check", "auto"),
                          ("--master-port", "(29500)"), ("--standalone", "(off)"), ("--rdzv-id", "none")]:
        block = options[options.index(flag):]
        block = block[:block.index("[default:") + 200] if "[default:" in block else ""
        assert f"[default: {default}" in " ".join(block.split()), f"{flag}: no default {default!r} shown"
    # every visible option shows its default (--version and --help aside)
    blocks = re.split(r"\n(?=  -)", options[options.index("Options:"):])[1:]
    assert len(blocks) > 30, options
    for block in blocks:
        if not block.lstrip().startswith(("--version", "-h, --help")):
            assert "[default:" in block, f"no default shown:\n{block}"
    from hyperpodrun.cli import UNSUPPORTED
    for flag, why in UNSUPPORTED.values():
        assert flag in refused and why in refused, flag
    for text in ("--rdzv-backend other than static, c10d, etcd", "--event-log-handler"):
        assert text in refused, text


@pytest.mark.parametrize("flags", [["--numa-binding", "bogus"], ["--logs-specs", "x"],
                                   ["--nnodes", "1:2"],
                                   ["--rdzv-backend", "etcd-v2"], ["--no-such-flag"]], ids=" ".join)
def test_refused_flags_are_one_line(launcher, ok_script, flags):
    _one_line_usage_error(launcher.run([*flags, ok_script], timeout=30), flags[0])


def test_logs_usage_error_is_one_line(launcher, tmp_path):
    res = launcher.run(["logs", tmp_path, "--rank", "x"], log_dir=False, timeout=30)
    _one_line_usage_error(res, "--rank")


# ------------------------------------------------------------------------------------------ a full log filesystem
@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs (root only: mount); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(directory: Path) -> None:
    """Write into `directory` until its filesystem is full."""
    with open(directory / f"filler-{uuid.uuid4().hex}", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


CHATTY = """
    import os, sys
    rank = os.environ["RANK"]
    line = "x" * 100
    for i in range(20000):           # 2 MB per rank and stream: more than the log filesystem holds
        print(f"rank {rank} out {i} {line}")
        print(f"rank {rank} err {i} {line}", file=sys.stderr)
    print(f"rank {rank} last line", flush=True)
    open(os.path.join(sys.argv[1], "done_" + rank), "w").close()
"""


def test_full_log_filesystem_does_not_stop_the_job(launcher, tmp_path, out_dir, small_tmpfs):
    """Workers print more than the log filesystem holds: they finish, the job exits 0, the console has every
    line, and the lost file output is reported once."""
    path = write_script(tmp_path, "chatty.py", CHATTY)
    res = launcher.run(["--nproc-per-node", "2", path, out_dir], log_dir=small_tmpfs, timeout=120)
    assert res.rc == 0, res
    assert sorted(p.name for p in out_dir.iterdir()) == ["done_0", "done_1"]
    for rank in (0, 1):
        assert f"]: rank {rank} last line" in res.out, f"rank {rank}'s last line is missing from the console"
        assert f"]: rank {rank} err 19999 " in res.err
    dropped = [ln for ln in res.err.splitlines() if "dropping output from the log files" in ln]
    assert len(dropped) == 1, res.err[-3000:]
    assert "No space left on device" in dropped[0], dropped
    assert "Traceback" not in res.err


def test_full_log_dir_at_start_is_a_usage_error(launcher, ok_script, small_tmpfs):
    _fill(small_tmpfs)
    res = launcher.run([ok_script], log_dir=small_tmpfs / "logs", timeout=30)
    _one_line_usage_error(res, "--log-dir", "full")


def _run_with_stdout(tmp_path: Path, args: list, stdout, timeout: float = 90) -> tuple[int, str]:
    err_path = tmp_path / "agent.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "HYPERPODRUN_", "TORCHELASTIC_"))}
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([HYPERPODRUN, "--log-dir", str(tmp_path / "logs"), *map(str, args)],
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=err, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"hyperpodrun did not finish:\n{err_path.read_text()[-3000:]}")
    return rc, err_path.read_text(errors="replace")


def _log_lines(tmp_path: Path, rank: int) -> list[str]:
    [path] = (tmp_path / "logs").glob(f"*/attempt_0/rank_{rank}/stdout.log")
    return path.read_text().splitlines()


def test_closed_console_does_not_stop_the_job(tmp_path, out_dir):
    """hyperpodrun's stdout is a pipe whose reader is gone: workers finish, files are complete, one warning."""
    path = write_script(tmp_path, "chatty.py", CHATTY)
    r, w = os.pipe()
    os.close(r)
    try:
        rc, err = _run_with_stdout(tmp_path, ["--nproc-per-node", "2", path, out_dir], w)
    finally:
        os.close(w)
    assert rc == 0, err[-3000:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["done_0", "done_1"]
    assert len(_log_lines(tmp_path, 1)) == 20001
    warned = [ln for ln in err.splitlines() if "cannot write workers' output to the console" in ln]
    assert len(warned) == 1, err[-3000:]


def test_blocked_console_does_not_stop_the_job(tmp_path, out_dir):
    """hyperpodrun's stdout is a pipe that nobody reads: the workers are not held up, the job ends."""
    path = write_script(tmp_path, "chatty.py", CHATTY.replace("range(20000)", "range(60000)"))
    r, w = os.pipe()
    try:
        rc, err = _run_with_stdout(tmp_path, ["--nproc-per-node", "2", path, out_dir], w)
    finally:
        os.close(w)
        os.close(r)
    assert rc == 0, err[-3000:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["done_0", "done_1"]
    assert len(_log_lines(tmp_path, 0)) == 60001
    warned = [ln for ln in err.splitlines() if "does not keep up" in ln]
    assert len(warned) == 1, err[-3000:]


FAILS_WHILE_CHATTY = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    line = "x" * 200
    for i in range(3000):            # 600 KB per rank and stream: far more than a pipe holds (64 KB)
        print(f"rank {rank} out {i} {line}")
        print(f"rank {rank} err {i} {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    open(os.path.join(sys.argv[1], f"wrote_{rank}"), "w").close()
    if rank == 1:                    # fail once rank 0 has written all it writes too (both pipes full)
        end = time.monotonic() + 30
        while not os.path.exists(os.path.join(sys.argv[1], "wrote_0")) and time.monotonic() < end:
            time.sleep(0.01)
        sys.exit(3)
    while True:                      # rank 0 runs until the agent stops it
        time.sleep(0.1)
"""


def test_blocked_stdout_and_stderr_do_not_stop_supervision(tmp_path, out_dir):
    """hyperpodrun's stdout and stderr are pipes that nobody reads, and the workers fill both: the agent still
    sees rank 1 fail, stops rank 0 and exits with rank 1's code within a deadline. (Its own log lines go to
    the blocked stderr too: they must not stop its loop - agent/workers/tee.py, ConsoleLogHandler.)"""
    path = write_script(tmp_path, "fails.py", FAILS_WHILE_CHATTY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "HYPERPODRUN_", "TORCHELASTIC_"))}
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    started = time.monotonic()
    try:
        proc = subprocess.Popen([HYPERPODRUN, "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
                                 "--shutdown-timeout", "3", path, str(out_dir)],
                                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, env=env, start_new_session=True)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("hyperpodrun froze behind its blocked stdout/stderr (killed after 60 s)")
    finally:
        for fd in (out_w, out_r, err_w, err_r):
            os.close(fd)
    elapsed = time.monotonic() - started
    assert rc == 3, f"exit code {rc}, expected rank 1's 3"
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert sorted(p.name for p in out_dir.iterdir()) == ["wrote_0", "wrote_1"]
    events = read_events(tmp_path / "logs")
    assert [e["rank"] for e in events if e["event"] == "fault"] == [1], events
    assert len(_log_lines(tmp_path, 1)) == 3000, "rank 1's log file is complete"


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_closed_std_fd_does_not_fail_the_job(launcher, tmp_path, out_dir, closed):
    """`hyperpodrun ... >&-` (or `2>&-`): the job succeeds, its log files are complete."""
    path = write_script(tmp_path, "chatty.py", CHATTY.replace("range(20000)", "range(100)"))
    res = launcher.run(["--log-dir", tmp_path / "logs", path, out_dir], log_dir=False, timeout=60,
                       cmd=["sh", "-c", f'exec "$0" "$@" {closed}>&-', HYPERPODRUN])
    assert res.rc == 0, res
    assert sorted(p.name for p in out_dir.iterdir()) == ["done_0"]
    assert len(_log_lines(tmp_path, 0)) == 101
    if closed == 1:
        assert "stdout is closed" in res.err and "Traceback" not in res.err, res
    else:
        assert "]: rank 0 last line" in res.out, res


def test_tee_release_of_a_finished_stream_leaves_a_new_one_on_the_same_fd(tmp_path):
    """Unit: a stream that ended (EOF) and a new pipe that got the same fd number: releasing the old stream's
    key must not close the new one (its worker would get EPIPE)."""
    from hyperpodrun.agent.workers import tee as T
    con_r, con_w = os.pipe()
    tee = T.Tee()
    try:
        r1, w1 = T.worker_pipe()
        old = tee.attach(r1, str(tmp_path / "a.log"), con_w, "[a]: ")
        os.write(w1, b"one\ntwo")
        os.close(w1)
        def closed(fd: int) -> bool:
            try:
                os.fstat(fd)
                return False
            except OSError:
                return True
        # the pump has finished the stream and closed its read end (the fd number is free again)
        wait_until(lambda: (tmp_path / "a.log").read_bytes() == b"one\ntwo" and not tee._streams and closed(r1), 10,
                   message="EOF seen by the pump")
        r2, w2 = T.worker_pipe()
        assert r2 == r1, "the kernel gives the lowest free fd: the new pipe reuses the number"
        new = tee.attach(r2, str(tmp_path / "b.log"), None, "[b]: ")
        tee.release(old)
        os.write(w2, b"three\n")   # would raise BrokenPipeError had release() closed the new stream
        tee.release(new)
        os.close(w2)
        assert (tmp_path / "b.log").read_bytes() == b"three\n"
    finally:
        tee.close()
    os.close(con_w)
    with os.fdopen(con_r, "rb") as fh:
        assert fh.read() == b"[a]: one\n[a]: two\n"


def test_tee_drops_console_output_when_the_queue_is_full():
    """Unit: the console queue is bounded; overflow is dropped with one report, the pump never blocks."""
    from hyperpodrun.agent.workers import tee as T
    problems: list[str] = []
    r, w = os.pipe()   # a console nobody reads: its writer thread blocks once the pipe is full
    try:
        console = T.Console(w, lambda kind, msg: problems.append(kind))
        chunk = b"y" * 65536
        started = time.monotonic()
        for _ in range(T.CONSOLE_QUEUE_BYTES // len(chunk) + 64):
            console.put(chunk)
        assert time.monotonic() - started < 5, "put() must never block"
        assert "console-slow" in problems
    finally:
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------------------------------ node 0 gone
ALLREDUCE_FOREVER = """
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    open(os.path.join(sys.argv[1], f"ready_{dist.get_rank()}"), "w").close()
    t = torch.ones(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.05)
"""


def test_node1_agent_says_one_line_when_node0_dies(launcher, tmp_path, out_dir):
    """kill -9 of node 0's agent: node 1's agent stops its workers and exits 1 with one line about the lost
    coordination store - no Python traceback, no C++ stack of torch's store client."""
    path = write_script(tmp_path, "forever.py", ALLREDUCE_FOREVER)
    port = free_port()
    procs = [launcher.start(["--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port",
                             str(port), "--shutdown-timeout", "3", path, out_dir], log_dir=tmp_path / f"logs{n}")
             for n in (0, 1)]
    wait_until(lambda: len(list(out_dir.glob("ready_*"))) == 2 or any(p.popen.poll() is not None for p in procs),
               60, message="both ranks running")
    assert all(p.popen.poll() is None for p in procs), procs[0].err() + procs[1].err()
    os.kill(procs[0].pid, signal.SIGKILL)
    res = procs[1].wait(30)
    assert res.rc == 1, res
    agent_lines = [ln for ln in res.err.splitlines() if not ln.startswith("[") or ln.startswith("[hyperpodrun")]
    text = "\n".join(agent_lines)
    assert "Traceback" not in text and "frame #" not in text and "DistNetworkError" not in text, text
    assert "lost the coordination store" in text, text
    assert [e for e in read_events(tmp_path / "logs1") if e["event"] == "store_lost"]


def test_store_error_in_the_agent_loop_is_one_line(tmp_path, monkeypatch):
    """Unit: a DistNetworkError raised by a coordination-store call in the agent's loop ends the agent with
    exit 1 and one event line (it is not a traceback)."""
    import torch.distributed as dist

    from hyperpodrun.agent.agent import Agent
    from hyperpodrun.launch.config import LaunchConfig
    agent = Agent(LaunchConfig(entrypoint="x.py", log_dir=str(tmp_path)))

    def lost() -> int:
        raise dist.DistNetworkError("Failed to recv, got 0 bytes.\nException raised from recvBytes")
    monkeypatch.setattr(agent, "_run", lost)
    monkeypatch.setattr(agent, "_cleanup", lambda: None)
    assert agent.run() == 1
    last = agent.events._pending[-1]
    assert last["event"] == "store_lost" and "\n" not in last["msg"], last
    assert "lost the coordination store (Failed to recv, got 0 bytes.)" in last["msg"], last
