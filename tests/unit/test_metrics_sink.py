"""`--metrics-port` without a job: the metrics sink and the status view fed by a real Node's own event records (on
fake ports and a fake clock, tests/unit/fakes.py), the records the core does not make here (GPU, node loss) given
by hand, the loop beat behind /healthz, the bearer token check, the HTTP server's answers on loopback, POST
/stop carried out by the loop (exit 82), and the launcher's checks of the three flags."""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from fakes import Harness, config   # noqa: E402

from hyperpodrun.agent.control.api_stop import StopRequest   # noqa: E402
from hyperpodrun.agent.observe.http_api import STUCK_AFTER_S, LoopBeat, StatusApi, StatusServer   # noqa: E402
from hyperpodrun.agent.observe.metrics import MetricsSink   # noqa: E402
from hyperpodrun.agent.observe.status_view import JobStatus   # noqa: E402
from hyperpodrun.agent.state import Phase   # noqa: E402
from hyperpodrun.errors import EXIT_API_STOP, ConfigError   # noqa: E402
from hyperpodrun.launch.host_checks import check_status_api   # noqa: E402

TOKEN = b"0123456789abcdef0123456789abcdef"


def value(sink: MetricsSink, name: str, **labels: str) -> Optional[float]:
    return sink.registry.get_sample_value(name, labels)


def observed(inprocess: bool = True) -> tuple[Harness, MetricsSink, JobStatus]:
    h = Harness(config(inprocess_restart=inprocess, max_restarts=1))
    metrics, status = MetricsSink(), JobStatus()
    h.events.add_sink(metrics)
    h.events.add_sink(status)
    h.start()
    started(h)
    return h, metrics, status


def started(h: Harness) -> None:
    """The `worker_start` record of each current worker and `workers_started`, as the real launcher writes them
    (the fake one does not)."""
    for proc in h.procs.workers.values():
        h.events.emit("worker_start", rank=proc.rank, pid=proc.pid, generation=proc.generation)
    h.events.emit("workers_started", generation=h.state.generation)


def test_an_inprocess_recovery_is_counted_from_the_node_s_own_records():
    h, m, st = observed()
    h.hello_all()
    assert value(m, "hyperpodrun_generation") == 0 and value(m, "hyperpodrun_ranks_alive") == 2
    assert st.ready and value(m, "hyperpodrun_restarts_total", kind="inprocess") == 0
    h.beat(0, 0, step=7, seq=70)
    h.beat(1, 0, step=7, seq=70)
    old = h.proc(1).pid
    h.clock.advance(0.5)
    h.exit(1, -signal.SIGKILL)                     # rank 1 dies: the round begins, rank 1 is respawned
    assert h.phase is Phase.RESTARTING and not st.ready
    h.hello(1)
    h.clock.advance(1.5)
    h.ready_all(1)
    h.tick()
    assert h.phase is Phase.RUNNING and st.ready
    go = h.sink.named("go")[0]
    assert value(m, "hyperpodrun_restarts_total", kind="inprocess") == 1
    assert value(m, "hyperpodrun_restarts_total", kind="process") == 0
    assert value(m, "hyperpodrun_generation") == 1 and value(m, "hyperpodrun_ranks_alive") == 2
    assert value(m, "hyperpodrun_recovery_seconds_count", until="go") == 1
    assert value(m, "hyperpodrun_recovery_seconds_sum", until="go") == pytest.approx(go["downtime_s"])
    assert value(m, "hyperpodrun_fault_detection_seconds_count") == 1   # the exit was seen, then the round began
    assert value(m, "hyperpodrun_recovery_seconds_count", until="first_step") == 0

    h.beat(0, 1, step=7, seq=1)                    # the step it held at GO: not a step of the new generation yet
    assert not h.sink.named("first_step")
    h.clock.advance(0.25)
    h.beat(0, 1, step=8, seq=2)
    first = h.sink.named("first_step")
    assert len(first) == 1 and first[0]["step"] == 8 and first[0]["downtime_s"] == pytest.approx(1.75)
    h.beat(1, 1, step=8, seq=2)
    assert len(h.sink.named("first_step")) == 1    # once per recovery
    assert value(m, "hyperpodrun_recovery_seconds_count", until="first_step") == 1
    assert value(m, "hyperpodrun_last_step") == 8

    snap = st.snapshot()
    assert snap["generation"] == 1 and snap["phase"] == "running" and snap["restarts"]["inprocess"] == 1
    assert [r["rank"] for r in snap["ranks"]] == [0, 1] and snap["ranks"][1]["pid"] == h.proc(1).pid != old
    fault = snap["last_fault"]
    assert fault["rank"] == 1 and fault["recovered_s"] == pytest.approx(go["downtime_s"])
    assert fault["root_cause"] == go["root_cause"] and "rank 1" in fault["root_cause"]
    assert fault["first_step_s"] == pytest.approx(1.75)
    events = [e["event"] for e in fault["timeline"]]
    assert events[0] == "fault" and events.index("go") < events.index("first_step"), events
    assert json.loads(json.dumps(snap)) == snap    # what GET /status sends


