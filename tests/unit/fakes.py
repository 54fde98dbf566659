"""Fake ports for the node's state machine: a clock that moves when told, worker processes that exist only as
records, a control socket that records what it sends, and a harness that wires a real Node (and InProcess)
to them over torch's in-memory HashStore. Nothing here starts a process or opens a socket."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, cast

import torch.distributed as dist

from hyperpodrun import protocol as P
from hyperpodrun.agent.coordination.job_state import Coordinator
from hyperpodrun.agent.observe.events import EventLog
from hyperpodrun.agent.inprocess import InProcess
from hyperpodrun.agent.node import Node
from hyperpodrun.agent.ports import KVStore, RendezvousInfo
from hyperpodrun.agent.state import Phase
from hyperpodrun.agent.coordination.store_schema import NodeLoss
from hyperpodrun.agent.workers.supervisor import WorkerProcess
from hyperpodrun.launch.config import LaunchConfig

RUN = "run"
KEY = b"k" * 32


class FakeClock:
    """Monotonic and wall time that only move with `advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingSink:
    """An EventSink that keeps every record."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed = True

    def named(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]

    def names(self) -> list[str]:
        return [r["event"] for r in self.records]


class FakePopen:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.returncode


class FakeProcs:
    """The ProcessTable: worker records; signals are recorded, and (obey=True) end the process on `settle`."""

    def __init__(self) -> None:
        self.workers: dict[int, WorkerProcess] = {}
        self.signals: list[tuple[int, int]] = []     # (local rank, signal)
        self.pending: list[tuple[WorkerProcess, int]] = []

    def live(self) -> list[WorkerProcess]:
        return [p for p in self.workers.values() if p.alive]

    def signal_all(self, sig: int, procs: Optional[list[WorkerProcess]] = None) -> None:
        for proc in procs if procs is not None else self.live():
            proc.signalled = True
            self.signals.append((proc.local_rank, sig))
            self.pending.append((proc, sig))

    def kill(self, proc: WorkerProcess) -> None:
        self.signal_all(signal.SIGKILL, [proc])


class FakeLauncher:
    """The Launcher: each spawn is a new WorkerProcess record with the next pid."""

    def __init__(self, procs: FakeProcs, clock: FakeClock, nproc: int, rank_offset: int) -> None:
        self.procs = procs
        self.clock = clock
        self.nproc = nproc
        self.rank_offset = rank_offset
        self.next_pid = 1000 + 100 * (rank_offset // max(nproc, 1))
        self.spawned: list[tuple[int, int, int, bool]] = []   # (local rank, generation, port, warm)
        self.on_spawn: Optional[Callable[[int, int], None]] = None
        self.warm_started = self.warm_ended = 0

    def spawn(self, local_rank: int, generation: int, store_port: int, warm: bool = False) -> WorkerProcess:
        self.next_pid += 1
        proc = WorkerProcess(local_rank=local_rank, rank=self.rank_offset + local_rank, generation=generation,
                             popen=FakePopen(self.next_pid), started=self.clock.monotonic(),
                             source="warm" if warm and self.warm_started else "cold")
        self.procs.workers[local_rank] = proc
        self.spawned.append((local_rank, generation, store_port, warm))
        if self.on_spawn is not None:
            self.on_spawn(local_rank, proc.pid)
        return proc

    def spawn_all(self, generation: int, store_port: int, warm: bool = False) -> None:
        for lr in range(self.nproc):
            self.spawn(lr, generation, store_port)

    def error_file(self, proc: WorkerProcess) -> Optional[str]:
        return None

    def stderr_log(self, proc: WorkerProcess) -> Optional[str]:
        return None

    def on_exit(self, proc: WorkerProcess) -> None:
        pass

    def start_warm_spawner(self) -> None:
        self.warm_started += 1

    def end_warm_spawner(self) -> None:
        self.warm_ended += 1


class FakeControl:
    """The ControlSender: records every message; idents in `unreachable` (or None) are not delivered."""

    def __init__(self) -> None:
        self.sent: list[tuple[Optional[bytes], P._Msg]] = []
        self.unreachable: set[bytes] = set()

    def send(self, ident: Optional[bytes], msg: P._Msg) -> bool:
        if ident is None or ident in self.unreachable:
            return False
        self.sent.append((ident, msg))
        return True

    def of(self, kind: type) -> list[tuple[Optional[bytes], Any]]:
        return [(i, m) for i, m in self.sent if isinstance(m, kind)]


class FakeWorkerStores:
    """The WorkerStoreHost: generation g's store "listens" on port 30000 + g."""

    def __init__(self) -> None:
        self.opened: dict[int, int] = {}

    def open(self, generation: int) -> int:
        self.opened[generation] = 30000 + generation
        return self.opened[generation]

    def get(self, generation: int) -> Optional[object]:
        return self.opened.get(generation)


class FlakyStore:
    """A KVStore that fails every call once `lost` is set, as a TCPStore whose server went away does."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.lost:
                raise RuntimeError("Connection reset by peer")
            return attr(*args, **kwargs)
        return call


def shared_store() -> KVStore:
    """One in-memory coordination store for every node of a test job."""
    return dist.HashStore()


def config(**overrides: Any) -> LaunchConfig:
    values: dict[str, Any] = dict(entrypoint="train.py", nproc_per_node=2, shutdown_timeout=5.0, health_check="none",
                                  heartbeat_interval=1.0, heartbeat_timeout=10.0, inprocess_timeout=60.0,
                                  join_timeout=30.0)
    values.update(overrides)
    nnodes = values.get("nnodes", 1)
    values.setdefault("single_node", nnodes == 1)
    values.setdefault("node_rank", 0)
    return LaunchConfig(**values)


@dataclass
class Harness:
    """One node of a test job: a real Node (and InProcess) on fake ports."""

    cfg: LaunchConfig
    node_rank: int = 0
    store: Optional[KVStore] = None
    clock: FakeClock = field(default_factory=FakeClock)
    obey: bool = True       # workers end on the first signal they get
    incarnation: str = ""   # this agent's hold on its node rank ("": no holder checks, as before membership)
    replacing: Optional[NodeLoss] = None   # this agent takes over a lost node's rank (rendezvous found it)
    coordinator: bool = False   # a standalone coordinator serves the store: no node hosts it, each may host workers'

    def __post_init__(self) -> None:
        cfg = self.cfg
        raw = self.store if self.store is not None else shared_store()
        self.flaky = FlakyStore(dist.PrefixStore(f"hyperpodrun/{RUN}/", raw))
        store = cast(KVStore, self.flaky)
        n = cfg.nproc_per_node
        self.rdzv = RendezvousInfo(node_rank=self.node_rank, nnodes=cfg.nnodes, rank_offset=self.node_rank * n,
                                   world_size=cfg.nnodes * n, run_id=RUN, master_addr="127.0.0.1", store=store,
                                   store_host=self.node_rank == 0 and not self.coordinator,
                                   coordinator=self.coordinator,
                                   store_endpoint=None if cfg.single_node else ("127.0.0.1", 1),
                                   single_node=cfg.single_node, incarnation=self.incarnation,
                                   replacing=self.replacing)
        self.forged: list[str] = []
        self.coord = Coordinator(store, cfg.nnodes, cfg.max_restarts, key=KEY, run_id=RUN, node_rank=self.node_rank,
                                 on_forged=self.forged.append, incarnation=self.incarnation)
        self.sink = RecordingSink()
        self.events = EventLog(f"h{self.node_rank}", self.clock, console=False)
        self.events.add_sink(self.sink)
        self.procs = FakeProcs()
        self.launcher = FakeLauncher(self.procs, self.clock, n, self.node_rank * n)
        self.wstores = FakeWorkerStores() if self.node_rank == 0 or self.coordinator else None
        self.control = FakeControl()
        self.succeeded = 0
        self.node = Node(cfg, self.rdzv, f"h{self.node_rank}", procs=self.procs, launcher=self.launcher,
                         coord=self.coord, wstores=self.wstores, events=self.events, clock=self.clock,
                         exit_grace_s=0.0, on_success=self._success)
        self.inproc: Optional[InProcess] = None
        if cfg.inprocess_restart:
            self.inproc = InProcess(cfg, self.rdzv, f"h{self.node_rank}", self.node.state, self.node, self.coord,
                                    self.control, self.events, self.clock)
            self.launcher.on_spawn = self.inproc.on_spawn
            self.node.attach(inproc=self.inproc)
        self._seen_gen = 0
        self._failure_sent = False

    def _success(self) -> None:
        self.succeeded += 1

    # ---------------------------------------------------------------- state
    @property
    def state(self) -> Any:
        return self.node.state

    @property
    def phase(self) -> Phase:
        return self.node.state.phase

    def proc(self, local_rank: int) -> WorkerProcess:
        return self.procs.workers[local_rank]

    def ident(self, local_rank: int) -> bytes:
        """The monitor socket's identity of the rank's process, as the runtime names it (protocol.py)."""
        proc = self.proc(local_rank)
        return P.worker_identity(P.MONITOR_CHANNEL, proc.rank, proc.pid)

    # ---------------------------------------------------------------- driving the loop
    def start(self) -> "Harness":
        self.node.start()
        return self

    def tick(self, seconds: float = 0.0) -> None:
        """Time passes; the loop's periodic work runs."""
        self.clock.advance(seconds)
        self.node.tick()

    def exit(self, local_rank: int, code: int) -> None:
        """Worker `local_rank` exits with `code` (a Popen return code: -9 for SIGKILL)."""
        proc = self.proc(local_rank)
        proc.popen.returncode = code
        proc.returncode = code
        self.node.on_exit(proc)

    def settle(self) -> None:
        """Workers that were signalled end (when they obey signals, or on SIGKILL), then the loop ticks."""
        while True:
            pending, self.procs.pending = self.procs.pending, []
            ended = False
            for proc, sig in pending:
                current = self.procs.workers.get(proc.local_rank) is proc
                if proc.alive and current and (self.obey or sig == signal.SIGKILL):
                    self.exit(proc.local_rank, -sig)
                    ended = True
            self.node.tick()
            if not ended and not self.procs.pending:
                return

    def sync(self) -> None:
        """What the store watcher thread would post: a new generation, the job's failure."""
        gen = self.coord.generation()
        if gen != self._seen_gen:
            self._seen_gen = gen
            self.node.on_posted(("generation", gen))
        failed = self.coord.failure()
        if failed is not None and not self._failure_sent:
            self._failure_sent = True
            self.node.on_posted(("failed", failed))

    # ---------------------------------------------------------------- messages from the workers
    def send(self, local_rank: int, msg: P._Msg) -> None:
        self.node.on_message(self.ident(local_rank), msg)

    def _who(self, local_rank: int) -> dict[str, int]:
        return {"rank": self.proc(local_rank).rank, "pid": self.proc(local_rank).pid}

    def hello(self, local_rank: int, generation: Optional[int] = None) -> None:
        gen = self.proc(local_rank).generation if generation is None else generation
        self.send(local_rank, P.Hello(local_rank=local_rank, generation=gen, **self._who(local_rank)))

    def hello_all(self) -> None:
        for lr in sorted(self.procs.workers):
            self.hello(lr)

    def fault(self, local_rank: int, generation: int, *, secondary: bool = False, retryable: bool = True,
              exit_code: int = 1, step: Optional[int] = None, exc: str = "RuntimeError", summary: str = "boom") -> None:
        self.send(local_rank, P.Fault(generation=generation, exc_type=exc, summary=summary, secondary=secondary,
                                      retryable=retryable, exit_code=exit_code, step=step, **self._who(local_rank)))

    def ready(self, local_rank: int, generation: int) -> None:
        self.send(local_rank, P.Ready(generation=generation, **self._who(local_rank)))

    def ready_all(self, generation: int) -> None:
        for lr in sorted(self.procs.workers):
            self.ready(lr, generation)

    def done(self, local_rank: int, generation: int) -> None:
        self.send(local_rank, P.Done(generation=generation, **self._who(local_rank)))

    def beat(self, local_rank: int, generation: int, step: int, seq: int, state: str = "running") -> None:
        self.send(local_rank, P.Heartbeat(generation=generation, step=step, seq=seq, state=state,
                                          **self._who(local_rank)))


def job(nnodes: int, **overrides: Any) -> list[Harness]:
    """`nnodes` nodes of one job on one in-memory store, each with its own clock."""
    store = shared_store()
    cfg = config(nnodes=nnodes, **overrides)
    return [Harness(cfg, node_rank=n, store=store) for n in range(nnodes)]
