"""The jobs the chaos soak (scripts/bench/soak.py) runs its faults on: 2 nodes x 2 ranks on this machine (CPU,
gloo), each node in its own pid and mount namespaces with a private /dev/shm, under hyperpodrun (its
standalone coordinator, --inprocess-restart: tests/nodes.py's nodes, tests/test_node_loss.py's Cluster) or under
torchrun with torch.save checkpoints (scripts/bench/node_loss.py's nodes, which also give each node its own
host name, as torchrun's rendezvous needs).

Both answer the same questions for the faults (soak_faults.inject) and the harness: which host process runs
rank r, has the job recovered since t (every rank entered its training function again after t and completed a
step since), did a node end and with which code.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(HERE)]
from conftest import TAG_VAR, TORCHRUN, Launcher, describe_pids, free_port, wait_until  # noqa: E402
from nodes import Node  # noqa: E402
from hyperpodrun import timeline  # noqa: E402
from test_standalone_coordinator import on_coordinator, start_coordinator  # noqa: E402
import node_loss  # noqa: E402
import soak_procs  # noqa: E402

WORKER = HERE / "workers" / "soak_worker.py"
RANKS = 4


def last_jsonl(path: Path) -> Optional[dict[str, Any]]:
    """The last complete record of a JSON-lines file that only grows (read from its end)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            lines = fh.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1] if len(lines) > 1 else lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


class _Common:
    out: Path
    t_start: float

    def max_step(self) -> int:
        recs = [last_jsonl(self.out / f"steps.rank{r}.jsonl") for r in range(RANKS)]
        return max((r["step"] for r in recs if r), default=0)

    def min_step(self) -> int:
        recs = [last_jsonl(self.out / f"steps.rank{r}.jsonl") for r in range(RANKS)]
        return min((r["step"] if r else 0) for r in recs)

    def recovered(self, since: float) -> bool:
        """Every rank entered its training function after `since` and completed a step after that."""
        for r in range(RANKS):
            e = last_jsonl(self.out / f"entries.rank{r}.jsonl")
            s = last_jsonl(self.out / f"steps.rank{r}.jsonl")
            if not e or e["t"] <= since or not s or s["t"] <= e["t"]:
                return False
        return True

    def stepped_since(self, since: float) -> bool:
        """Every rank completed a step after `since` (a fault that restarts nothing: the coordinator's)."""
        recs = [last_jsonl(self.out / f"steps.rank{r}.jsonl") for r in range(RANKS)]
        return all(r and r["t"] > since for r in recs)

    def inner_pid(self, rank: int) -> tuple[int, str]:
        fields = (self.out / f"pid.rank{rank}").read_text().split()
        return int(fields[0]), (fields[2] if len(fields) > 2 else "")

    def stop(self) -> int:
        """Every rank ends training at the same step, ahead of all of them; returns it."""
        at = self.max_step() + 20
        (self.out / "stop.tmp").write_text(str(at))
        os.replace(self.out / "stop.tmp", self.out / "stop")
        return at