def test_a_process_level_restart_is_counted_by_its_kind():
    h, m, st = observed(inprocess=False)
    h.exit(1, 1)
    h.settle()
    started(h)
    assert h.state.generation == 1 and h.phase is Phase.RUNNING
    assert value(m, "hyperpodrun_restarts_total", kind="process") == 1
    assert value(m, "hyperpodrun_restarts_total", kind="inprocess") == 0
    assert value(m, "hyperpodrun_recovery_seconds_count", until="go") == 1   # restart_done: every worker back
    assert value(m, "hyperpodrun_generation") == 1 and value(m, "hyperpodrun_ranks_alive") == 2
    assert st.snapshot()["restarts"] == {"inprocess": 0, "process": 1}


def test_gpu_events_by_xid_node_losses_and_the_exit_code():
    m, st = MetricsSink(), JobStatus()
    for rec in ({"event": "gpu_event", "xid": 79}, {"event": "gpu_fault", "xid": 79}, {"event": "gpu_event"},
                {"event": "node_lost", "node": 1, "generation": 3}, {"event": "job_failed", "exit_code": 77}):
        m.write({"ts": 1.0, **rec}, 0, "")
        st.write({"ts": 1.0, **rec}, 0, "")
    assert value(m, "hyperpodrun_gpu_events_total", xid="79") == 2
    assert value(m, "hyperpodrun_gpu_events_total", xid="none") == 1
    assert value(m, "hyperpodrun_node_losses_total") == 1
    assert value(m, "hyperpodrun_exit_code") == 77
    snap = st.snapshot()
    assert snap["phase"] == "failed" and snap["exit_code"] == 77 and snap["last_fault"]["event"] == "node_lost"


def test_last_step_is_read_from_the_ranks_when_scraped():
    m = MetricsSink()
    assert value(m, "hyperpodrun_last_step") == -1
    steps: list[Any] = [3, None, 12]
    m.read_steps(lambda: steps)
    assert value(m, "hyperpodrun_last_step") == 12

    def changing() -> list[int]:
        raise RuntimeError("dictionary changed size during iteration")
    m.read_steps(changing)                         # the loop changed the ranks meanwhile: the events' best
    assert value(m, "hyperpodrun_last_step") == -1


def test_healthz_fails_only_for_a_loop_that_stopped_coming_round():
    now = [0.0]
    beat = LoopBeat(monitor_interval=1.0, clock=lambda: now[0])
    assert beat.stuck_for() is None                # before the loop: rendezvous, pre-train hook
    beat.beat()
    now[0] = STUCK_AFTER_S + 1.0                   # within the limit (two monitor intervals more)
    assert beat.stuck_for() is None
    now[0] = STUCK_AFTER_S + 3.0
    assert beat.stuck_for() == pytest.approx(STUCK_AFTER_S + 3.0)
    beat.leave()                                   # the loop ended (post-train hook, cleanup): not stuck
    assert beat.stuck_for() is None


def test_the_bearer_token_is_checked():
    api = StatusApi(None, None, LoopBeat(), TOKEN, lambda: None)
    assert api.authorized("Bearer " + TOKEN.decode()) and api.authorized("bearer " + TOKEN.decode())
    for header in (None, "", "Bearer", "Bearer wrong", "Basic " + TOKEN.decode(), "Bearer " + TOKEN.decode()[:-1]):
        assert not api.authorized(header), header
    assert not StatusApi(None, None, LoopBeat(), None, lambda: None).authorized("Bearer ")


class _Server:
    def __init__(self, token: Optional[bytes]) -> None:
        self.stops = 0
        self.beat = LoopBeat(clock=lambda: self.now)
        self.now = 0.0
        self.metrics, self.status = MetricsSink(), JobStatus()
        self.server = StatusServer("127.0.0.1", 0, StatusApi(self.metrics, self.status, self.beat, token, self.stop))
        self.port = self.server.address[1]

    def stop(self) -> int:
        self.stops += 1
        return EXIT_API_STOP

    def call(self, path: str, method: str = "GET", auth: Optional[str] = None) -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=b"" if method == "POST" else None)
        if auth is not None:
            req.add_header("Authorization", auth)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@pytest.fixture
def server(request):
    srv = _Server(getattr(request, "param", TOKEN))
    yield srv
    srv.server.close(wait=True)


def test_the_server_answers_each_path(server):
    code, text = server.call("/metrics")
    assert code == 200 and "hyperpodrun_restarts_total" in text and "hyperpodrun_build_info" in text
    assert server.call("/healthz") == (200, "ok\n")
    assert server.call("/readyz")[0] == 503        # no worker yet
    server.status.write({"event": "worker_start", "rank": 0, "pid": 42, "ts": 1.0}, 0, "")
    server.status.write({"event": "workers_started", "generation": 0, "ts": 1.0}, 0, "")
    assert server.call("/readyz")[0] == 200
    code, body = server.call("/status")
    assert code == 200 and json.loads(body)["ranks"] == [{"rank": 0, "pid": 42}]
    assert server.call("/nowhere")[0] == 404 and server.call("/status", "PUT")[0] == 405
    server.beat.beat()
    server.now = STUCK_AFTER_S + 10
    code, text = server.call("/healthz")
    assert code == 503 and "has not come round" in text


