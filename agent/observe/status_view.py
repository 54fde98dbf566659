"""What `GET /status` shows and `/readyz` goes by (`--metrics-port`, docs/monitoring.md): this node's picture of the
job, rebuilt from the agent's event records.

An EventSink (agent/ports.py) on the EventLog, like the Kubernetes reporter and the metrics: `write` runs on the
agent's loop thread and only updates a few fields under a lock (no I/O), `snapshot` runs on the HTTP server's
thread. Why from the event records and not from the Node: the server's thread must never read the state machine
while the loop changes it, and the records already say everything an operator asks first - which generation,
which phase, which ranks with which pids, and what the last fault was and where its recovery's time went.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Mapping, Optional

from hyperpodrun.agent.observe.k8s_report import TABLE

log = logging.getLogger("hyperpodrun.agent")

#: event records that set the phase beyond the Kubernetes reporter's table (agent/observe/k8s_report.py)
MORE_PHASES = {"signal": "stopping", "api_stop": "stopping", "agent_exit": "stopped"}
#: the records of a recovery that its timeline lists (the fault first)
TIMELINE_EVENTS = frozenset({
    "fault", "restart_signal", "kill", "respawn", "rank_ready", "barrier_complete", "go", "state_restored",
    "first_step", "restart_begin", "restart_remote", "workers_stopped", "workers_started", "restart_done",
    "inprocess_timeout", "fault_folded", "node_lost", "node_replaced", "gpu_fault", "job_failed"})
#: the most records one timeline keeps (a round that folds many faults stays readable)
MAX_TIMELINE = 64
#: records that start a recovery's timeline
FAULTS = frozenset({"fault", "node_lost"})


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class JobStatus:
    """This node's view of the job from its event records (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed = False
        self.phase = "starting"
        self.generation: Optional[int] = None
        self.node: Optional[int] = None
        self.host: Optional[str] = None
        self.pids: dict[int, int] = {}            # global rank -> pid of its live worker
        self.restarts = {"inprocess": 0, "process": 0}
        self.exit_code: Optional[int] = None
        self.last_fault: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ the loop thread
    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        """Fold one record into the view (cheap, no I/O: it runs in the middle of a restart round). A record it
        cannot fold is logged once and skipped: the status page is never worth a stopped agent."""
        try:
            self._fold(record, message)
        except Exception:   # noqa: BLE001 (any bug here must not reach the loop that runs the job)
            if not self._failed:
                self._failed = True
                log.warning("status API: a %s record could not be read; /status may be incomplete (the job is "
                            "not affected)", record.get("event"), exc_info=True)

    def _fold(self, record: Mapping[str, Any], message: str) -> None:
        event = str(record.get("event"))
        with self._lock:
            self.host = str(record.get("host")) if record.get("host") is not None else self.host
            if isinstance(record.get("node"), int):
                self.node = record["node"]
            phase = TABLE[event][0] if event in TABLE else MORE_PHASES.get(event)
            if phase is not None:
                self.phase = phase
            if event in ("workers_started", "go", "restart_done") and isinstance(record.get("generation"), int):
                self.generation = record["generation"]
            rank, pid = record.get("rank"), record.get("pid")
            if event in ("worker_start", "respawn") and isinstance(rank, int) and isinstance(pid, int):
                self.pids[rank] = pid
            elif event == "worker_exit" and isinstance(rank, int) and self.pids.get(rank) == pid:
                del self.pids[rank]
            if event == "restart_signal":
                self.restarts["inprocess"] += 1
            elif event in ("restart_begin", "restart_remote"):
                self.restarts["process"] += 1
            if isinstance(record.get("exit_code"), int) and event in ("job_done", "job_failed", "agent_exit",
                                                                     "api_stop", "fenced", "job_failed_remote"):
                self.exit_code = record["exit_code"]
            self._timeline(event, record, message)

    def _timeline(self, event: str, record: Mapping[str, Any], message: str) -> None:
        ts = _num(record.get("ts")) or 0.0
        fault = self.last_fault
        if event in FAULTS and not (fault is not None and fault["recovered_s"] is None and event == "fault"
                                    and fault.get("generation") == record.get("generation")):
            summary = record.get("root_cause") or message or record.get("msg") or event
            self.last_fault = fault = {
                "event": event, "at": ts, "rank": record.get("rank"), "node": record.get("node"),
                "generation": record.get("generation"), "step": record.get("step"),
                "summary": summary, "root_cause": summary, "recovered_s": None, "first_step_s": None, "timeline": []}
        if fault is None or event not in TIMELINE_EVENTS or len(fault["timeline"]) >= MAX_TIMELINE:
            return
        entry: dict[str, Any] = {"event": event, "after_s": round(ts - fault["at"], 6)}
        for key in ("rank", "pid", "generation", "step", "duration_s", "downtime_s"):
            if record.get(key) is not None:
                entry[key] = record[key]
        fault["timeline"].append(entry)
        downtime = _num(record.get("downtime_s"))
        if event in ("go", "restart_done") and fault["recovered_s"] is None:
            fault["recovered_s"] = downtime if downtime is not None else entry["after_s"]
            if record.get("root_cause"):   # what the round settled on: the first report may have been a symptom
                fault["root_cause"] = record["root_cause"]
        elif event == "first_step" and fault["first_step_s"] is None:
            fault["first_step_s"] = downtime if downtime is not None else entry["after_s"]

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ the server's thread
    @property
    def ready(self) -> bool:
        """`/readyz`: this node's workers are running (started, not in a restart round, not ending)."""
        with self._lock:
            return self.phase == "running" and bool(self.pids)

    def snapshot(self) -> dict[str, Any]:
        """`GET /status`: a copy that the loop thread does not change afterwards."""
        with self._lock:
            fault = None
            if self.last_fault is not None:
                fault = {**self.last_fault, "timeline": [dict(e) for e in self.last_fault["timeline"]]}
            return {"host": self.host, "node": self.node, "generation": self.generation, "phase": self.phase,
                    "ready": self.phase == "running" and bool(self.pids),
                    "ranks": [{"rank": r, "pid": p} for r, p in sorted(self.pids.items())],
                    "restarts": dict(self.restarts), "exit_code": self.exit_code, "last_fault": fault}