class HprJob(_Common):
    """hyperpodrun --inprocess-restart on a standalone coordinator; the log dirs on a small tmpfs of their own."""

    system = "hyperpodrun"

    def __init__(self, tmp: Path, env: dict[str, str], flags: list[str], log_fs_mb: int, name: str = "soak"):
        self.tmp = tmp
        self.launcher = Launcher(tmp)
        self.log_fs = tmp / "logfs"
        self.log_fs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={log_fs_mb}m", "tmpfs", str(self.log_fs)], check=True)
        self.mounted = True
        self.out = tmp / "out"
        self.out.mkdir()
        self.port = free_port()
        self.coordinator = start_coordinator(self.launcher, self.port)
        self.cluster = on_coordinator(self.launcher, self.log_fs, name, self.port)
        self.cluster.worker = str(WORKER)
        self.cluster.out = self.out
        self.cluster.env = {"OUT_DIR": str(self.out), "UNDER": "hyperpodrun", "OMP_NUM_THREADS": "1", **env}
        self.cluster.extra = flags
        self.incarnations = {0: 0, 1: 0}
        self.nodes: dict[int, Node] = {}
        self.nodes[0] = self.cluster.start(0, label="n0-0")
        wait_until(lambda: "node 0 waiting" in self.nodes[0].proc.err() or not self.nodes[0].alive(), 120,
                   message="node 0 joined")
        self.nodes[1] = self.cluster.start(1, label="n1-0")
        self.spare: Optional[Node] = None
        self.spares = 0
        self.spare_exits: list[Optional[int]] = []   # the code of each spare that ended (one that took over: none)
        self.t_start = time.time()

    def unsupported(self, f: dict[str, Any]) -> Optional[str]:
        return None

    def start_spare(self) -> float:
        """A third agent with the same command: the job has its two nodes, so it waits as a hot spare. Returns
        the seconds until it said so."""
        t = time.monotonic()
        self.spares += 1
        spare = self.spare = self.cluster.start(2, label=f"spare-{self.spares}")
        wait_until(lambda: "hot spare" in spare.proc.err() or not spare.alive(), 180,
                   message=f"spare {self.spares} waits")
        if not spare.alive():
            raise RuntimeError(f"spare {self.spares} ended before it waited:\n{spare.describe()}")
        return time.monotonic() - t

    def lose_to_spare(self, node: int) -> str:
        """Node `node` dies whole; the waiting spare takes its place (nothing is started again)."""
        spare = self.spare
        if spare is None or not spare.alive():
            raise RuntimeError("no hot spare waiting")
        self.kill_node(node)
        self.wait_node_gone(node)
        self.nodes[node], self.spare = spare, None
        return f"spare-{self.spares}"

    def init_pid(self, node: int) -> int:
        return self.nodes[node].init_pid()

    def rank_pid(self, rank: int) -> int:
        inner, _ = self.inner_pid(rank)
        pid = soak_procs.host_pid(self.init_pid(rank // 2), inner)
        if pid is None:
            raise RuntimeError(f"no process of rank {rank} (pid {inner} in node {rank // 2}'s namespace)")
        return pid

    def agent_pid(self, node: int) -> Optional[int]:
        kids = soak_procs.children(self.init_pid(node))
        return kids[0] if kids else None

    def slot_dir(self, rank: int) -> Path:
        _, slots = self.inner_pid(rank)
        return Path(f"/proc/{self.init_pid(rank // 2)}/root") / slots.lstrip("/")

    def kill_node(self, node: int) -> None:
        self.nodes[node].kill()

    def wait_node_gone(self, node: int) -> None:
        self.nodes[node].wait(60)

    def replace_node(self, node: int) -> None:
        self.incarnations[node] += 1
        self.nodes[node] = self.cluster.start(node, label=f"n{node}-{self.incarnations[node]}")

    def kill_coordinator(self) -> None:
        self.coordinator.popen.send_signal(signal.SIGKILL)
        self.coordinator.wait(30)

    def start_coordinator(self) -> None:
        self.coordinator = start_coordinator(self.launcher, self.port)

    def events(self, name: str, since: float = 0.0, nodes: Optional[list[Node]] = None) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for node in nodes if nodes is not None else self.cluster.nodes:
            try:   # skips a record that a full log filesystem cut short
                recs = timeline.read_events(str(p) for p in node.log_dir.glob("*/*.events.jsonl"))
            except OSError:
                continue
            found += [e for e in recs if e.get("event") == name and e["ts"] > since]
        return sorted(found, key=lambda e: e["ts"])

    def wait_event(self, name: str, since: float, timeout: float, every_node: bool = False) -> Optional[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if every_node:
                per = [self.events(name, since, [n]) for n in self.nodes.values()]
                if all(per):
                    return per[0][0]
            else:
                got = self.events(name, since, list(self.nodes.values()))
                if got:
                    return got[0]
            time.sleep(0.1)
        return None

    def coordinator_recovered(self, since: float) -> Optional[float]:
        """When every current agent said the coordinator is back (after `since`) and every rank stepped since."""
        backs = [self.events("coordinator_back", since, [n]) for n in self.nodes.values()]
        if not all(backs):
            return None
        at = max(b[0]["ts"] for b in backs)
        return at if self.stepped_since(at) else None

    def ended(self) -> Optional[dict[int, Optional[int]]]:
        if all(n.alive() for n in self.nodes.values()):
            return None
        return {i: n.proc.popen.poll() for i, n in self.nodes.items()}

    def wait_end(self, timeout: float) -> dict[int, int]:
        codes = {}
        for i, n in self.nodes.items():
            try:
                codes[i] = n.wait(timeout)
            except AssertionError:
                codes[i] = -999
        if self.spare is not None:   # not needed: it leaves with the job (exit 0)
            try:
                self.spare_exits.append(self.spare.wait(timeout))
            except AssertionError:
                self.spare_exits.append(-999)
        return codes

    def describe(self) -> str:
        return self.cluster.describe()

    def stop_coordinator(self) -> None:
        """The job is over: the coordinator goes (SIGTERM, as an operator would)."""
        if self.coordinator.popen.poll() is None:
            self.coordinator.popen.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(30)
            except AssertionError:
                pass

    def shutdown(self) -> None:
        """Whatever is still running of this job is killed."""
        self.launcher.cleanup()

    def unmount(self, keep: bool = False) -> None:
        """Unmount the log filesystem (its logs copied beside it first with `keep`)."""
        if keep and self.mounted:
            import shutil
            shutil.copytree(self.log_fs, self.tmp / "logs", ignore=shutil.ignore_patterns("filler"),
                            dirs_exist_ok=True)
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.log_fs)], check=False)
            self.mounted = False


