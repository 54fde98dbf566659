"""The agent's ports: the small interfaces its state machine talks through (docs/ARCHITECTURE.md, "Ports").

Why: the node's decisions (agent/node.py, agent/inprocess.py, agent/restart_policy.py, agent/health/gpu_health.py)
must be testable without processes, sockets or a wall clock, and the next capabilities (dynamic membership,
a coordinator off the training nodes, GPU standby workers, a metrics sink) plug in here without editing the
core. Each port is a typing.Protocol; the production implementation is named next to it, the fakes live in
tests/unit/fakes.py.

Value types of the contracts (RendezvousInfo, SpawnRequest) live here too, so that the ports module imports
nothing but the configuration and the worker record.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from hyperpodrun import netaddr, protocol as P
from hyperpodrun.agent.coordination.store_schema import FailureInfo, Layout, NodeLoss
from hyperpodrun.agent.workers.supervisor import WorkerProcess
from hyperpodrun.launch.config import LaunchConfig

#: an event a helper thread posts to the loop: ("generation", int), ("failed", FailureInfo), ("store_lost", str),
#: ("forged", str), ("output_dropped", str), ("gpu", GpuEvent)
Posted = tuple[str, Any]


# ------------------------------------------------------------------ time
class Clock(Protocol):
    """Monotonic time for deadlines and durations, wall time for records. Production: SystemClock."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The process's clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


# ------------------------------------------------------------------ events
class EventSink(Protocol):
    """Where event records go (agent/observe/events.py: the JSONL file, the console). A metrics exporter is one more
    sink added with EventLog.add_sink."""

    def write(self, record: Mapping[str, Any], level: int, message: str) -> None: ...

    def close(self) -> None: ...


class Events(Protocol):
    """Recording events (agent/observe/events.py, EventLog): `message` is the human line, `fields` the data."""

    def emit(self, event: str, message: str = "", *, level: int = ..., **fields: Any) -> dict[str, Any]: ...


# ------------------------------------------------------------------ the control plane
class ControlSender(Protocol):
    """Sends one control message to a worker (agent/control/server.py, ControlServer). False: not delivered (the
    worker is not connected, or does not read its socket)."""

    def send(self, ident: Optional[bytes], msg: P._Msg) -> bool: ...


# ------------------------------------------------------------------ stores
StoreValue = Union[str, bytes]


class KVStore(Protocol):
    """The part of torch's Store API the agents use (TCPStore, HashStore, PrefixStore)."""

    def set(self, key: str, value: StoreValue) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected_value: StoreValue, desired_value: StoreValue) -> bytes: ...

    def set_timeout(self, timeout: timedelta) -> None: ...


class StoreLink(Protocol):
    """An agent's tie to a coordination store that may go away for a while: a standalone coordinator, which may
    come back empty (agent/coordination/reconnect.py, CoordinatorLink: connections that reconnect and write the
    agent's records back by themselves), or an etcd cluster (agent/coordination/etcd_store.py, EtcdLink)."""

    where: str                               # the store's address(es), for messages
    reconnects: int                          # how many times the store came back empty and was supplied again
    post: Callable[[Posted], None]           # where "coordinator_lost" / "coordinator_back" go

    def connect(self, store: Optional[KVStore] = None) -> KVStore: ...


class WorkerStoreHost(Protocol):
    """The per-generation worker stores this agent serves (agent/coordination/stores.py, WorkerStores)."""

    def open(self, generation: int) -> int: ...

    def get(self, generation: int) -> Optional[object]: ...


