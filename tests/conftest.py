"""Shared helpers for tests that run real hyperpodrun jobs (real processes, gloo on CPU, real signals).

Every process a test starts carries a unique tag in its environment (HPR_TEST_TAG=<uuid>); workers,
DataLoader workers and other grandchildren inherit it. Teardown kills the launcher's process group and
then every process that still carries the tag, so a failing test never leaves anything behind - and the
same tag lets tests assert that nothing of a job is left alive.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytest

BIN_DIR = os.path.dirname(sys.executable)
HYPERPODRUN = os.path.join(BIN_DIR, "hyperpodrun")
TORCHRUN = os.path.join(BIN_DIR, "torchrun")
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TAG_VAR = "HPR_TEST_TAG"

# settings of the developer's shell that would change what a launch does
_LEAKY_PREFIXES = ("PET_", "HYPERPODRUN_", "TORCHELASTIC_")
_LEAKY_NAMES = ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "OMP_NUM_THREADS")


# ------------------------------------------------------------------------------------------ waiting
def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02, message: str = "") -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"condition not met within {timeout:g}s: {message or predicate}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ /proc
def proc_stat(pid: int) -> Optional[tuple[str, int, int, int]]:
    """(state, ppid, pgrp, session) of a process, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    return rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3])


def is_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie holds nothing and runs nothing)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def session_members(sids: Iterable[int]) -> list[int]:
    """Live (non-zombie) processes whose session id is one of `sids`."""
    sids = set(sids)
    out = []
    for pid in _all_pids():
        st = proc_stat(pid)
        if st is not None and st[3] in sids and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def tagged_pids(tag: str) -> list[int]:
    """Live processes that carry HPR_TEST_TAG=<tag> in their environment (everything a test started)."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    out = []
    for pid in _all_pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in env and is_alive(pid):
            out.append(pid)
    return out


def describe_pids(pids: Iterable[int]) -> str:
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        lines.append(f"pid {pid} {proc_stat(pid)} {cmd[:150]}")
    return "\n".join(lines)


def _sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ runs
@dataclass(repr=False)
class Result:
    rc: int
    out: str
    err: str
    seconds: float
    log_dir: Optional[Path]

    def __repr__(self) -> str:
        return (f"rc={self.rc} after {self.seconds:.1f}s\n--- stdout ---\n{self.out[-4000:]}\n"
                f"--- stderr ---\n{self.err[-6000:]}")


class Proc:
    """A launched command whose stdout/stderr go to files (no pipe can fill up and block it)."""

    def __init__(self, popen: subprocess.Popen, out_path: Path, err_path: Path, log_dir: Optional[Path]) -> None:
        self.popen = popen
        self.out_path = out_path
        self.err_path = err_path
        self.log_dir = log_dir
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def out(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def err(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def wait(self, timeout: float) -> Result:
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except OSError:
                pass
            self.popen.wait()
            raise AssertionError(f"command did not finish within {timeout:g}s: {self.popen.args}\n"
                                 f"--- stdout ---\n{self.out()[-3000:]}\n--- stderr ---\n{self.err()[-5000:]}")
        return Result(rc, self.out(), self.err(), time.monotonic() - self.started, self.log_dir)


class Launcher:
    """Starts hyperpodrun (or torchrun, or anything) in its own session with a tagged environment."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = Path(tmp)
        self.tag = uuid.uuid4().hex
        self.log_dir = self.tmp / "logs"
        self.procs: list[Proc] = []
        self._n = 0

    def env(self, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_LEAKY_PREFIXES) and k not in _LEAKY_NAMES}
        env[TAG_VAR] = self.tag
        env.update(extra or {})
        return env

    def start(self, args: list[str], *, cmd: Optional[list[str]] = None, log_dir: Any = True,
              env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> Proc:
        """`hyperpodrun [--log-dir <tmp>/logs] ARGS` (or `cmd + ARGS`); returns at once."""
        self._n += 1
        argv = list(cmd) if cmd is not None else [HYPERPODRUN]
        used_log_dir: Optional[Path] = None
        if cmd is None and log_dir:
            used_log_dir = self.log_dir if log_dir is True else Path(log_dir)
            argv += ["--log-dir", str(used_log_dir)]
        argv += [str(a) for a in args]
        out_path = self.tmp / f"proc{self._n}.stdout"
        err_path = self.tmp / f"proc{self._n}.stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=self.env(env),
                                     cwd=str(cwd or self.tmp), start_new_session=True)
        proc = Proc(popen, out_path, err_path, used_log_dir)
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], *, timeout: float = 60, **kw: Any) -> Result:
        """Launch and wait; fails the test (and kills the run) if it takes longer than `timeout`."""
        return self.start(args, **kw).wait(timeout)

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
        end = time.monotonic() + 10
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > end:
                break
            _sigkill(left)
            time.sleep(0.02)
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def launcher(tmp_path: Path):
    lnch = Launcher(tmp_path)
    yield lnch
    lnch.cleanup()


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """A directory where worker scripts leave their markers."""
    path = tmp_path / "out"
    path.mkdir()
    return path


def write_script(directory: Path, name: str, body: str) -> Path:
    path = Path(directory) / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def script(name: str) -> str:
    """Path of a worker script kept under tests/scripts/."""
    return str(SCRIPTS / name)


# ------------------------------------------------------------------------------------------ run dirs
def run_dirs(log_dir: Path) -> list[Path]:
    """Run directories (those with an event log) under a --log-dir."""
    return sorted({Path(p).parent for p in glob.glob(os.path.join(str(log_dir), "*", "*.events.jsonl"))})


def the_run_dir(log_dir: Path) -> Path:
    runs = run_dirs(log_dir)
    assert len(runs) == 1, f"expected one run under {log_dir}, found {runs}"
    return runs[0]


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    """Every agent event record of every run and node under `log_dir`, in file order."""
    records = []
    for path in sorted(glob.glob(os.path.join(str(log_dir), "*", "*.events.jsonl"))):
        with open(path) as fh:
            records.extend(json.loads(line) for line in fh if line.strip())
    return records


def read_markers(directory: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in sorted(glob.glob(os.path.join(str(directory), pattern)))]


def count_files(directory: Path, pattern: str) -> int:
    return len(glob.glob(os.path.join(str(directory), pattern)))


def assert_same_ckpt_state(ref_dir: Any, got_dir: Any, ranks: int = 4) -> None:
    """The parameters and optimizer state each rank of tests/scripts/ckpt_worker.py wrote at the end
    (rank<r>.pt) are bitwise equal in two runs."""
    import torch
    for rank in range(ranks):
        a = torch.load(os.path.join(ref_dir, f"rank{rank}.pt"))
        b = torch.load(os.path.join(got_dir, f"rank{rank}.pt"))
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), f"rank {rank}: parameter {k} differs"
        for pid, st in a["opt"].items():
            for n, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(v, b["opt"][pid][n]), f"rank {rank}: optimizer state {pid}.{n} differs"