class TorchrunJob(_Common):
    """torchrun --nnodes 2:2 c10d --max-restarts, the worker's torch.save checkpoints (node 0 hosts the store)."""

    system = "torchrun"

    def __init__(self, tmp: Path, env: dict[str, str], max_restarts: int):
        self.tmp = tmp
        self.launcher = Launcher(tmp)      # only for its tag: what it finds by the tag is this job's
        self.out = tmp / "out"
        self.out.mkdir()
        self.port = free_port()
        self.env = {**self.launcher.env(), "OUT_DIR": str(self.out), "UNDER": "torchrun", "OMP_NUM_THREADS": "1",
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
        self.max_restarts = max_restarts
        self.incarnations = {0: 0, 1: 0}
        self.nodes: dict[int, node_loss.Node] = {0: self._start(0)}
        node_loss.wait_listening(self.port, 120)
        self.nodes[1] = self._start(1)
        self.t_start = time.time()

    def _start(self, node: int) -> node_loss.Node:
        argv = [TORCHRUN, "--nnodes", "2:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{self.port}", "--rdzv-id", f"soak{self.port}", "--rdzv-conf", "last_call_timeout=1",
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1", "--local-addr", "127.0.0.1",
                str(WORKER)]
        return node_loss.Node(argv, self.env, self.tmp / f"torchrun-n{node}-{self.incarnations[node]}.log")

    def unsupported(self, f: dict[str, Any]) -> Optional[str]:
        if f["kind"] == "coordinator":
            return "torchrun has no standalone coordinator (its c10d store lives in node 0's agent)"
        if f["kind"] == "rot":
            return "torchrun has no in-memory snapshot slot (it reloads its torch.save checkpoint)"
        if f["kind"] == "logfull":
            return "torchrun keeps no log dir here (its workers' output goes to its console)"
        if f["kind"] in ("node", "spare") and f["rank"] // 2 == 0:
            return "node 0's agent hosts torchrun's c10d rendezvous store: its loss ends the job"
        return None

    def init_pid(self, node: int) -> int:
        return soak_procs.children(self.nodes[node].popen.pid)[0]

    def rank_pid(self, rank: int) -> int:
        inner, _ = self.inner_pid(rank)
        pid = soak_procs.host_pid(self.init_pid(rank // 2), inner)
        if pid is None:
            raise RuntimeError(f"no process of rank {rank} (pid {inner} in node {rank // 2}'s namespace)")
        return pid

    def kill_node(self, node: int) -> None:
        self.nodes[node].kill()

    def wait_node_gone(self, node: int) -> None:
        self.nodes[node].wait(60)

    def replace_node(self, node: int) -> None:
        self.incarnations[node] += 1
        self.nodes[node] = self._start(node)

    def start_spare(self) -> float:
        return 0.0   # no waiting spare (lose_to_spare starts the node's command again)

    def lose_to_spare(self, node: int) -> str:
        """torchrun's answer to a lost node here: its command started again 1 s after the loss (as `node`)."""
        t = time.time()
        self.kill_node(node)
        self.wait_node_gone(node)
        time.sleep(max(0.0, 1.0 - (time.time() - t)))   # "started again 1 s after the loss"
        self.replace_node(node)
        return "replacement (no waiting spare under torchrun)"

    def wait_event(self, name: str, since: float, timeout: float, every_node: bool = False) -> Optional[dict]:
        """torchrun has no event log; its recovery begins when the rank that raised has taken the command."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for r in range(RANKS):
                rec = last_jsonl(self.out / f"commands.rank{r}.jsonl")
                if rec and rec["t"] > since:
                    return rec
            time.sleep(0.05)
        return None

    def ended(self) -> Optional[dict[int, Optional[int]]]:
        if all(n.popen.poll() is None for n in self.nodes.values()):
            return None
        return {i: n.popen.poll() for i, n in self.nodes.items()}

    def wait_end(self, timeout: float) -> dict[int, int]:
        return {i: n.wait(timeout) for i, n in self.nodes.items()}

    def describe(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("torchrun-*.log")))

    def stop_coordinator(self) -> None:
        pass

    def shutdown(self) -> None:
        for n in self.nodes.values():
            if n.popen.poll() is None:
                os.killpg(n.popen.pid, signal.SIGKILL)
                n.popen.wait()
        self.launcher.cleanup()

    def unmount(self, keep: bool = False) -> None:
        pass


def tag_of(job: Any) -> str:
    return f"{TAG_VAR}={job.launcher.tag}"
