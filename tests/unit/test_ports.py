"""The agent's ports and their production implementations: GPU health does nothing before start(); the
event log fans out to sinks; rendezvous backends come from a registry; agent.json has one model."""
from __future__ import annotations

import json
import os
import threading
import types
from typing import Optional

import pytest

from fakes import FakeClock, RecordingSink, config, shared_store

from hyperpodrun.agent.health import gpu_health as gh
from hyperpodrun.agent.coordination import rendezvous as R
from hyperpodrun.agent.control.agent_info import AgentInfo
from hyperpodrun.agent.observe.events import EventLog
from hyperpodrun.agent.health.gpu_map import DeviceInfo
from hyperpodrun.agent.ports import RendezvousInfo
from hyperpodrun.agent.state import NodeState, Phase
from hyperpodrun.errors import EXIT_NO_USABLE_GPU, RendezvousError


class BrokenGpuBackend:
    """Two GPUs behind the NVML backend port; GPU 1's row remapping failed (what the first NVML pass finds)."""

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, uuid=f"GPU-{i}", pci_bus_id=f"00000000:{i + 1:02x}:00.0", name="fake", token=f"GPU-{i}")
                for i in range(2)]

    def register_xid(self) -> list[int]:
        return [0, 1]

    def wait_xid(self, timeout_s: float) -> Optional[tuple[int, int]]:
        threading.Event().wait(min(timeout_s, 0.05))
        return None

    def ecc_uncorrected(self, index: int) -> Optional[int]:
        return 0

    def remap_state(self, index: int) -> Optional[tuple[bool, bool]]:
        return (True, True) if index == 1 else (False, False)

    def clock_event_reasons(self, index: int) -> Optional[int]:
        return 0

    def close(self) -> None:
        pass


def test_gpu_health_constructor_starts_no_thread_and_ends_nothing(monkeypatch):
    """Building GpuHealth reads the inventory only; start() starts the monitor and acts on the broken GPU (no
    spare: the node ends with 76). It used to do both in its constructor."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    failed: list[tuple[object, int]] = []
    workers: dict[int, object] = {}
    ops = types.SimpleNamespace(workers=workers, kill=lambda lr: False, last_step=lambda lr: None,
                                rank_fault=lambda lr, info: None,
                                fail_job=lambda info, code: failed.append((info, code)))
    sink = RecordingSink()
    events = EventLog("h", FakeClock(), console=False)
    events.add_sink(sink)
    threads = threading.active_count()
    cfg = config(health_check="auto", health_interval=3600.0)
    health = gh.GpuHealth(cfg, "h", 0, events, ops, NodeState(phase=Phase.STARTING), lambda ev: None,
                          backend=BrokenGpuBackend())
    try:
        assert threading.active_count() == threads and health.monitor is None
        assert not failed and not sink.records
        health.start()
        assert health.monitor is not None and threading.active_count() == threads + 1
        assert [code for _, code in failed] == [EXIT_NO_USABLE_GPU] and sink.named("no_usable_gpu")
    finally:
        health.stop()


def test_event_log_fans_out_to_every_sink_and_replays_the_early_records(tmp_path):
    clock = FakeClock()
    log = EventLog("h", clock, console=False)
    metrics = RecordingSink()
    log.add_sink(metrics)
    log.emit("agent_start", "hello", pid=1)
    path = tmp_path / "node3.events.jsonl"
    log.open(str(path), 3)
    clock.advance(1)
    log.emit("fault", "boom", rank=2, skipped=None)
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["node"]) for r in lines] == [("agent_start", 3), ("fault", 3)]
    assert lines[1]["ts"] == round(clock.time(), 6) and "skipped" not in lines[1]
    assert [r["event"] for r in metrics.records] == ["agent_start", "fault"] and metrics.closed
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_rendezvous_backends_come_from_the_registry(monkeypatch):
    seen: list[str] = []

    class Fake:
        def join(self, cfg, stop_requested):   # noqa: ANN001 - the port's signature
            seen.append(cfg.rdzv_backend)
            return RendezvousInfo(node_rank=0, nnodes=2, rank_offset=0, world_size=4, run_id="r", master_addr="a",
                                  store=shared_store(), store_host=True, store_endpoint=None, single_node=False)
    monkeypatch.setitem(R._BACKENDS, "c10d", Fake)
    info = R.rendezvous(config(nnodes=2, rdzv_backend="c10d", rdzv_id="r"))
    assert seen == ["c10d"] and info.world_size == 4
    assert isinstance(R.backend_for(config()), R.LocalRendezvous)
    assert isinstance(R.backend_for(config(nnodes=2)), R.StaticRendezvous)
    monkeypatch.delitem(R._BACKENDS, "static")
    with pytest.raises(RendezvousError, match="unknown rendezvous backend 'static'"):
        R.backend_for(config(nnodes=2))


def test_agent_info_is_written_and_read_with_one_model(tmp_path):
    info = AgentInfo(control="ipc:///tmp/x/ctl", pid=42, host="h", node_rank=1, rank_offset=4, nproc_per_node=4)
    path = info.write(str(tmp_path))
    assert path.endswith("node1.agent.json") and oct(os.stat(path).st_mode & 0o777) == "0o600"
    back = AgentInfo.read(path)
    assert back == info and back.hosts(7) and not back.hosts(8) and not back.hosts(3)
