"""GPU health without a GPU: the XID table, the rank -> GPU mapping, the NVML monitor's loop (fake backend), the
pynvml backend against a stub of pynvml, the agent-side decisions (fake agent) and CudaHealthCheck (fake torch)."""
from __future__ import annotations

import queue
import sys
import threading
import time
import types
from typing import Any, Optional

import pytest

from hyperpodrun.agent.health import gpu_health as gh
from hyperpodrun.agent.health.gpu_map import (DeviceInfo, fallback_inventory, initial_assignment, match_report, normalize_pci, spares,
                           visible_devices, visible_devices_for)
from hyperpodrun.agent.health.nvml_backend import DeviceQueryError, NvmlUnavailable, PynvmlBackend, load_nvml, probe_nvml
from hyperpodrun.agent.health.nvml_monitor import NvmlMonitor
from hyperpodrun.agent.state import NodeState, Phase
from hyperpodrun.agent.health.xid import GPU, INFO, RANK, WARN, GpuEvent, classify, classify_xid
from conftest import wait_until
from hyperpodrun.errors import EXIT_NO_USABLE_GPU
from hyperpodrun.runtime.health import CudaHealthCheck, HealthCheckError


# ------------------------------------------------------------------------------------------ classification
@pytest.mark.parametrize("xid, action", [
    (48, GPU), (61, GPU), (62, GPU), (64, GPU), (74, GPU), (79, GPU), (95, GPU), (119, GPU), (120, GPU),
    (94, RANK),
    (13, WARN), (31, WARN), (43, WARN), (45, WARN), (63, WARN), (92, WARN), (4242, WARN)])
def test_xid_table(xid, action):
    verdict = classify_xid(xid)
    assert verdict.action == action
    assert verdict.what.startswith(f"XID {xid}: ")


def test_unknown_xid_is_logged_as_unclassified_not_acted_on():
    assert "unclassified" in classify_xid(4242).what


@pytest.mark.parametrize("ev, action", [
    (GpuEvent("lost", 0, detail="GPU is lost"), GPU),
    (GpuEvent("ecc", 0, count=2), GPU),
    (GpuEvent("remap_failure", 0), GPU),
    (GpuEvent("remap_pending", 0), WARN),
    (GpuEvent("ecc_at_start", 0, count=3), WARN),
    (GpuEvent("throttle", 0, count=0x40), WARN),       # hardware thermal slowdown
    (GpuEvent("throttle", 0, count=0x80), WARN),       # power brake
    (GpuEvent("throttle", 0, count=0x04), INFO),       # at the power cap: normal under load
    (GpuEvent("monitor_error", None, detail="x"), WARN)])
def test_other_signals(ev, action):
    assert classify(ev).action == action


# ------------------------------------------------------------------------------------------ mapping
INV = [DeviceInfo(i, uuid=f"GPU-{i}aaa{i}-0000", pci_bus_id=f"00000000:{0x18 + i:02x}:00.0",
                  token=f"GPU-{i}aaa{i}-0000") for i in range(5)]


def idx(devs: list[DeviceInfo]) -> list[int]:
    return [d.index for d in devs]


@pytest.mark.parametrize("cvd, expect", [
    (None, [0, 1, 2, 3, 4]),              # unset: every GPU, in PCI (NVML) order
    ("", []),
    ("3,1", [3, 1]),
    ("0,7,1", [0]),                       # CUDA stops at the first invalid entry
    ("1,1,2", [1]),                       # ... and at a repeated one
    ("GPU-2aaa2-0000,0", [2, 0]),         # full UUIDs
    ("GPU-4aaa,GPU-1", [4, 1]),           # unique UUID prefixes
    ("GPU-,3", []),                       # an ambiguous prefix is invalid
    ("2,MIG-x", [2])])
def test_visible_devices_follows_cuda_visible_devices(cvd, expect):
    assert idx(visible_devices(cvd, INV)) == expect


def test_fallback_inventory_without_nvml():
    assert [(d.index, d.token) for d in fallback_inventory(None, 3)] == [(0, "0"), (1, "1"), (2, "2")]
    assert [(d.index, d.token) for d in fallback_inventory("3,5", 8)] == [(3, "3"), (5, "5")]
    uu = fallback_inventory("GPU-a,GPU-b", 2)
    assert [(d.index, d.uuid) for d in uu] == [(0, "GPU-a"), (1, "GPU-b")]


