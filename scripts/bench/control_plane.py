"""The control plane at scale: N agents' coordination against a real store, with fake workers.

    python scripts/bench/control_plane.py --nodes 2,16,128 --store coordinator,etcd,node --rounds 3

Each simulated agent is three threads of this process, running the agent's own coordination code as
agent/agent.py wires it: the rendezvous (agent/coordination/rendezvous.py, the etcd one for etcd), the
Membership thread (leases, the owner election of agent/coordination/owner.py, the declared losses), the
Watcher (generation, failure) and a loop that plays the in-process round as agent/round.py does - request
the restart, claim and publish the workers' store, mark this node READY, wait until every node is, GO -
with workers that are READY at once (no torch is imported: the store's side is what is measured). The
store is real: a `hyperpodrun coordinator` process, one etcd member (`etcd` on PATH), or the first agent's
in-process TCPStore ("node", the node-hosted store of a default launch).

Per N and store it reports: the rendezvous time; per restart round (a fault on one agent), the time from
the fault to the first and the last agent's GO and the store operations the round's loops made (per agent);
and the background load - store operations per agent per lease period of the Membership and Watcher
threads, measured while nothing happens. The growth law of each is fitted (a*N^b by least squares on logs)
and extrapolated to 1,000 and 10,000 nodes. Prints the command, the machine and the figures; --json writes
them too. The agents share this process's cores (and its GIL) with one another and with the store: the
times are an upper bound of what N separate machines would see.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # torch's per-connection hostname warnings
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # hyperpodrun from this checkout
sys.path.insert(0, HERE)

from _common import find_launcher  # noqa: E402
from _control_plane_fit import SATURATED, report  # noqa: E402
from hyperpodrun import auth  # noqa: E402
from hyperpodrun.agent.coordination import store_schema as K, stores  # noqa: E402
from hyperpodrun.agent.coordination.job_state import Coordinator, Watcher  # noqa: E402
from hyperpodrun.agent.coordination.membership import Membership, lease_interval  # noqa: E402
from hyperpodrun.agent.coordination.owner import electing  # noqa: E402
from hyperpodrun.agent.coordination.rendezvous import rendezvous  # noqa: E402
from hyperpodrun.agent.coordination.store_schema import FailureInfo  # noqa: E402
from hyperpodrun.launch.config import LaunchConfig  # noqa: E402

OPS = ("get", "set", "add", "check", "compare_set", "wait", "delete_key", "multi_get", "multi_set", "read_now")


class Counting:
    """A store connection that counts the operations made through it (one thread uses each)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in OPS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return attr(*args, **kwargs)
        return counted


class FakeWorkerStores:
    """The WorkerStoreHost port without a server: the workers are fake, only the records are real."""

    def __init__(self) -> None:
        self._ports: dict[int, int] = {}

    def open(self, generation: int) -> int:
        self._ports[generation] = 40000 + generation
        return self._ports[generation]

    def get(self, generation: int) -> Optional[object]:
        return self._ports.get(generation)


def _noting_the_end(run: Callable[[], None], ended: threading.Event) -> None:
    try:
        run()
    finally:
        ended.set()