def test_post_stop_needs_the_token(server):
    assert server.call("/stop", "POST")[0] == 401
    assert server.call("/stop", "POST", "Bearer " + "x" * 32)[0] == 401
    assert server.call("/stop", "POST", TOKEN.decode())[0] == 401          # no scheme
    big = urllib.request.Request(f"http://127.0.0.1:{server.port}/stop", data=b"x" * 5000, method="POST",
                                 headers={"Authorization": "Bearer " + TOKEN.decode()})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(big, timeout=5)
    assert refused.value.code == 413                                        # the token does not excuse a body
    assert server.stops == 0                                                # nothing changed
    code, body = server.call("/stop", "POST", "Bearer " + TOKEN.decode())
    assert code == 202 and json.loads(body) == {"stopping": True, "exit_code": EXIT_API_STOP} and server.stops == 1


@pytest.mark.parametrize("server", [None], indirect=True)
def test_without_a_token_file_mutating_calls_are_refused(server):
    assert server.call("/stop", "POST", "Bearer " + TOKEN.decode())[0] == 403
    assert server.call("/stop", "POST")[0] == 403 and server.stops == 0


def test_a_stop_request_is_carried_out_by_the_loop_with_its_exit_code():
    h, m, st = observed()
    h.hello_all()
    woken: list[int] = []
    req = StopRequest(lambda: woken.append(1))
    req.carry_out(h.node, h.events, signal.SIGTERM)             # not asked for: nothing
    assert h.phase is Phase.RUNNING
    assert req.request() == EXIT_API_STOP and woken == [1] and h.phase is Phase.RUNNING   # only the flag
    req.carry_out(h.node, h.events, signal.SIGTERM)
    assert h.phase is Phase.STOPPING and h.sink.named("api_stop")[0]["exit_code"] == EXIT_API_STOP
    assert st.snapshot()["phase"] == "stopping" and not st.ready
    h.settle()
    assert h.node.done and h.state.exit_code == EXIT_API_STOP and h.state.stopped_by_signal is None
    assert value(m, "hyperpodrun_exit_code") == EXIT_API_STOP
    req.carry_out(h.node, h.events, signal.SIGTERM)             # once
    assert len(h.sink.named("api_stop")) == 1


def test_the_launcher_checks_the_three_flags(tmp_path: Path):
    check_status_api(None, "127.0.0.1", None)                   # off: nothing to check
    with pytest.raises(ConfigError, match="--api-token-file needs --metrics-port"):
        check_status_api(None, "127.0.0.1", str(tmp_path / "token"))
    with pytest.raises(ConfigError, match="cannot listen there"):
        check_status_api(9100, "no-such-host.invalid", None)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match=r"--api-token-file .* the token has 3 bytes"):
        check_status_api(_free_port(), "127.0.0.1", str(short))
    open_to_all = tmp_path / "open"
    open_to_all.write_text(TOKEN.decode())
    os.chmod(open_to_all, 0o666)
    with pytest.raises(ConfigError, match="writable by every user"):
        check_status_api(_free_port(), "127.0.0.1", str(open_to_all))
    good = tmp_path / "good"
    good.write_text(TOKEN.decode() + "\n")
    os.chmod(good, 0o600)
    check_status_api(_free_port(), "127.0.0.1", str(good))


def test_without_prometheus_client_the_launch_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)   # `import` raises ImportError
    with pytest.raises(ConfigError, match=r"--metrics-port needs the prometheus-client package: pip install "
                                          r"'hyperpodrun\[metrics\]'"):
        check_status_api(_free_port(), "127.0.0.1", None)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Broken(dict):
    """A record whose `rank` cannot be read (a bug in a sink's reading, as far as the sink can tell)."""

    def get(self, key, default=None):
        if key == "rank":
            raise RuntimeError("unreadable")
        return super().get(key, default)


def test_a_record_the_sinks_cannot_read_never_reaches_the_loop(caplog):
    m, st = MetricsSink(), JobStatus()
    for _ in range(2):
        for sink in (m, st):
            sink.write(_Broken(event="worker_start", rank=0, pid=1, ts=1.0), 0, "")   # no exception
    warned = [r for r in caplog.records if "could not be" in r.getMessage()]
    assert len(warned) == 2, warned                                   # once per sink
    for sink in (m, st):
        sink.write({"event": "worker_start", "rank": 0, "pid": 1, "ts": 1.0}, 0, "")
    assert value(m, "hyperpodrun_ranks_alive") == 1 and st.snapshot()["ranks"] == [{"rank": 0, "pid": 1}]