def test_local_rank_maps_to_the_visible_gpu_at_its_position():
    vis = visible_devices("4,2,0", INV)
    assert initial_assignment(vis, 4) == {0: 4, 1: 2, 2: 0, 3: None}


def test_worker_reports_match_by_uuid_then_pci():
    assert normalize_pci("0000:1B:00.0") == normalize_pci("00000000:1b:00.0") == "00000000:1b:00.0"
    assert match_report(INV, "GPU-3aaa3-0000", None) == 3
    assert match_report(INV, "3aaa3-0000", None) == 3                 # torch's uuid without the GPU- prefix
    assert match_report(INV, None, "0000:1A:00.0") == 2
    assert match_report(INV, "GPU-nope", "0000:99:00.0") is None


def test_spares_and_the_cuda_visible_devices_of_a_moved_rank():
    vis = visible_devices(None, INV)
    assign = initial_assignment(vis, 4)                              # GPU 4 is a spare
    assert spares(vis, assign, set()) == [4]
    assign[1] = 4                                                    # rank 1 moved there from GPU 1
    unusable = {1}
    assert spares(vis, assign, unusable) == []
    tok = {d.index: d.token for d in INV}
    expect = ",".join(tok[i] for i in (0, 4, 2, 3))                  # cuda:1 is GPU 4; GPU 1 is left out
    assert visible_devices_for(1, vis, assign, unusable) == expect
    assert visible_devices_for(3, vis, assign, unusable) == expect   # the same list for every rank


def test_moved_rank_keeps_its_position_when_others_share_or_lack_a_gpu():
    vis = visible_devices(None, INV)
    assign = {0: 0, 1: 0, 2: 3}                                      # ranks 0 and 1 reported the same GPU
    order = visible_devices_for(2, vis, assign, {1}).split(",")
    assert order[2] == INV[3].token and len(set(order)) == len(order) == 4


# ------------------------------------------------------------------------------------------ monitor loop
class FakeBackend:
    """A scriptable NVML: per GPU an ECC counter, remap flags, clock reasons, or an error to raise."""

    def __init__(self, n: int = 2, xid_capable: bool = True) -> None:
        self.devs = [DeviceInfo(i, uuid=f"GPU-fake-{i}", pci_bus_id=f"00000000:{i + 1:02x}:00.0", name="Fake",
                                token=f"GPU-fake-{i}") for i in range(n)]
        self.xids: "queue.Queue[tuple[int, int]]" = queue.Queue()
        self.ecc = {i: 0 for i in range(n)}
        self.remap = {i: (False, False) for i in range(n)}
        self.reasons = {i: 0 for i in range(n)}
        self.error: dict[int, DeviceQueryError] = {}
        self.queried: list[int] = []
        self.xid_capable = xid_capable
        self.closed = False

    def devices(self) -> list[DeviceInfo]:
        return list(self.devs)

    def register_xid(self) -> list[int]:
        return [d.index for d in self.devs] if self.xid_capable else []

    def wait_xid(self, timeout_s: float) -> Optional[tuple[int, int]]:
        try:
            return self.xids.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _check(self, i: int) -> None:
        self.queried.append(i)
        if i in self.error:
            raise self.error[i]

    def ecc_uncorrected(self, i: int) -> Optional[int]:
        self._check(i)
        return self.ecc[i]

    def remap_state(self, i: int) -> Optional[tuple[bool, bool]]:
        return self.remap[i]

    def clock_event_reasons(self, i: int) -> Optional[int]:
        return self.reasons[i]

    def close(self) -> None:
        self.closed = True


class Posted(list):
    def __call__(self, event: tuple) -> None:
        assert event[0] == "gpu"
        self.append(event[1])

    def kinds(self) -> list[tuple]:
        return [(e.kind, e.device, e.xid if e.kind == "xid" else e.count) for e in self]


