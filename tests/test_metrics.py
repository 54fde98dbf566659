"""`--metrics-port`: a real in-process recovery seen through the agent's HTTP server - Prometheus metrics, the
probes, the status API, and POST /stop with and without the bearer token of --api-token-file.

One job of 2 gloo workers (tests/scripts/inproc_train.py) that trains until it is stopped: rank 1 is SIGKILLed,
the round recovers, then the status API stops the job. Every wait is on a condition with a deadline."""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from typing import Any, Optional

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families   # noqa: E402

from conftest import free_port, wait_until   # noqa: E402
from inprocess_helpers import FAST, Job, events_named   # noqa: E402

from hyperpodrun.errors import EXIT_API_STOP   # noqa: E402

TOKEN = "0123456789abcdef0123456789abcdef"


def http(port: int, path: str, method: str = "GET", token: Optional[str] = None) -> tuple[int, str]:
    """(status, body) of one request to the agent's server on loopback."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def samples(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, parsed as Prometheus text: (name, labels) -> value."""
    code, text = http(port, "/metrics")
    assert code == 200, (code, text)
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(found: dict[tuple[str, frozenset], float], name: str, **labels: str) -> Any:
    return found.get((name, frozenset(labels.items())))


def test_metrics_probes_status_and_stop_through_one_recovery(launcher, out_dir, tmp_path):
    port = free_port()
    token_file = tmp_path / "api-token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    job = Job(launcher, out_dir, [*FAST, "--metrics-port", str(port), "--api-token-file", str(token_file)],
              ["--steps", "1000000", "--forever-cap", "60"], nproc=2,
              env={"HYPERPODRUN_WARM_RESPAWN": "0"})   # no zygote importing torch beside the 2 ranks on 2 cores

    job.wait_for(lambda: http(port, "/healthz")[0] == 200, 60, "/healthz answers 200")
    before = samples(port)
    assert value(before, "hyperpodrun_restarts_total", kind="inprocess") == 0
    assert value(before, "hyperpodrun_build_info", version=__import__("hyperpodrun").__version__,
                 python=__import__("platform").python_version(),
                 torch=__import__("torch").__version__) == 1, before

    started = job.wait_step(range(2), step=10)
    os.kill(started[1], signal.SIGKILL)
    job.wait_event("go", generation=1)
    job.wait_event("first_step", generation=1)

    def recovered() -> Optional[dict]:
        found = samples(port)
        return found if value(found, "hyperpodrun_recovery_seconds_count", until="first_step") == 1 else None
    found = job.wait_for(recovered, 30, "the recovery counted in /metrics")
    assert value(found, "hyperpodrun_restarts_total", kind="inprocess") == 1, found
    assert value(found, "hyperpodrun_restarts_total", kind="process") == 0, found
    assert value(found, "hyperpodrun_recovery_seconds_count", until="go") == 1, found
    go = events_named(job.log_dir, "go")[0]
    assert value(found, "hyperpodrun_recovery_seconds_sum", until="go") == pytest.approx(go["downtime_s"], abs=1e-3)
    assert value(found, "hyperpodrun_generation") == 1, found
    assert value(found, "hyperpodrun_faults_total") == 1, found
    # 1 when the agent saw rank 1's exit before any report of the fault (the usual order; tests/unit covers it)
    assert value(found, "hyperpodrun_fault_detection_seconds_count") in (0, 1), found
    # the ranks' latest step: generation 1 of this script trains from step 0 again, so the first scrape after the
    # first_step record may still read 0 - wait for the step to move on
    job.wait_for(lambda: (value(samples(port), "hyperpodrun_last_step") or -1) >= 1, 30,
                 "hyperpodrun_last_step >= 1 once the ranks train again")
    assert not any("rank" in dict(labels) or "pid" in dict(labels) for _, labels in found), "no per-rank labels"

    job.wait_for(lambda: http(port, "/readyz")[0] == 200, 30, "/readyz 200 once the workers run again")
    assert http(port, "/healthz")[0] == 200
    wait_until(lambda: value(samples(port), "hyperpodrun_ranks_alive") == 2, 30, message="2 ranks alive")
    code, body = http(port, "/status")
    status = json.loads(body)
    assert code == 200 and status["generation"] == 1 and status["phase"] == "running", status
    assert [r["rank"] for r in status["ranks"]] == [0, 1] and status["ranks"][0]["pid"] == started[0], status
    assert status["ranks"][1]["pid"] != started[1], "rank 1 runs in its replacement"
    fault = status["last_fault"]
    assert "rank 1" in fault["root_cause"] and "SIGKILL" in fault["root_cause"], fault
    assert fault["recovered_s"] == pytest.approx(go["downtime_s"], abs=1e-3), fault
    steps = [e["event"] for e in fault["timeline"]]
    assert steps[0] == "fault" and "go" in steps and steps.index("go") < steps.index("first_step"), steps

    # mutating calls: no token, a wrong one -> 401 and the job goes on untouched
    assert http(port, "/stop", "POST")[0] == 401
    assert http(port, "/stop", "POST", token="not-the-token-" + TOKEN)[0] == 401
    assert http(port, "/stop", "GET", token=TOKEN)[0] == 405
    assert job.alive() and not events_named(job.log_dir, "api_stop")
    assert json.loads(http(port, "/status")[1])["phase"] == "running"

    code, body = http(port, "/stop", "POST", token=TOKEN)
    assert code == 202 and json.loads(body) == {"stopping": True, "exit_code": EXIT_API_STOP}, (code, body)
    res = job.result(timeout=60)
    assert res.rc == EXIT_API_STOP, job.describe()
    assert len(events_named(job.log_dir, "api_stop")) == 1, job.describe()


def test_no_token_file_refuses_every_mutating_call(launcher, out_dir):
    """Without --api-token-file POST /stop is 403 whatever it carries; the job is stopped by a signal instead."""
    port = free_port()
    job = Job(launcher, out_dir, ["--metrics-port", str(port)], ["--steps", "1000000", "--forever-cap", "60"],
              nproc=1)
    job.wait_for(lambda: http(port, "/readyz")[0] == 200, 30, "/readyz 200 once the worker runs")
    assert http(port, "/stop", "POST", token=TOKEN)[0] == 403
    assert http(port, "/stop", "POST")[0] == 403
    assert job.alive()
    os.kill(job.proc.popen.pid, signal.SIGTERM)
    assert job.result(timeout=60).rc == 128 + signal.SIGTERM, job.describe()


def test_a_stop_while_waiting_for_the_other_nodes_ends_the_wait(launcher, out_dir, tmp_path):
    """Node 0 of 2 waits at the rendezvous for a node that never comes: /healthz is 200 (it waits on purpose),
    /readyz 503 (no worker), and POST /stop with the token ends the wait with exit 82."""
    port, master = free_port(), free_port()
    token_file = tmp_path / "api-token"
    token_file.write_text(TOKEN)
    os.chmod(token_file, 0o600)
    job = Job(launcher, out_dir, ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                                  str(master), "--metrics-port", str(port), "--api-token-file", str(token_file)],
              nproc=1)
    job.wait_for(lambda: http(port, "/healthz")[0] == 200, 60, "/healthz answers 200")
    assert http(port, "/readyz")[0] == 503 and json.loads(http(port, "/status")[1])["ranks"] == []
    assert http(port, "/stop", "POST", token=TOKEN)[0] == 202
    assert job.result(timeout=30).rc == EXIT_API_STOP, job.describe()
