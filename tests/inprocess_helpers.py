"""Helpers of the in-process restart tests (tests/test_inprocess_*.py): real `hyperpodrun --inprocess-restart`
jobs of 4 gloo workers running tests/scripts/inproc_train.py, which records what each process did in
OUT/rank<r>.jsonl. Process handling (start, tagged cleanup, waiting) comes from conftest.py."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from conftest import HYPERPODRUN, Launcher, Proc, Result, read_events, script, wait_until

TRAIN = script("inproc_train.py")

#: short timeouts: heartbeats every 0.5 s, a silent rank is hung after 3 s, a round escalates after 20 s
#: HYPERPODRUN_TEST_STANDBY_WORKERS=N runs the in-process jobs with N standbys per local rank (standbys on)
STANDBY = ["--standby-workers", os.environ["HYPERPODRUN_TEST_STANDBY_WORKERS"]] \
    if os.environ.get("HYPERPODRUN_TEST_STANDBY_WORKERS") else []
FAST = ["--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
        "--inprocess-timeout", "20", *STANDBY]

#: HYPERPODRUN_RESTART_GRACE_S of every Job unless a test gives its own: above inproc_train.py's --pg-timeout
#: (10 s). When a peer is killed while a rank's gloo thread sends to it, gloo can leave that send waiting until the
#: group's timeout (the waiting buffer is never told the connection is gone); the rank then leaves the collective
#: at the timeout and recovers in-process - with the default grace (3 s under FAST) it would be killed first and
#: the tests that check which ranks keep their processes would see it replaced.
RESTART_GRACE_S = "12"

#: seconds a whole job may take before the test fails (and kills it)
JOB_TIMEOUT = 90


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """Every record rank `rank`'s processes wrote (see inproc_train.py), in order."""
    path = Path(out) / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]   # a line still being written has no newline yet
    return [json.loads(line) for line in complete if line.strip()]


def ranks_recorded(out: Path) -> list[int]:
    return sorted(int(Path(p).stem[4:]) for p in glob.glob(os.path.join(str(out), "rank*.jsonl")))


def pids(out: Path, rank: int) -> list[int]:
    """The processes that held `rank`, in the order they started."""
    return [r["pid"] for r in records(out, rank) if r["ev"] == "start"]


def entries(out: Path, rank: int) -> list[tuple[int, int]]:
    """(pid, caller.iteration) of every entry into the wrapped function."""
    return [(r["pid"], r["it"]) for r in records(out, rank) if r["ev"] == "enter"]


def final(out: Path, rank: int) -> dict[str, Any]:
    """The rank's last `done` record (the function returned); fails when there is none."""
    done = [r for r in records(out, rank) if r["ev"] == "done"]
    assert done, f"rank {rank} never finished: {records(out, rank)}"
    return done[-1]