class SimAgent:
    """One agent: rendezvous, then Membership + Watcher threads and a loop thread that plays the rounds."""

    def __init__(self, cfg: LaunchConfig, before: bool = False) -> None:
        self.cfg = cfg
        self.before = before              # every agent watches every lease, as before the owner
        self.inbox: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.bg: list[Counting] = []      # Membership's and Watcher's connections
        self.loop_ops: Optional[Counting] = None
        self.go: dict[int, float] = {}    # generation -> when this agent said GO
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.owner = False
        self.ready = threading.Event()    # its threads run: the job has formed
        self.helpers: list[Any] = []      # Membership, Watcher
        self.ended: list[threading.Event] = []
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _open(self, open_store: Callable[[], Any]) -> Callable[[], Any]:
        def opened() -> Any:
            c = Counting(open_store())
            self.bg.append(c)
            return c
        return opened

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the driver
            self.error = exc

    def _run(self) -> None:
        cfg = self.cfg
        rdzv = self.rdzv = rendezvous(cfg, self.stop.is_set)
        self.loop_ops = store = Counting(rdzv.store)
        coord = Coordinator(store, rdzv.nnodes, 0, key=auth.derive(rdzv.secret, "store"), run_id=rdzv.run_id,
                            node_rank=rdzv.node_rank, on_forged=lambda msg: None, incarnation=rdzv.incarnation)
        if rdzv.link is not None:
            rdzv.link.post = self.inbox.put
            open_store = rdzv.link.connect
        else:
            host, port = rdzv.store_endpoint or ("127.0.0.1", 0)

            def open_store() -> Any:   # as agent.py's _helper_store
                return stores.prefixed(K.run_prefix(rdzv.run_id), stores.open_tcp_store(
                    host, port, server=False, timeout_s=cfg.join_timeout))
        membership = Membership(self._open(open_store), lambda s: coord.view(s).records, self.inbox.put,
                                node=rdzv.node_rank, nnodes=cfg.nnodes, incarnation=rdzv.incarnation,
                                node_timeout=cfg.node_timeout, news=rdzv.coordinator,
                                watch_all=rdzv.store_host or (self.before and rdzv.coordinator),
                                elect=electing(rdzv.node_rank, rdzv.incarnation, cfg.node_timeout)
                                if rdzv.coordinator and not self.before else None)
        watcher = Watcher(self._open(open_store), self.inbox.put, cfg.monitor_interval, view=coord.view)
        for helper in (membership, watcher):   # their run() ends once stopped: noted here, so the end of
            self.helpers.append(helper)          # the run can wait on every agent's helpers with one deadline
            self.ended.append(ended := threading.Event())
            setattr(helper, "run", functools.partial(_noting_the_end, helper.run, ended))
            helper.start()
        self.ready.set()
        wstores = FakeWorkerStores()
        gen, target, marked = 0, None, False
        nodes = list(range(rdzv.nnodes))
        next_tick = time.monotonic()
        while not self.stop.is_set():
            try:
                kind, value = self.inbox.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                kind, value = "tick", None
                next_tick = time.monotonic() + cfg.monitor_interval
            if kind == "owner":
                self.owner = True
            elif kind == "fault":                 # a rank of this node failed: round.py's fault()
                grant = coord.request_restart(gen, FailureInfo(host="sim", summary="injected"), count_budget=False)
                target, marked = grant.generation, False
                coord.claim_root_cause(target, FailureInfo(host="sim", summary="injected"))
                stores.open_worker_store(target, wstores, coord, rdzv)
            elif kind == "generation" and int(value) > (target if target is not None else gen):
                target, marked = int(value), False   # another node moved it: remote_generation()
                stores.open_worker_store(target, wstores, coord, rdzv)
            if target is not None:                # _advance_round: the workers are READY at once
                if not marked:
                    coord.mark_ready(target)
                    marked = True
                if coord.ready_count(target, nodes) >= len(nodes) and coord.worker_store_port(target) is not None:
                    self.go[target] = time.monotonic()
                    gen, target = target, None
        membership.stop()
        watcher.stop()