def test_monitor_reports_what_is_wrong_at_start_then_only_changes():
    be, posted = FakeBackend(2), Posted()
    be.ecc[1] = 3
    be.remap[0] = (True, False)
    mon = NvmlMonitor(be, posted, interval=3600)
    mon.start()
    try:
        assert mon.registered == [0, 1]
        assert posted.kinds() == [("remap_pending", 0, None), ("ecc_at_start", 1, 3)]
        posted.clear()
        mon.poll(time.monotonic())
        assert posted.kinds() == []                          # nothing changed: nothing new
        be.ecc[1] = 5
        be.remap[0] = (True, True)
        mon.poll(time.monotonic())
        assert posted.kinds() == [("remap_failure", 0, None), ("ecc", 1, 2)]
    finally:
        assert mon.stop()


def test_monitor_thread_posts_xid_events_and_stops_promptly():
    be, posted = FakeBackend(2), Posted()
    mon = NvmlMonitor(be, posted, interval=3600)
    mon.start()
    be.xids.put((1, 79))
    be.xids.put((0, 13))
    wait_until(lambda: len(posted) == 2, 5, message="two XID events posted")
    assert posted.kinds() == [("xid", 1, 79), ("xid", 0, 13)]
    t0 = time.monotonic()
    assert mon.stop()
    assert time.monotonic() - t0 < 2.0


def test_monitor_without_xid_support_still_polls():
    be, posted = FakeBackend(1, xid_capable=False), Posted()
    mon = NvmlMonitor(be, posted, interval=0.05)
    mon.start()
    try:
        wait_until(lambda: mon.polls >= 2, 5, message="polls without XID events")
        be.ecc[0] = 1
        wait_until(lambda: posted.kinds() == [("ecc", 0, 1)], 5, message="the ECC increase")
    finally:
        assert mon.stop()


def test_throttling_is_reported_once_per_episode():
    be, posted = FakeBackend(1), Posted()
    mon = NvmlMonitor(be, posted, interval=3600, quiet_s=30)
    mon.start()
    try:
        t = time.monotonic()
        be.reasons[0] = 0x40 | 0x01                          # hw thermal (+ idle, which does not count)
        for k in range(5):
            mon.poll(t + k)
        assert posted.kinds() == [("throttle", 0, 0x40)]
        be.reasons[0] = 0x40 | 0x04                          # the power cap joins the episode: reported once
        mon.poll(t + 6)
        mon.poll(t + 7)
        be.reasons[0] = 0
        mon.poll(t + 20)                                     # clear, but not for 30 s: same episode
        be.reasons[0] = 0x40
        mon.poll(t + 25)
        assert posted.kinds() == [("throttle", 0, 0x40), ("throttle", 0, 0x04)]
        be.reasons[0] = 0
        mon.poll(t + 60)                                     # 35 s quiet: the episode is over
        be.reasons[0] = 0x40
        mon.poll(t + 61)
        assert posted.kinds()[-1] == ("throttle", 0, 0x40) and len(posted) == 3
    finally:
        mon.stop()


def test_gpu_lost_at_once_or_after_repeated_errors_then_no_longer_polled():
    be, posted = FakeBackend(2), Posted()
    mon = NvmlMonitor(be, posted, interval=3600, lost_after=3)
    mon.start()
    try:
        be.error[0] = DeviceQueryError(0, "GPU is lost", lost=True)
        be.error[1] = DeviceQueryError(1, "Unknown Error")
        mon.poll(time.monotonic())
        assert posted.kinds() == [("lost", 0, None)]
        mon.poll(time.monotonic())
        assert [e.kind for e in posted] == ["lost"]
        mon.poll(time.monotonic())                           # third error in a row on GPU 1
        assert posted.kinds() == [("lost", 0, None), ("lost", 1, None)]
        be.queried.clear()
        mon.poll(time.monotonic())
        assert be.queried == []
    finally:
        mon.stop()


