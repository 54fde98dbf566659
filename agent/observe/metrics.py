"""`--metrics-port`: the agent's event records as Prometheus metrics (docs/monitoring.md lists each one).

An EventSink (agent/ports.py) on the EventLog, like the Kubernetes reporter: the core emits its records as it
always does and this sink turns them into counters, gauges and histograms - no metric call is made anywhere
else. `write` runs on the agent's loop thread in the middle of a restart round, so it only updates
prometheus-client's in-memory values (thread-safe, no I/O); the HTTP server (agent/observe/http_api.py) renders
them from its own thread. The registry is this sink's own, not the process-wide default one, so that nothing
else a process imports ends up on the page and two agents in one test process do not collide.

No label names a rank or a pid: a job of thousands of ranks would make thousands of series per metric. The
labels are bounded sets: the restart kind, the recovery's end point, the GPU's XID.
"""
from __future__ import annotations

import logging
import platform
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from hyperpodrun import __version__

log = logging.getLogger("hyperpodrun.agent")

#: recovery and detection times, seconds: in-process rounds take 1-10 s, process-level restarts 10-300 s
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: event record -> the `kind` of hyperpodrun_restarts_total it counts
RESTART_KINDS = {"restart_signal": "inprocess", "restart_begin": "process", "restart_remote": "process"}


def _seconds(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


class MetricsSink:
    """The EventSink of `--metrics-port` (see the module's docstring). `steps` (optional, set once the workers'
    state is known): the steps the ranks last reported, read when /metrics is scraped."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = reg = registry or CollectorRegistry()
        self.restarts = Counter("hyperpodrun_restarts", "Restarts this agent took part in, by kind (inprocess: a "
                                "round of in-process restarts; process: every worker stopped and started again)",
                                ["kind"], registry=reg)
        for kind in sorted(set(RESTART_KINDS.values())):
            self.restarts.labels(kind=kind)   # 0 from the start: a rate() needs the series before the first one
        self.faults = Counter("hyperpodrun_faults", "Faults this agent began a recovery for", registry=reg)
        self.generation = Gauge("hyperpodrun_generation", "The job's generation on this node (0 at start, +1 per "
                                "restart)", registry=reg)
        self.ranks_alive = Gauge("hyperpodrun_ranks_alive", "This node's worker processes that are alive",
                                 registry=reg)
        self.recovery = Histogram("hyperpodrun_recovery_seconds", "From a fault's detection to GO (in-process) or "
                                  "to every worker respawned (process-level), until=\"go\"; and to the first step "
                                  "a rank reported after it, until=\"first_step\"", ["until"], buckets=BUCKETS,
                                  registry=reg)
        for until in ("go", "first_step"):
            self.recovery.labels(until=until)
        self.detection = Histogram("hyperpodrun_fault_detection_seconds", "From a worker's failed exit, as the agent "
                                   "saw it, to the start of the recovery", buckets=BUCKETS, registry=reg)
        self.node_losses = Counter("hyperpodrun_node_losses", "Other nodes this agent saw declared lost",
                                   registry=reg)
        self.gpu_events = Counter("hyperpodrun_gpu_events", "GPU health events, by XID (xid=\"none\": ECC, row "
                                  "remapping, a lost GPU and other events that are not an XID)", ["xid"], registry=reg)
        self.last_step = Gauge("hyperpodrun_last_step", "The highest training step this node's ranks reported "
                               "(-1: none yet)", registry=reg)
        self.exit_code = Gauge("hyperpodrun_exit_code", "The agent's exit code once it is final (-1 until then)",
                               registry=reg)
        self.exit_code.set(-1)
        Info("hyperpodrun_build", "The hyperpodrun that runs this agent", registry=reg).info(
            {"version": __version__, "python": platform.python_version(), "torch": _torch_version()})
        self._lock = threading.Lock()
        self._failed = False
        self._step_seen = -1
        self._steps: Optional[Callable[[], Iterable[Optional[int]]]] = None
        self._alive: dict[int, int] = {}
        self._phase_running = False
        self._failed_exit_at: Optional[float] = None
        self.last_step.set_function(self._last_step)

    def read_steps(self, steps: Callable[[], Iterable[Optional[int]]]) -> None:
        """Where the ranks' last reported steps are read at scrape time (the in-process round's rank states)."""
        self._steps = steps

    def _last_step(self) -> float:
        best = self._step_seen
        if self._steps is not None:
            try:
                best = max([best, *(s for s in self._steps() if isinstance(s, int))])
            except RuntimeError:   # the loop thread changed the ranks while this thread read them: next scrape
                pass
        return float(best)

    # ------------------------------------------------------------------ the loop thread
    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        """Count one record (cheap, no I/O). A record it cannot count is logged once and skipped: a metric is
        never worth a stopped agent."""
        try:
            self._count(record)
        except Exception:   # noqa: BLE001 (any bug here must not reach the loop that runs the job)
            if not self._failed:
                self._failed = True
                log.warning("metrics: a %s record could not be counted; metrics may be incomplete (the job is "
                            "not affected)", record.get("event"), exc_info=True)

    def _count(self, record: Mapping[str, Any]) -> None:
        event = str(record.get("event"))
        ts = _seconds(record.get("ts"))
        with self._lock:
            if isinstance(record.get("step"), int):
                self._step_seen = max(self._step_seen, record["step"])
            if event in RESTART_KINDS:
                self.restarts.labels(kind=RESTART_KINDS[event]).inc()
            elif event in ("workers_started", "go", "restart_done") and isinstance(record.get("generation"), int):
                self.generation.set(record["generation"])
            self._track_ranks(event, record)
            if event in ("go", "restart_done"):
                self._observe(self.recovery.labels(until="go"), record.get("downtime_s"))
            elif event == "first_step":
                self._observe(self.recovery.labels(until="first_step"), record.get("downtime_s"))
            elif event == "fault":
                self.faults.inc()
                if self._failed_exit_at is not None and ts is not None:
                    self._observe(self.detection, ts - self._failed_exit_at)
                self._failed_exit_at = None
            elif event == "node_lost":
                self.node_losses.inc()
            elif event in ("gpu_event", "gpu_fault"):
                self.gpu_events.labels(xid=str(record.get("xid", "none"))).inc()
            if isinstance(record.get("exit_code"), int) and event in ("job_done", "job_failed", "agent_exit",
                                                                     "api_stop", "fenced"):
                self.exit_code.set(record["exit_code"])

    def _track_ranks(self, event: str, record: Mapping[str, Any]) -> None:
        rank, pid = record.get("rank"), record.get("pid")
        if event in ("workers_started", "go", "restart_done"):
            self._phase_running = True
        elif event in ("restart_begin", "restart_signal", "signal", "api_stop", "job_failed", "job_done"):
            self._phase_running = False
        if event in ("worker_start", "respawn") and isinstance(rank, int) and isinstance(pid, int):
            self._alive[rank] = pid
        elif event == "worker_exit" and isinstance(rank, int) and self._alive.get(rank) == pid:
            del self._alive[rank]
            code = record.get("exit_code")
            if self._phase_running and isinstance(code, int) and code != 0 and self._failed_exit_at is None:
                self._failed_exit_at = _seconds(record.get("ts"))
        self.ranks_alive.set(len(self._alive))

    @staticmethod
    def _observe(metric: Any, seconds: Any) -> None:
        value = _seconds(seconds)
        if value is not None:
            metric.observe(value)

    def close(self) -> None:
        pass


def _torch_version() -> str:
    """torch's version when the agent has imported it (it has, before any worker starts); never an import here."""
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "")) if torch is not None else ""
