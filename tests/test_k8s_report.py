"""`--k8s-report`: the pod's annotations and Events reach the API server during a real in-process recovery, and
an API server that fails or hangs never slows the restart round. The API server is tests/k8s_standin.py (a
threaded http.server on loopback); the client is pointed at it by a kubeconfig the test writes, as `kubectl`
would be."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

kubernetes = pytest.importorskip("kubernetes")

from conftest import HYPERPODRUN, wait_until, write_script   # noqa: E402
from inprocess_helpers import FAST, Job, events_named   # noqa: E402
from k8s_standin import CLIENT_VERSION, StandIn   # noqa: E402

from hyperpodrun.agent.observe import k8s_report as R   # noqa: E402
from hyperpodrun.agent.observe.k8s_api import FIX_INSTALL, READ_TIMEOUT_S, PodApi, PodRef, preflight   # noqa: E402
from hyperpodrun.errors import ConfigError   # noqa: E402

POD = {"POD_NAME": "train-0", "POD_NAMESPACE": "ml", "POD_UID": "0f0e0d0c-uid"}


def test_the_stand_in_is_pinned_to_the_client_it_answers():
    """The stand-in answers what one client version sends: moving the pin means checking it again."""
    assert kubernetes.__version__ == CLIENT_VERSION, (
        f"kubernetes {kubernetes.__version__} is installed; tests/k8s_standin.py answers {CLIENT_VERSION}")


@pytest.fixture
def standin(request):
    modes = getattr(request, "param", ("ok", "ok"))
    server = StandIn(*modes)
    yield server
    server.close()


def _job_env(standin: StandIn, tmp_path) -> dict[str, str]:
    return {"KUBECONFIG": standin.write_kubeconfig(tmp_path / "kubeconfig"), "KUBERNETES_SERVICE_HOST": "", **POD}


def _recover_once(launcher, out_dir, env: dict[str, str]) -> tuple[Job, dict, float]:
    """A 2-rank --inprocess-restart --k8s-report job whose rank 1 is SIGKILLed mid-training; its `go` record and
    the wall time its agent was seen to exit."""
    job = Job(launcher, out_dir, [*FAST, "--k8s-report"], nproc=2, env=env)
    started = job.wait_step(range(2), step=20)
    os.kill(started[1], signal.SIGKILL)
    res = job.result()
    ended = time.time()
    assert res.rc == 0, job.describe()
    go = events_named(job.log_dir, "go")
    assert [g["generation"] for g in go] == [1], job.describe()
    return job, go[0], ended


def test_annotations_and_events_tell_the_recovery(launcher, out_dir, tmp_path, standin):
    """The pod ends with generation 1, phase succeeded and the round's recovery time in its annotations, and its
    Events (involvedObject: the pod) tell fault -> in-process restart -> respawn -> recovered -> succeeded."""
    job, go, _ = _recover_once(launcher, out_dir, _job_env(standin, tmp_path))
    patches = standin.of_kind("patch")
    assert patches and all(p["path"] == "/api/v1/namespaces/ml/pods/train-0" for p in patches), patches
    assert all(p["content_type"] == "application/strategic-merge-patch+json" for p in patches), patches
    assert all(p["authorization"] == "Bearer stand-in-token" for p in standin.requests)
    assert standin.annotations["ml/train-0"] == {
        "hyperpodrun.io/generation": "1", "hyperpodrun.io/phase": "succeeded",
        "hyperpodrun.io/last-recovery-s": f"{go['downtime_s']:.3f}"}, (standin.annotations, job.describe())
    phases = [p["body"]["metadata"]["annotations"].get("hyperpodrun.io/phase") for p in patches]
    assert "restarting" in phases and phases.index("restarting") < len(phases) - 1, phases

    reasons = standin.reasons()
    story = ["Fault", "InProcessRestart", "RankRespawned", "Recovered", "JobSucceeded"]
    assert [r for r in reasons if r in story] == story, reasons
    for ev in standin.events():
        assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train-0", "namespace": "ml",
                                        "uid": POD["POD_UID"]}, ev
        assert ev["metadata"]["namespace"] == "ml" and ev["metadata"]["name"].startswith("train-0.")
        assert ev["source"]["component"] == "hyperpodrun" and ev["message"]
    fault = standin.events()[reasons.index("Fault")]
    assert fault["type"] == "Warning" and "rank 1" in fault["message"], fault
    assert all(r["path"] == "/api/v1/namespaces/ml/events" for r in standin.of_kind("event"))


@pytest.mark.parametrize("standin", [("500", "hang")], indirect=True)
def test_a_failing_and_hanging_api_server_does_not_slow_the_round(launcher, out_dir, tmp_path, standin):
    """Patches answered with 500 and Events that hang (longer than the job): the round recovers in less than one
    call's read timeout (a reporter on the loop thread would spend one per record of the round), the job
    succeeds, and the agent exits within the reporter's flush time of the job's end."""
    job, go, ended = _recover_once(launcher, out_dir, _job_env(standin, tmp_path))
    assert go["downtime_s"] < READ_TIMEOUT_S, job.describe()
    assert standin.of_kind("patch") and standin.of_kind("event"), standin.requests
    assert "Kubernetes reporter: a call to the API server failed" in job.proc.err(), job.proc.err()[-3000:]
    assert "failed" in job.proc.err() and "not sent at exit" in job.proc.err()
    # the agent exits at most the reporter's flush time (2 s) and its own cleanup after the job's end
    done = events_named(job.log_dir, "job_done")[0]
    assert ended - done["ts"] < 2.0 + 3.0, (ended - done["ts"], job.describe())


# ------------------------------------------------------------------------------------------ the sink alone
def _pod_api(standin: StandIn, timeout: float = 1.0) -> PodApi:
    """The reporter's real client, its configuration injected (host = the stand-in)."""
    cfg = kubernetes.client.Configuration()
    cfg.host = standin.url
    cfg.retries = False
    return PodApi(kubernetes.client.ApiClient(cfg), PodRef("p-1", "ns", None), "h", timeout=(timeout, timeout))