# ------------------------------------------------------------------------------------------ pynvml backend
class StubNvml(types.SimpleNamespace):
    """The part of pynvml's API the backend uses, with its constants and error class."""

    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION, NVML_ERROR_TIMEOUT = 3, 4, 10
    NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST = 13, 15
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self) -> None:
        super().__init__()
        import ctypes
        self.handles = [ctypes.pointer(ctypes.c_int(i)) for i in range(2)]
        self.events: list[Any] = []
        self.fail: dict[str, int] = {}
        self.registered: list[int] = []
        self.shutdown = False

    def _maybe(self, name: str) -> None:
        if name in self.fail:
            raise self.NVMLError(self.fail[name])

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h: Any) -> bytes:
        return f"GPU-stub-{h.contents.value}".encode()

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return types.SimpleNamespace(busId=f"00000000:{0x1a + h.contents.value:02X}:00.0".encode())

    def nvmlDeviceGetName(self, h: Any) -> str:
        return "Stub H200"

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        return 0xFF if h.contents.value == 0 else 0x1

    def nvmlDeviceRegisterEvents(self, h: Any, types_: int, event_set: str) -> None:
        assert types_ == self.nvmlEventTypeXidCriticalError and event_set == "set"
        self.registered.append(h.contents.value)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        assert isinstance(timeout_ms, int)
        if not self.events:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (1, 0)
        self._maybe("ecc")
        return 7

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple:
        self._maybe("remap")
        return (0, 1, 1, 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return 0x20

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True


def test_pynvml_backend_against_a_stub():
    nv = StubNvml()
    be = PynvmlBackend(nv)
    assert [(d.index, d.uuid, d.pci_bus_id, d.name) for d in be.devices()] == [
        (0, "GPU-stub-0", "00000000:1a:00.0", "Stub H200"), (1, "GPU-stub-1", "00000000:1b:00.0", "Stub H200")]
    assert be.register_xid() == [0] and nv.registered == [0]       # GPU 1 does not report XID events
    assert be.wait_xid(0.01) is None                                # NVML_ERROR_TIMEOUT
    nv.events.append(types.SimpleNamespace(eventType=8, eventData=79, device=nv.handles[1]))
    assert be.wait_xid(0.5) == (1, 79)
    assert be.ecc_uncorrected(0) == 7
    assert be.remap_state(0) == (True, False)
    assert be.clock_event_reasons(1) == 0x20
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: (_ for _ in ()).throw(nv.NVMLError(13))  # old driver
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x40
    assert be.clock_event_reasons(1) == 0x40 and be.clock_event_reasons(0) == 0x40
    nv.fail["remap"] = nv.NVML_ERROR_NOT_SUPPORTED
    assert be.remap_state(0) is None
    nv.fail["ecc"] = nv.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(DeviceQueryError) as err:
        be.ecc_uncorrected(1)
    assert err.value.lost and err.value.index == 1
    be.close()
    assert nv.shutdown


def test_nvml_unavailable_names_the_reason(monkeypatch):
    fake = types.ModuleType("pynvml")

    def no_library() -> None:
        raise RuntimeError("NVML Shared Library Not Found")
    fake.nvmlInit = no_library  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        load_nvml()
    assert "NVML Shared Library Not Found" in (probe_nvml() or "")
    monkeypatch.setitem(sys.modules, "pynvml", None)                 # not installed
    assert "nvidia-ml-py" in (probe_nvml() or "")


# ------------------------------------------------------------------------------------------ agent decisions
class FakeEvents:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, event: str, message: str = "", **fields: Any) -> dict:
        rec = {"event": event, "msg": message, **fields}
        self.records.append(rec)
        return rec

    def named(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == name]


def fake_agent(nproc: int, phase: Phase = Phase.RUNNING) -> Any:
    """The node as GPU health sees it: its state and the GpuOps it may ask for (recorded here)."""
    workers = {lr: types.SimpleNamespace(pid=100 + lr, alive=True) for lr in range(nproc)}
    a = types.SimpleNamespace(
        cfg=types.SimpleNamespace(health_check="auto", nproc_per_node=nproc, health_interval=3600.0),
        events=FakeEvents(), state=NodeState(phase=phase), posted=[], faults=[], failed=[],
        sup=types.SimpleNamespace(workers=workers))

    def kill(lr: int) -> bool:
        proc = workers.get(lr)
        if proc is None or not proc.alive:
            return False
        proc.alive = False
        return True
    a.ops = types.SimpleNamespace(workers=workers, kill=kill, last_step=lambda lr: None,
                                  rank_fault=lambda lr, info: a.faults.append((lr, info)),
                                  fail_job=lambda info, code: a.failed.append((info, code)))
    a.post = a.posted.append
    return a


def start_health(a: Any, backend: Any = None) -> gh.GpuHealth:
    health = gh.GpuHealth(a.cfg, "h", 8, a.events, a.ops, a.state, a.post, backend=backend)
    health.start()
    return health