# ------------------------------------------------------------------ rendezvous
@dataclass
class RendezvousInfo:
    """The outcome of a rendezvous: who this node is and how to reach the shared pieces.

    nnodes, rank_offset, world_size and nodes describe the job's current layout: they change (`adopt`) when
    an elastic job shrinks or grows (agent/coordination/layout.py); the rest is fixed for the agent's life."""

    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    run_id: str
    master_addr: str            # address the workers dial for their per-generation store
    store: KVStore              # coordination store (prefixed to this run)
    store_host: bool            # this agent hosts the coordination store and the workers' stores
    store_endpoint: Optional[tuple[str, int]]  # (host, port) for helper threads' own connections; None: local
    single_node: bool
    bind_addr: str = netaddr.LOOPBACK       # where this agent's store servers listen (netaddr.py); "": none
    secret: bytes = b""                     # the job secret (auth.py); never handed to workers
    secret_warning: str = ""                # set when the secret was agreed through the store (one warning)
    incarnation: str = ""                   # this agent's token as holder of its node rank (agent/coordination/membership.py)
    replacing: Optional[NodeLoss] = None     # set when this agent took over a lost node's rank
    counts: dict[int, int] = field(default_factory=dict)   # node rank -> its workers, every node of the job now
    admitted: Optional[Layout] = None        # set when this agent joined an elastic job as a new node
    previous_world_size: Optional[int] = None   # the world size before the newest layout change
    layout_generation: int = -1              # the generation of the layout this agent started on (-1: as formed)
    # the coordination store is a standalone coordinator (agent/coordination/coordinator.py): no agent hosts
    # it; each generation's workers' store is hosted by the agent that claims it, an elected owner watches leases
    coordinator: bool = False
    link: Optional["StoreLink"] = None      # with a coordinator: connections that survive its restart

    def __post_init__(self) -> None:
        if not self.counts:   # a fixed-size job of equal nodes (a test's or the single node's)
            self.counts = {n: self.world_size // max(1, self.nnodes) for n in range(self.nnodes)}

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node ranks of the job now, in order."""
        return tuple(sorted(self.counts))

    @property
    def group_rank(self) -> int:
        """This node's place among the job's nodes now (the workers' GROUP_RANK)."""
        return self.nodes.index(self.node_rank) if self.node_rank in self.counts else self.node_rank

    def layout(self, generation: int) -> Layout:
        """The current layout as a record, from `generation` on."""
        return Layout(generation=generation, nodes=dict(self.counts), previous_world_size=self.previous_world_size)

    def adopt(self, layout: Layout) -> None:
        """Run as `layout` says from now on (an elastic job shrank or grew: agent/coordination/layout.py)."""
        if layout.nodes == self.counts:
            return
        self.previous_world_size = self.world_size
        self.counts = dict(layout.nodes)
        self.nnodes = len(self.counts)
        self.world_size = layout.world_size
        if self.node_rank in layout.nodes:
            self.rank_offset = layout.offset(self.node_rank)


class Rendezvous(Protocol):
    """How the agents of a job meet (agent/coordination/rendezvous.py registers "local", "static" and "c10d"; a new
    backend is one more registration). `stop_requested()` is polled while waiting, so a signal ends it."""

    def join(self, cfg: LaunchConfig, stop_requested: Callable[[], bool]) -> RendezvousInfo: ...


# ------------------------------------------------------------------ job-wide coordination
@dataclass(frozen=True)
class RestartGrant:
    """The answer to a restart request: the generation to go to, whether this agent started it, whether the
    job-wide budget allows it, and the cause the restart is recorded with (the starter's)."""

    generation: int
    started: bool
    budget_ok: bool
    cause: FailureInfo


class Coordination(Protocol):
    """Job-wide state shared by the agents (agent/coordination/job_state.py, Coordinator over the coordination store)."""

    def generation(self) -> int: ...

    def request_restart(self, current: int, reason: FailureInfo, count_budget: bool = True) -> RestartGrant: ...

    def restarts_used(self) -> int: ...

    def report_failure(self, info: FailureInfo) -> FailureInfo: ...

    def failure(self) -> Optional[FailureInfo]: ...

    def publish_worker_store(self, generation: int, port: int, addr: Optional[str] = None) -> None: ...

    def claim_worker_store(self, generation: int) -> bool: ...

    def worker_store_port(self, generation: int) -> Optional[int]: ...

    def worker_store_addr(self, generation: int) -> Optional[str]: ...

    def claim_root_cause(self, generation: int, info: FailureInfo) -> None: ...

    def root_cause(self, generation: int) -> Optional[FailureInfo]: ...

    def mark_ready(self, generation: int, on: bool = True) -> None: ...

    def ready_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int: ...

    def mark_inprocess_done(self, generation: int) -> None: ...

    def inprocess_done_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int: ...

    def mark_done(self, generation: int) -> None: ...

    def done_count(self, generation: int, nodes: Optional[Sequence[int]] = None) -> int: ...

    def mark_left(self) -> None: ...

    def left_count(self, nodes: Optional[Sequence[int]] = None) -> int: ...

    def declare_lost(self, loss: NodeLoss) -> NodeLoss: ...

    def drop_lost(self, node: int, incarnation: str) -> bool: ...

    def set_layout(self, layout: Layout) -> Layout: ...

    def layout_for_round(self, target: int) -> Optional[Layout]: ...


# ------------------------------------------------------------------ workers
@dataclass(frozen=True)
class SpawnRequest:
    """One worker to start: its identity, command, environment and output descriptors (None: the agent's)."""

    local_rank: int
    rank: int
    generation: int
    argv: Sequence[str]
    env: Mapping[str, str]
    stdout: Optional[int]
    stderr: Optional[int]


class WorkerSource(Protocol):
    """Where a worker process comes from (agent/workers/sources.py): a cold spawn (a new interpreter), a warm fork
    (the zygote that has imported torch); GPU standby processes come next. `spawn` returns None when the
    source cannot serve this request now: the launcher then asks the next one."""

    name: str

    def spawn(self, req: SpawnRequest) -> Optional[WorkerProcess]: ...


class ProcessTable(Protocol):
    """The node's worker processes (agent/workers/supervisor.py, Supervisor): the live incarnation of each local rank."""

    workers: dict[int, WorkerProcess]

    def live(self) -> list[WorkerProcess]: ...

    def signal_all(self, sig: int, procs: Optional[list[WorkerProcess]] = None) -> None: ...

    def kill(self, proc: WorkerProcess) -> None: ...


class Launcher(Protocol):
    """Turns the launch config into worker processes (agent/workers/launch.py, WorkerLauncher)."""

    def spawn(self, local_rank: int, generation: int, store_port: int, warm: bool = False) -> WorkerProcess: ...

    def spawn_all(self, generation: int, store_port: int, warm: bool = False) -> None: ...

    def error_file(self, proc: WorkerProcess) -> Optional[str]: ...

    def stderr_log(self, proc: WorkerProcess) -> Optional[str]: ...

    def on_exit(self, proc: WorkerProcess) -> None: ...

    def start_warm_spawner(self) -> None: ...

    def end_warm_spawner(self) -> None: ...


# ------------------------------------------------------------------ what the policies may ask of the node
class NodeOps(Protocol):
    """The effects the in-process round and the process-level restart policy may ask for. The node
    (agent/node.py) carries each out at once, on the loop thread; the policies hold no other handle on it."""

    @property
    def workers(self) -> Mapping[int, WorkerProcess]: ...

    def spawn(self, local_rank: int, generation: int, warm: bool = False) -> WorkerProcess: ...

    def kill(self, local_rank: int) -> bool: ...

    def fail_job(self, info: FailureInfo, code: int) -> None: ...

    def escalate(self, target: int, root: FailureInfo) -> None: ...

    def open_worker_store(self, generation: int) -> None: ...

    def start_warm_spawner(self) -> None: ...

    def end_warm_spawner(self) -> None: ...

    def leave(self, code: int, message: str) -> None: ...

    def outsider(self, info: FailureInfo) -> bool: ...


class GpuOps(Protocol):
    """The effects GPU health (agent/health/gpu_health.py) may ask for; carried out by the node on the loop thread."""

    @property
    def workers(self) -> Mapping[int, WorkerProcess]: ...

    def kill(self, local_rank: int) -> bool: ...

    def fail_job(self, info: FailureInfo, code: int) -> None: ...

    def rank_fault(self, local_rank: int, info: FailureInfo) -> None: ...

    def last_step(self, local_rank: int) -> Optional[int]: ...
