"""Node loss, hyperpodrun vs torchrun, on one machine: 2 nodes x 2 ranks (CPU, gloo), node 1 killed whole.

Each node runs in its own pid and mount namespaces with a private /dev/shm (as root, `unshare`), so a SIGKILL
to the node's init takes its agent, its workers and its shared memory at once. Scenarios, alternated run by
run in one invocation:

  hpr-replace  hyperpodrun --inprocess-restart, static rendezvous; node 1's command started again 1 s after
               the kill (CheckpointManager: state in memory and on the other node)
  hpr-spare    hyperpodrun --inprocess-restart, c10d with a third agent waiting as a hot spare; nothing is
               started again
  torchrun     torchrun --nnodes 2:2 c10d --max-restarts 3; node 1's command started again 1 s after the
               kill; the worker saves a torch.save checkpoint every 10 steps and reloads it
  hpr-shrink   hyperpodrun --nnodes 1:2 c10d --inprocess-restart --replace-timeout 2: nothing replaces node 1;
               node 0 goes on alone (DDP, state from memory at the new world size)
  torchrun-shrink  torchrun --nnodes 1:2 c10d --max-restarts 3 (last_call_timeout 1): nothing replaces node 1;
               node 0's agent restarts its workers at world size 2 from the torch.save checkpoint

Measured (wall clock, one machine): kill -> every rank completed its first step after the recovery
("recovery"; in the shrink scenarios the ranks of node 0), and the steps redone (last step completed before the kill minus the step training resumed
from). hyperpodrun's recovery is broken into phases from the event logs: detected (first fault or node_lost
on node 0), declared lost, replacement joined (its "replacing" event), state restored, first step.

    sudo .venv/bin/python scripts/bench/node_loss.py --runs 5 --json scripts/bench/results/node_loss.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "node_loss_worker.py"
BIN = Path(sys.executable).parent
# each node also gets its own UTS namespace and host name: torchrun's c10d rendezvous names a node by host name
# and pid, and two agents that are pid 3 of their namespaces on one host would be the same node to it
# ... and with --local-addr the node name is that address and the pid, so the agents' pids must differ too:
# each node burns PID_BUMP pids of its namespace first
INIT = ('hostname "$NODE_NAME" && mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm || exit 99; '
        'for _ in $(seq "$PID_BUMP"); do : & done; wait; "$@"; exit $?')
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--uts", "--propagation", "private", "bash", "-c",
           INIT, "bash"]
HPR = ["--nproc-per-node", "2", "--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
       "--inprocess-timeout", "30", "--node-timeout", "3", "--replace-timeout", "60"]
KILL_AT = 35


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    count = 0

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        Node.count += 1
        env = dict(env, NODE_NAME=f"bench-{log.stem}", PID_BUMP=str(10 * Node.count))
        with open(log, "wb") as fh:
            self.popen = subprocess.Popen([*UNSHARE, *argv], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the namespace's init: the whole node goes."""
        with open(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children") as fh:
            os.kill(int(fh.read().split()[0]), signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
            return -999


def records(out: Path, kind: str) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for f in out.glob(f"{kind}.rank*.jsonl"):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


def events(log_dir: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for f in log_dir.glob("*/*.events.jsonl"):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


def wait_step(out: Path, step: int, nodes: list[Node], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = {r["rank"] for r in records(out, "steps") if r["step"] >= step}
        if done >= {0, 1, 2, 3}:
            return
        if any(n.popen.poll() is not None for n in nodes):
            raise RuntimeError("a node ended before the kill")
        time.sleep(0.05)
    raise RuntimeError(f"the ranks did not reach step {step} within {timeout}s")


def wait_output(node: Node, text: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in node.log.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{node.log.name}: no {text!r} within {timeout}s")


def wait_listening(port: int, timeout: float = 60) -> None:
    """Until something accepts connections on 127.0.0.1:port (torchrun's agent hosting its store)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def run_one(scenario: str, tmp: Path) -> dict[str, Any]:
    out = tmp / "out"
    out.mkdir()
    port = free_port()
    torchrun = scenario.startswith("torchrun")
    shrink = scenario.endswith("shrink")
    env = dict(os.environ, OUT_DIR=str(out), UNDER="torchrun" if torchrun else "hyperpodrun",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", DDP="1" if shrink else "0")
    run_id = f"nl{port}"

    def cmd(node_rank: int) -> list[str]:
        if torchrun:
            return [str(BIN / "torchrun"), "--nnodes", "1:2" if shrink else "2:2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                    "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3",
                    "--monitor-interval", "0.1", "--local-addr", "127.0.0.1", str(WORKER)]
        log_dir = str(tmp / f"logs{node_rank}-{time.monotonic_ns()}")
        if scenario == "hpr-replace":
            where = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                     "--master-port", str(port)]
        elif shrink:
            where = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        else:
            where = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        hpr = [*HPR[:-1], "2"] if shrink else HPR    # --replace-timeout 2: how long the job waits for node 1
        return [str(BIN / "hyperpodrun"), "--log-dir", log_dir, *where, *hpr, "--rdzv-id", run_id, str(WORKER)]

    node0 = Node(cmd(0), env, tmp / "node0.log")
    if scenario != "hpr-replace":   # c10d: the first agent to bind the endpoint hosts the store - node 0
        wait_listening(port) if torchrun else wait_output(node0, "node 0 waiting")
    node1 = Node(cmd(1), env, tmp / "node1.log")
    nodes = [node0, node1]
    spare = None
    if scenario == "hpr-spare":
        wait_step(out, 2, nodes)
        spare = Node(cmd(2), env, tmp / "spare.log")
        wait_output(spare, "hot spare")
        nodes.append(spare)
    wait_step(out, KILL_AT, nodes)
    t_kill = time.time()
    node1.kill()
    node1.wait(30)
    joiner = spare
    if spare is None and not shrink:
        time.sleep(max(0.0, 1.0 - (time.time() - t_kill)))   # "started again 1 s after the loss"
        joiner = Node(cmd(1), env, tmp / "replacement.log")
    codes = [node0.wait(300)] + ([joiner.wait(300)] if joiner is not None else [])
    steps = records(out, "steps")
    entries = records(out, "entries")
    firsts: list[Optional[float]] = []
    for rank in range(2 if shrink else 4):   # the first step completed after this rank's function started again
        again = [e["t"] for e in entries if e["rank"] == rank and e["t"] > t_kill]
        after = [r["t"] for r in steps if r["rank"] == rank and again and r["t"] > min(again)]
        firsts.append(min(after) if after else None)
    resumed = [e["start"] for e in entries if e["t"] > t_kill]
    last_before = max(r["step"] for r in steps if r["t"] <= t_kill)
    res: dict[str, Any] = {"scenario": scenario, "exit_codes": codes, "ok": set(codes) == {0} and None not in firsts,
                           "recovery_s": max(firsts) - t_kill if all(f is not None for f in firsts) else None,  # type: ignore
                           # a step's record is written after its save and a short sleep: a rank may resume one
                           # step past the last record seen before the kill, which is 0 steps redone
                           "steps_redone": max(0, last_before - min(resumed)) if resumed else None}
    if not torchrun:
        ev = []
        for d in tmp.glob("logs*"):
            ev += events(d)
        def first_ts(name: str) -> Optional[float]:
            ts = [e["ts"] for e in ev if e["event"] == name and e["ts"] > t_kill]
            return min(ts) if ts else None
        restored = [e["ts"] for e in ev if e["event"] == "state_restored" and e["ts"] > t_kill]
        detected = [t for t in (first_ts("fault"), first_ts("node_lost")) if t is not None]
        res["phases_s"] = {
            "detected": (min(detected) - t_kill) if detected else None,
            "declared_lost": (first_ts("node_lost") or t_kill) - t_kill,
            "joined": (first_ts("job_shrunk" if shrink else "replacing") or t_kill) - t_kill,
            "state_restored": (max(restored) - t_kill) if restored else None,
            "first_step": res["recovery_s"],
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--scenarios", default="hpr-replace,hpr-spare,torchrun,hpr-shrink,torchrun-shrink")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("needs root and unshare (pid/mount namespaces per node)", file=sys.stderr)
        return 2
    scenarios = args.scenarios.split(",")
    results: list[dict[str, Any]] = []
    for i in range(args.runs):
        for sc in scenarios:
            with tempfile.TemporaryDirectory(prefix=f"nlb-{sc}-") as tmp:
                try:
                    res = run_one(sc, Path(tmp))
                except Exception as exc:   # one failed run is reported, not fatal to the others
                    res = {"scenario": sc, "ok": False, "error": str(exc)}
                res["run"] = i
                results.append(res)
                print(json.dumps(res), flush=True)
    print("\nscenario       ok  recovery median (min..max) s   steps redone   phases (median s)")
    for sc in scenarios:
        ok = [r for r in results if r["scenario"] == sc and r.get("ok")]
        rec = [r["recovery_s"] for r in ok]
        line = f"{sc:13s} {len(ok)}/{args.runs}"
        if rec:
            line += f"  {statistics.median(rec):6.2f} ({min(rec):.2f}..{max(rec):.2f})"
            line += f"   {statistics.median([r['steps_redone'] for r in ok]):g}"
            if "phases_s" in ok[0]:
                ph = {k: statistics.median([r["phases_s"][k] for r in ok if r["phases_s"][k] is not None] or [0])
                      for k in ok[0]["phases_s"]}
                line += "   " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items())
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": os.uname().nodename, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