def cpu_seconds(proc: Optional["subprocess.Popen[bytes]"]) -> float:
    """CPU seconds the store's process has used (user + system, /proc): its cost per operation."""
    if proc is None:
        return 0.0
    with open(f"/proc/{proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_store(kind: str, tmp: str) -> tuple[Optional[subprocess.Popen[bytes]], str]:
    """The store for `kind` -> (its process or None, the --rdzv-endpoint)."""
    port = _free_port()
    if kind == "node":
        return None, f"127.0.0.1:{port}"
    if kind == "coordinator":
        proc = subprocess.Popen([find_launcher("hyperpodrun"), "coordinator", "--host", "127.0.0.1", "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        for line in proc.stderr:
            if b"serving the coordination store" in line:
                break
        else:
            raise SystemExit("the coordinator did not start")
        threading.Thread(target=proc.stderr.read, daemon=True).start()   # drain
        return proc, f"127.0.0.1:{port}"
    if shutil.which("etcd") is None:
        raise SystemExit("etcd is not on PATH (Debian: apt-get install etcd-server)")
    peer = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["etcd", "--name", "m0", "--data-dir", os.path.join(tmp, f"etcd-{port}"),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"m0=http://127.0.0.1:{peer}", "--log-level", "error",
                             "--logger", "zap"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("etcd did not start")
            time.sleep(0.1)
    return proc, f"127.0.0.1:{port}"


def config(kind: str, endpoint: str, n: int, run_id: str, node_timeout: float) -> LaunchConfig:
    return LaunchConfig.from_flags(dict(entrypoint="true", no_python=True, args=[], nnodes=str(n), nproc_per_node=1,
                                        rdzv_backend="etcd" if kind == "etcd" else "c10d", rdzv_endpoint=endpoint,
                                        rdzv_id=run_id, node_timeout=node_timeout))


def wait_for(cond: Callable[[], bool], timeout: float, what: str, agents: list[SimAgent]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for a in agents:
            if a.error is not None:
                raise SystemExit(f"an agent failed while {what}: {a.error!r}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out while {what}")
        time.sleep(0.01)


def every_agent_reads_the_marks(self: Coordinator, name: str, given: Optional[Any]) -> int:
    """The barrier's count before the seal (mode "before"): every agent reads every node's mark once the
    counter says complete."""
    nodes = list(given or self._nodes())
    hint = int(self.records.store.add(name, 0))
    if hint < len(nodes):
        return max(hint, 0)
    return sum(self.records._marked(name, n) for n in nodes)


def measure(kind: str, n: int, rounds: int, node_timeout: float, tmp: str, mode: str = "now") -> dict[str, Any]:
    """One job of `n` simulated agents on a fresh store of `kind`: rendezvous, background load, rounds.
    mode "before": the control plane before the owner and the barrier seal (every agent watches every lease
    with a coordinator or etcd; every agent reads every READY mark), for comparison."""
    proc, endpoint = start_store(kind, tmp)
    agents: list[SimAgent] = []
    count = Coordinator._count
    if mode == "before":
        setattr(Coordinator, "_count", every_agent_reads_the_marks)
    try:
        run_id = f"bench-{kind}-{n}-{mode}"
        t0 = time.monotonic()
        agents = [SimAgent(config(kind, endpoint, n, run_id, node_timeout), mode == "before") for _ in range(n)]
        for a in agents:
            a.thread.start()
        wait_for(lambda: all(a.ready.is_set() for a in agents), 120 + n, "meeting", agents)
        formed = time.monotonic() - t0
        wait_for(lambda: any(a.owner for a in agents) or kind == "node" or mode == "before", 30, "electing an owner", agents)
        period = lease_interval(node_timeout)
        time.sleep(period)                 # let the first passes (bids, first reads) settle
        bg0, w0, cpu0, store0 = sum(c.count for a in agents for c in a.bg), time.monotonic(), time.process_time(), \
            cpu_seconds(proc)
        time.sleep(3 * period)             # a quiet window: only leases, the owner's watch and the Watchers
        ops, wall = sum(c.count for a in agents for c in a.bg) - bg0, time.monotonic() - w0
        bg = ops / (wall / period) / n
        sim_cpu = (time.process_time() - cpu0) / wall      # cores this process used for the agents
        store_us = (cpu_seconds(proc) - store0) / ops * 1e6 if proc is not None and ops else None
        results = []
        for i in range(rounds):
            gen = i + 1
            before = sum((a.loop_ops.count if a.loop_ops else 0) for a in agents)
            fault = time.monotonic()
            agents[(i * 7919) % n].inbox.put(("fault", None))
            wait_for(lambda: all(gen in a.go for a in agents), 60, f"round {gen}", agents)
            ops = sum((a.loop_ops.count if a.loop_ops else 0) for a in agents) - before
            gos = [a.go[gen] - fault for a in agents]
            results.append(dict(first_go_s=min(gos), last_go_s=max(gos), round_ops=ops, round_ops_per_agent=ops / n))
            time.sleep(0.3)
        med = sorted(results, key=lambda r: r["last_go_s"])[len(results) // 2]
        return dict(store=kind, mode=mode, nodes=n, formed_s=formed, sim_cpu=sim_cpu, saturated=sim_cpu > SATURATED,
                    store_cpu_us_per_op=store_us, bg_ops_per_agent_per_period=bg, lease_period_s=period,
                    **med, rounds=results)
    finally:
        setattr(Coordinator, "_count", count)
        for a in agents:                   # every agent's threads end before the store goes: none reconnects
            a.stop.set()
        for a in agents:
            a.thread.join(10)
            for helper in a.helpers:
                helper.stop()
        for a in agents:
            for ended in a.ended:
                ended.wait(10)
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,16,128", help="comma-separated numbers of agents")
    ap.add_argument("--etcd-nodes", help="numbers of agents with etcd (default: --nodes): each etcd request costs "
                    "this one process an HTTP round trip, so it holds fewer agents on etcd than on a TCPStore")
    ap.add_argument("--store", default="coordinator,etcd", help="comma-separated: coordinator, etcd, node")
    ap.add_argument("--rounds", type=int, default=3, help="restart rounds per job (the median is reported)")
    ap.add_argument("--node-timeout", type=float, default=5.0, help="--node-timeout of the agents (seconds)")
    ap.add_argument("--modes", default="now", help="comma-separated: now (this tree), before (every agent watches "
                    "every lease and reads every READY mark, as before the owner and the seal)")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--report", metavar="JSON", help="print the fits and the model of a --json written before")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            report(json.load(f)["results"])
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # the stores are stopped then
    ns = [int(x) for x in args.nodes.split(",")]
    etcd_ns = [int(x) for x in args.etcd_nodes.split(",")] if args.etcd_nodes else ns
    kinds = [k.strip() for k in args.store.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [k for k in kinds if k not in ("coordinator", "etcd", "node")] + [m for m in modes if m not in ("now", "before")]
    if bad or any(n < 2 for n in ns + etcd_ns):
        print(f"control_plane.py: --store takes coordinator, etcd, node, --modes now, before and --nodes numbers >= 2 "
              f"(got {args.store!r}, {args.modes!r}, {args.nodes!r})", file=sys.stderr)
        return 2
    print("command: python scripts/bench/control_plane.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU(s), Python {platform.python_version()}")
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        for kind in kinds:
            for mode in modes:
                for n in (etcd_ns if kind == "etcd" else ns):
                    r = measure(kind, n, args.rounds, args.node_timeout, tmp, mode)
                    out.append(r)
                    print(f"{kind:11s} {mode:6s} N={n:5d}  formed {r['formed_s']:6.2f}s  fault->GO first "
                          f"{r['first_go_s']:.3f}s last {r['last_go_s']:.3f}s  round ops {r['round_ops']:7d} "
                          f"({r['round_ops_per_agent']:.1f}/agent)  background "
                          f"{r['bg_ops_per_agent_per_period']:.1f} ops/agent/period  agents' CPU {r['sim_cpu']:.2f}"
                          + (f"  store {r['store_cpu_us_per_op']:.0f} us/op" if r["store_cpu_us_per_op"] else "")
                          + ("  SATURATED (not fitted)" if r["saturated"] else ""), flush=True)
    fits = report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=out, fits=fits), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