def test_health_with_nvml_maps_reports_and_moves_a_rank_to_the_spare(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a, be = fake_agent(2), FakeBackend(3)
    health = start_health(a, backend=be)
    try:
        start = a.events.named("gpu_health")[0]
        assert start["xid_registered"] == [0, 1, 2] and start["mapping"] == {0: "GPU-fake-0", 1: "GPU-fake-1"}
        assert "spare GPU(s): GPU 2" in start["msg"]
        # rank 9 (local 1) reports GPU 0's PCI id; a report from a pid that is not the current worker is ignored
        health.on_report(9, 555, None, "0000:01:00.0")
        assert health.assignment[1] == 1
        health.on_report(9, 101, None, "0000:01:00.0")
        assert health.assignment[1] == 0 and "using the report" in a.events.named("gpu_map")[0]["msg"]
        health.on_report(9, 101, "GPU-fake-1", None)
        assert health.assignment[1] == 1
        # a warning changes nothing
        health.on_event(GpuEvent("xid", 1, xid=13))
        assert not a.faults and not a.failed and health.env_for(1) == {}
        # fatal: rank 9 moves to GPU 2, with an explicit CUDA_VISIBLE_DEVICES; then the agent's fault path
        health.on_event(GpuEvent("xid", 1, xid=79))
        assert [lr for lr, _ in a.faults] == [1] and "XID 79" in a.faults[0][1].summary
        assert health.assignment[1] == 2 and health.unusable == {1}
        assert health.env_for(1) == health.env_for(0) == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0,GPU-fake-2"}
        # the same GPU again: already unusable, no second action
        health.on_event(GpuEvent("lost", 1))
        assert len(a.faults) == 1
        # GPU 0 lost: no spare left -> the node ends with 76, the worker on it is killed at once
        health.on_event(GpuEvent("lost", 0, detail="GPU is lost"))
        assert a.failed and a.failed[0][1] == EXIT_NO_USABLE_GPU
        bad = a.events.named("no_usable_gpu")[0]
        assert bad["rank"] == 8 and bad["gpu"] == 0 and "GPU-fake-0" in bad["msg"] and "exit code 76" in bad["msg"]
        assert not a.sup.workers[0].alive
        health.report()
        summary = a.events.named("gpu_summary")[0]
        assert summary["counts"] == {"xid 13": 1, "xid 79": 1, "lost": 2}
        assert summary["unusable"] == ["GPU-fake-0", "GPU-fake-1"]
    finally:
        health.stop()
    assert be.closed


@pytest.mark.parametrize("gpus", [3, 2])
def test_gpu_already_broken_at_start_is_handled_before_any_worker_starts(monkeypatch, gpus):
    """A failed row remap found by the first NVML pass: with a spare, rank 1 starts there (no restart needed);
    without one, the node ends with 76 right away."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a, be = fake_agent(2, Phase.STARTING), FakeBackend(gpus)
    be.remap[1] = (True, True)
    health = start_health(a, backend=be)
    try:
        assert health.unusable == {1}
        if gpus == 3:
            assert health.assignment == {0: 0, 1: 2} and not a.failed
            assert health.env_for(1) == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0,GPU-fake-2"}
        else:
            assert a.failed and a.failed[0][1] == EXIT_NO_USABLE_GPU
    finally:
        health.stop()


def test_gpu_not_visible_to_the_job_is_ignored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    a, be = fake_agent(2), FakeBackend(3)
    health = start_health(a, backend=be)
    try:
        health.on_event(GpuEvent("xid", 2, xid=79))
        assert not health.unusable and not a.faults
        assert "not visible to this job" in a.events.named("gpu_event")[0]["msg"]
    finally:
        health.stop()


def test_rank_level_xid_replaces_the_process_on_the_same_gpu(monkeypatch):
    monkeypatch.setattr(gh, "load_nvml", lambda: (_ for _ in ()).throw(NvmlUnavailable("no NVML here")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    a = fake_agent(2)
    health = start_health(a)
    assert "NVML not available (no NVML here)" in a.events.named("gpu_health")[0]["msg"]
    ok, detail = health.inject(9, "nvml-xid", 94)
    assert ok and a.posted == [("gpu", GpuEvent("xid", 5, xid=94, synthetic=True))], detail
    health.on_event(a.posted[0][1])
    assert [lr for lr, _ in a.faults] == [1] and not health.unusable and health.env_for(1) == {}
    assert health.inject(3, "gpu-lost", None)[0] is False                  # not a rank of this node
    assert health.inject(8, "nvml-xid", None) == (False, "--kind nvml-xid needs --xid N (e.g. --xid 79)")


def test_event_on_an_unused_gpu_only_costs_a_spare(monkeypatch):
    monkeypatch.setattr(gh, "load_nvml", lambda: (_ for _ in ()).throw(NvmlUnavailable("no NVML here")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    a = fake_agent(2)
    health = start_health(a)
    health.on_event(GpuEvent("xid", 2, xid=48))
    assert not a.faults and not a.failed and health.unusable == {2}
    assert "no rank uses it" in a.events.named("gpu_fault")[0]["msg"]
    health.on_event(GpuEvent("lost", 2))                                   # the same GPU again: logged only
    assert len(a.events.named("gpu_fault")) == 1 and "already unusable" in a.events.named("gpu_event")[-1]["msg"]
    # now there is no spare: a first fatal XID replaces the rank on its GPU (suspect from now on) ...
    health.on_event(GpuEvent("xid", 0, xid=48, synthetic=True))
    assert [lr for lr, _ in a.faults] == [0] and not a.failed and health.suspect == {0} and 0 not in health.unusable
    assert a.events.named("gpu_fault")[-1]["action"] == "rank" and "now suspect" in a.events.named("gpu_fault")[-1]["msg"]
    # ... a second one on the same GPU makes it unusable: no spare -> 76
    health.on_event(GpuEvent("xid", 0, xid=79, synthetic=True))
    assert a.failed and a.failed[0][1] == EXIT_NO_USABLE_GPU and health.unusable == {0, 2}


def test_no_action_while_the_job_is_ending(monkeypatch):
    monkeypatch.setattr(gh, "load_nvml", lambda: (_ for _ in ()).throw(NvmlUnavailable("no NVML here")))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a = fake_agent(2, Phase.FINISHING)
    health = start_health(a)
    health.on_event(GpuEvent("xid", 1, xid=79))      # no spare: the GPU is only suspect, and nothing is done
    assert not a.faults and not a.failed and health.suspect == {1} and not health.unusable
    health.on_event(GpuEvent("lost", 1))
    assert not a.faults and not a.failed and health.unusable == {1}


# ------------------------------------------------------------------------------------------ CudaHealthCheck
def fake_torch(monkeypatch, *, initialized: bool = True, sync: Any = None) -> types.SimpleNamespace:
    calls: list[Any] = []

    class Tensor:
        def add_(self, v: int) -> "Tensor":
            return self

        def item(self) -> float:
            return 1.0

    def synchronize(device: int) -> None:
        calls.append(("sync", device, threading.current_thread().name))
        if sync is not None:
            sync()

    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, is_available=lambda: True,
                                 current_device=lambda: 3, set_device=lambda d: calls.append(("set", d)),
                                 synchronize=synchronize)
    torch = types.SimpleNamespace(cuda=cuda, zeros=lambda n, device: calls.append(("zeros", device)) or Tensor(),
                                  calls=calls)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_cuda_health_check_probes_the_ranks_own_device(monkeypatch):
    torch = fake_torch(monkeypatch)
    CudaHealthCheck(timeout=5)()
    assert ("set", 3) in torch.calls and ("zeros", "cuda:3") in torch.calls
    assert [c[1] for c in torch.calls if c[0] == "sync"] == [3]


def test_cuda_health_check_without_cuda_passes(monkeypatch):
    torch = fake_torch(monkeypatch, initialized=False)
    CudaHealthCheck(timeout=5)()
    assert torch.calls == []


def test_cuda_health_check_sticky_error_and_timeout(monkeypatch):
    def sticky() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    fake_torch(monkeypatch, sync=sticky)
    with pytest.raises(HealthCheckError, match="illegal memory access"):
        CudaHealthCheck(timeout=5)()
    release = threading.Event()
    fake_torch(monkeypatch, sync=lambda: release.wait(10))
    t0 = time.monotonic()
    with pytest.raises(HealthCheckError, match="did not answer a synchronize within 0.2s"):
        CudaHealthCheck(timeout=0.2)()
    assert time.monotonic() - t0 < 2
    release.set()