def first(out: Path, rank: int, ev: str, **match: Any) -> Optional[dict[str, Any]]:
    for r in records(out, rank):
        if r["ev"] == ev and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def events_named(log_dir: Path, name: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


def summary(out: Path, log_dir: Optional[Path] = None) -> str:
    """What the workers and the agent recorded, for assertion messages."""
    lines = []
    for rank in ranks_recorded(out):
        lines.append(f"rank {rank}: " + " ".join(
            f"{r['ev']}(pid={r['pid']}{', it=' + str(r['it']) if 'it' in r else ''}"
            f"{', step=' + str(r['step']) if 'step' in r else ''})" for r in records(out, rank)))
    if log_dir is not None:
        lines += [f"  {e['event']}: {e.get('msg', '')}" for e in read_events(log_dir)
                  if e["event"] not in ("worker_start",)]
    return "\n".join(lines)


class Job:
    """One `hyperpodrun --inprocess-restart` job of inproc_train.py (or another script)."""

    def __init__(self, launcher: Launcher, out: Path, hpr_args: list[str], train_args: list[str] = (),
                 *, nproc: int = 4, train: str = TRAIN, log_dir: Optional[Path] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.launcher = launcher
        self.out = Path(out)
        self.log_dir = Path(log_dir) if log_dir is not None else launcher.log_dir
        args = ["--nproc-per-node", str(nproc), *hpr_args, train, "--out", str(out), *train_args]
        env = {"HYPERPODRUN_RESTART_GRACE_S": RESTART_GRACE_S, **(env or {})}
        self.proc: Proc = launcher.start(args, log_dir=self.log_dir, env=env)

    # -------------------------------------------------------------------------------- waiting
    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    def wait_for(self, predicate: Callable[[], Any], timeout: float, message: str) -> Any:
        """Wait for `predicate`; fail at once (with the job's output) if the job ends first."""
        def check() -> Any:
            value = predicate()
            if not value and not self.alive():
                raise AssertionError(f"the job ended (rc={self.proc.popen.returncode}) before: {message}\n"
                                     f"{summary(self.out, self.log_dir)}\n--- stderr ---\n{self.proc.err()[-5000:]}")
            return value
        return wait_until(check, timeout, message=message)

    def wait_event(self, name: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        return self.wait_for(lambda: (events_named(self.log_dir, name, **match) or [None])[0], timeout,
                             message=f"event {name} {match or ''}")

    def wait_step(self, ranks: Any, step: int = 10, timeout: float = 60) -> dict[int, int]:
        """Wait until each of `ranks` reached `step` in generation 0; returns {rank: pid}."""
        def reached() -> Optional[dict[int, int]]:
            found = {}
            for rank in ranks:
                rec = next((r for r in records(self.out, rank) if r["ev"] == "step" and r["step"] >= step), None)
                if rec is None:
                    return None
                found[rank] = rec["pid"]
            return found
        return self.wait_for(reached, timeout, message=f"ranks {list(ranks)} training past step {step}")

    def result(self, timeout: float = JOB_TIMEOUT) -> Result:
        return self.proc.wait(timeout)

    # -------------------------------------------------------------------------------- tools
    def agent_file(self, node: int = 0) -> Path:
        """DIR/<run-id>/node<k>.agent.json (written at agent start: where its control socket is)."""
        pattern = os.path.join(str(self.log_dir), "*", f"node{node}.agent.json")
        return Path(self.wait_for(lambda: (glob.glob(pattern) or [None])[0], 30, message=f"{pattern} written"))

    def agent_info(self, node: int = 0) -> dict[str, Any]:
        return json.loads(self.agent_file(node).read_text())

    def inject(self, rank: int, kind: str, step: Optional[int] = None, timeout: float = 60) -> Result:
        """`hyperpodrun inject LOG_DIR --rank R --kind K [--step S]` (waits until the rank has connected)."""
        self.agent_file()
        args = ["inject", str(self.log_dir), "--rank", str(rank), "--kind", kind, "--timeout", str(timeout)]
        if step is not None:
            args += ["--step", str(step)]
        res = self.launcher.run(args, cmd=[HYPERPODRUN], timeout=timeout + 10)
        assert res.rc == 0, f"inject failed: {res}"
        return res

    def describe(self) -> str:
        return summary(self.out, self.log_dir) + f"\n--- stderr ---\n{self.proc.err()[-6000:]}"


def assert_only_replaced(out: Path, replaced: set[int], ranks: range = range(4), *, iteration: int = 1,
                         info: str = "") -> None:
    """Ranks not in `replaced` ran in one process from start to end; each rank in `replaced` ran in exactly two
    (the second one started for a later generation); every rank finished with caller.iteration == `iteration`."""
    for rank in ranks:
        seen = pids(out, rank)
        fin = final(out, rank)
        if rank in replaced:
            assert len(seen) == 2, f"rank {rank} should have been replaced once, processes {seen}\n{info}"
            assert fin["pid"] == seen[1], f"rank {rank} finished in pid {fin['pid']}, not its replacement\n{info}"
            starts = [r for r in records(out, rank) if r["ev"] == "start"]
            assert starts[1]["gen0"] >= 1, f"rank {rank}'s replacement started for generation 0\n{info}"
        else:
            assert len(seen) == 1, f"rank {rank} should have kept its process, processes {seen}\n{info}"
            assert fin["pid"] == seen[0], f"rank {rank}: {fin}\n{info}"
        assert fin["it"] == iteration, f"rank {rank} finished in iteration {fin['it']}, not {iteration}\n{info}"