@pytest.mark.parametrize("standin", [("ok", "hang")], indirect=True)
def test_a_full_queue_drops_the_oldest_and_close_keeps_its_deadline(standin):
    """While one Event hangs, writes stay instant, the queue keeps the newest `max_queue` and counts the others;
    close() returns after flush_s, not after the hung call."""
    rep = R.PodReporter(_pod_api(standin, timeout=30), max_queue=4, flush_s=0.3)
    rep.write({"event": "kill", "msg": "first"}, 0, "")
    wait_until(lambda: standin.of_kind("event"), 10, message="the first Event reached the stand-in")
    t0 = time.monotonic()
    for i in range(9):
        rep.write({"event": "kill", "msg": f"m{i}"}, 0, "")
    assert time.monotonic() - t0 < 0.1
    assert rep.dropped == 5
    assert [e[2] for e in rep._events] == ["m5", "m6", "m7", "m8"]
    t0 = time.monotonic()
    rep.close()
    assert time.monotonic() - t0 < 1.5


def test_calls_are_rate_limited_and_the_newest_annotations_win(standin):
    """A burst of records: Events beyond the bucket wait for tokens; annotations are sent as the newest values,
    never a stale phase after a newer one."""
    rep = R.PodReporter(_pod_api(standin), rate=20.0, burst=2, flush_s=5)
    t0 = time.monotonic()
    for i in range(6):
        rep.write({"event": "respawn", "msg": f"r{i}"}, 0, "")
    rep.write({"event": "restart_signal", "generation": 1}, 0, "")
    rep.write({"event": "go", "generation": 1, "downtime_s": 0.5}, 0, "")
    rep.close()
    took = time.monotonic() - t0
    calls = len(standin.requests)
    assert rep.failed == 0 and rep.sent == calls
    assert took >= (calls - 2) / 20.0 * 0.8, (took, calls)
    assert standin.annotations["ns/p-1"] == {"hyperpodrun.io/phase": "running", "hyperpodrun.io/generation": "1",
                                             "hyperpodrun.io/last-recovery-s": "0.500"}
    assert standin.reasons()[:6] == ["RankRespawned"] * 6


def test_records_map_to_the_story():
    """The mapping itself: a fault is a Warning and sets restarting, GO sets running with its recovery time,
    node losses and GPU actions are Events, chatter is not reported."""
    assert R.report_of({"event": "worker_start"}) is None
    fault = R.report_of({"event": "fault", "generation": 0, "msg": "rank 3 died"})
    assert fault is not None and fault.event == ("Warning", "Fault", "rank 3 died")
    assert fault.annotations == {R.PHASE: "restarting", R.GENERATION: "0"}
    lost = R.report_of({"event": "node_lost", "generation": 2, "msg": "node 1 lost"})
    assert lost is not None and lost.event == ("Warning", "NodeLost", "node 1 lost")
    gpu = R.report_of({"event": "gpu_fault", "msg": "XID 79"})
    assert gpu is not None and gpu.event == ("Warning", "GpuFault", "XID 79") and not gpu.annotations


# ------------------------------------------------------------------------------------------ refused at launch
def test_outside_a_pod_the_launch_exits_2_with_one_line(launcher, tmp_path):
    train = write_script(tmp_path, "t.py", "pass\n")
    res = launcher.run(["--k8s-report", train], env={"KUBERNETES_SERVICE_HOST": "", "KUBECONFIG": ""}, timeout=60)
    assert res.rc == 2, res
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not one" in lines[0] and "KUBERNETES_SERVICE_HOST" in lines[0], res.err


def test_without_the_client_the_fix_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)   # what an install without the extra imports
    with pytest.raises(ConfigError) as err:
        preflight({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "p"})
    assert str(err.value) == FIX_INSTALL and "hyperpodrun[k8s]" in str(err.value)


def test_in_a_pod_without_a_token_the_fix_is_named():
    with pytest.raises(ConfigError) as err:
        preflight({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443", "POD_NAME": "p"})
    assert "automountServiceAccountToken" in str(err.value)


def test_cli_sees_the_flag():
    import subprocess
    out = subprocess.run([HYPERPODRUN, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--k8s-report" in out
