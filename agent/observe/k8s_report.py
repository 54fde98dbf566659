"""`--k8s-report`: the agent's event records told to Kubernetes, so that `kubectl describe pod` tells the story of
a recovery and `kubectl get pod -o yaml` shows where the job stands (docs/kubernetes.md).

An EventSink (agent/ports.py) on the EventLog. Each record the table below names becomes pod annotations
(`hyperpodrun.io/generation`, `/phase`, `/last-recovery-s`) and/or one core/v1 Event about the pod.

Why a thread, a bounded queue and a rate limit: the EventLog's sinks are called on the agent's loop thread,
in the middle of a restart round, and the API server may be slow, failing or gone. `write` only maps the record
and queues it (no I/O); one daemon thread makes the calls, one at a time with short timeouts
(agent/observe/k8s_api.py) and at most `rate` per second. The queue of Events is bounded: when it is full
the oldest Event is dropped and counted. Annotations are not queued: the thread sends the newest values
(one patch carries all three), so a backlog never holds stale phases. A failed call is counted, logged once,
and not retried. `close` gives the thread `flush_s` to send what is left (the final phase), then leaves it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

log = logging.getLogger("hyperpodrun.agent")

ANNOTATION_PREFIX = "hyperpodrun.io/"
GENERATION = ANNOTATION_PREFIX + "generation"
PHASE = ANNOTATION_PREFIX + "phase"
LAST_RECOVERY = ANNOTATION_PREFIX + "last-recovery-s"

NORMAL, WARNING = "Normal", "Warning"

#: event record -> (phase it sets or None, Event type and reason or None)
TABLE: dict[str, tuple[Optional[str], Optional[tuple[str, str]]]] = {
    "agent_start": ("starting", None),
    "spare_waiting": ("spare", (NORMAL, "HotSpare")),
    "workers_started": ("running", None),
    "fault": ("restarting", (WARNING, "Fault")),
    "fault_fatal": (None, (WARNING, "Fault")),
    "restart_begin": ("restarting", (WARNING, "ProcessRestart")),
    "restart_signal": ("restarting", (NORMAL, "InProcessRestart")),
    "kill": (None, (WARNING, "RankKilled")),
    "respawn": (None, (NORMAL, "RankRespawned")),
    "inprocess_timeout": (None, (WARNING, "RoundEscalated")),
    "go": ("running", (NORMAL, "Recovered")),
    "restart_done": ("running", (NORMAL, "Recovered")),
    "node_lost": ("restarting", (WARNING, "NodeLost")),
    "node_replaced": (None, (NORMAL, "NodeReplaced")),
    "replacing": (None, (NORMAL, "ReplacingNode")),
    "job_shrunk": (None, (NORMAL, "JobShrunk")),
    "node_admitted": (None, (NORMAL, "NodeAdmitted")),
    "gpu_fault": (None, (WARNING, "GpuFault")),
    "gpu_remap": (None, (NORMAL, "GpuRemapped")),
    "no_usable_gpu": ("failed", (WARNING, "NoUsableGpu")),
    "step_keeps_failing": ("failed", (WARNING, "StepKeepsFailing")),
    "not_replaced": ("failed", (WARNING, "NodeNotReplaced")),
    "fenced": ("failed", (WARNING, "Fenced")),
    "store_lost": ("failed", (WARNING, "CoordinationStoreLost")),
    "agent_error": ("failed", (WARNING, "AgentError")),
    "job_failed": ("failed", (WARNING, "JobFailed")),
    "job_failed_remote": ("failed", (WARNING, "JobFailed")),
    "job_done": ("succeeded", (NORMAL, "JobSucceeded")),
}


@dataclass(frozen=True)
class Report:
    """What one record changes: annotations to set, and the Event to post (type, reason, message) if any."""

    annotations: dict[str, str] = field(default_factory=dict)
    event: Optional[tuple[str, str, str]] = None


def report_of(record: Mapping[str, Any], message: str = "") -> Optional[Report]:
    """The Report of one event record (None: Kubernetes is not told about it)."""
    entry = TABLE.get(str(record.get("event")))
    if entry is None:
        return None
    phase, event = entry
    annotations: dict[str, str] = {}
    if phase is not None:
        annotations[PHASE] = phase
    if phase in ("running", "restarting") and isinstance(record.get("generation"), int):
        annotations[GENERATION] = str(record["generation"])
    downtime = record.get("downtime_s")
    if record.get("event") in ("go", "restart_done") and isinstance(downtime, (int, float)):
        annotations[LAST_RECOVERY] = f"{downtime:.3f}"
    text = message or str(record.get("msg") or record.get("event"))
    return Report(annotations, (event[0], event[1], text) if event else None)


class PodCalls(Protocol):
    """The calls the reporter makes (agent/observe/k8s_api.py, PodApi)."""

    def annotate(self, annotations: Mapping[str, str]) -> None: ...

    def post_event(self, kind: str, reason: str, message: str) -> None: ...

    def close(self) -> None: ...


class TokenBucket:
    """At most `rate` calls per second on average, `burst` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self._clock = rate, float(burst), clock
        self._tokens, self._at = float(burst), clock()

    def delay(self) -> float:
        """Seconds to wait before the next call; 0 takes a token now."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate


class PodReporter:
    """The EventSink of `--k8s-report` (see the module's docstring). `sent`, `failed` and `dropped` count calls
    made, calls that failed and Events dropped from a full queue."""

    def __init__(self, api: PodCalls, *, max_queue: int = 256, rate: float = 5.0, burst: int = 20,
                 flush_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.max_queue, self.flush_s = api, max_queue, flush_s
        self._bucket = TokenBucket(rate, burst, clock)
        self._cond = threading.Condition()
        self._events: collections.deque[tuple[str, str, str]] = collections.deque()
        self._annotations: dict[str, str] = {}
        self._dirty = False
        self._closing = False
        self._wake = threading.Event()
        self.sent = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-k8s-report", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ the loop thread's side
    def write(self, record: Mapping[str, Any], level: int, message: str) -> None:
        """Map and queue; never blocks on the API server."""
        report = report_of(record, message)
        if report is None:
            return
        with self._cond:
            if report.annotations:
                self._annotations.update(report.annotations)
                self._dirty = True
            if report.event is not None:
                if len(self._events) >= self.max_queue:
                    self._events.popleft()
                    self.dropped += 1
                self._events.append(report.event)
            self._cond.notify()

    def close(self) -> None:
        """Send what is queued within `flush_s`, then leave the thread (a daemon) to its hung call, if any."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(self.flush_s)
        if self._thread.is_alive():
            self._wake.set()
        with self._cond:
            left = len(self._events) + int(self._dirty)
        if self.failed or self.dropped or left:
            log.warning("Kubernetes reporter: %d call(s) made, %d failed, %d Event(s) dropped (queue full), %d report(s) "
                        "not sent at exit", self.sent, self.failed, self.dropped, left)
        if not self._thread.is_alive():
            self.api.close()

    # ------------------------------------------------------------------------------ the reporter thread
    def _take(self) -> Optional[tuple[str, Any]]:
        with self._cond:
            while not (self._dirty or self._events or self._closing):
                self._cond.wait()
            if self._dirty:
                self._dirty = False
                return "annotate", dict(self._annotations)
            if self._events:
                return "event", self._events.popleft()
            return None   # closing, nothing left

    def _run(self) -> None:
        while True:
            item = self._take()
            if item is None:
                return
            wait = self._bucket.delay()
            while wait > 0:
                if self._wake.wait(wait):
                    return   # close gave up on the rest
                wait = self._bucket.delay()
            self._call(*item)

    def _call(self, what: str, payload: Any) -> None:
        self.sent += 1
        try:
            if what == "annotate":
                self.api.annotate(payload)
            else:
                self.api.post_event(*payload)
        except Exception as exc:   # the API client raises many kinds (HTTP, urllib3, socket): none may end the thread
            self.failed += 1
            if self.failed == 1:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("Kubernetes reporter: a call to the API server failed (%s: %s); the job is not affected, "
                            "later reports are still tried (failures are counted at exit)", type(exc).__name__,
                            first[:300])


def reporter_from_environment(host: str, loader: Optional[Callable[[str], PodCalls]] = None) -> PodReporter:
    """The reporter of this pod. `loader(host)` makes its calls; the default configures the client from the
    environment (agent/observe/k8s_api.py: in a pod, or KUBECONFIG)."""
    if loader is None:
        from hyperpodrun.agent.observe.k8s_api import pod_api_from_environment
        loader = pod_api_from_environment
    return PodReporter(loader(host))
