"""Every import line of the product note (its Tier 2-4 snippets and its complete example), with the package
prefix `hyperpod_checkpointless_training` changed to `hyperpodrun`, runs as written; the same names are
importable from `hyperpodrun` itself. And HPAgentK8sAPIFactory builds a real channel to a node agent."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import zmq

# the note's import lines, as it writes them, with only the package prefix changed
NOTE_IMPORTS = """
from hyperpodrun.dataloader.mmap_data_module import MMAPDataModule
from hyperpodrun.dataloader.config import CacheResumeMMAPConfig
from hyperpodrun.inprocess.wrap import HPWrapper
from hyperpodrun.inprocess.health_check import CudaHealthCheck
from hyperpodrun.inprocess.train_utils import wait_rank, HPAgentK8sAPIFactory
from hyperpodrun.inprocess.abort import (
    CheckpointlessAbortManager,
    CheckpointlessFinalizeCleanup
)
from hyperpodrun.nemo_plugins.strategy import CheckpointlessMegatronStrategy
from hyperpodrun.nemo_plugins.checkpoint_manager import CheckpointManager
from hyperpodrun.nemo_plugins.callbacks import CheckpointlessCallback
"""

NAMES = ["MMAPDataModule", "CacheResumeMMAPConfig", "HPWrapper", "CudaHealthCheck", "wait_rank",
         "HPAgentK8sAPIFactory", "CheckpointlessAbortManager", "CheckpointlessFinalizeCleanup",
         "CheckpointlessMegatronStrategy", "CheckpointManager", "CheckpointlessCallback"]


def test_every_import_line_of_the_note_runs_in_a_fresh_interpreter():
    """In a new process (nothing imported before): the lines run, and each name is the object that
    `hyperpodrun` exports under it."""
    check = NOTE_IMPORTS + "\nimport hyperpodrun\n" + "".join(
        f"assert getattr(hyperpodrun, {n!r}) is {n}, {n!r}\n" for n in NAMES) + "print('ok')\n"
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-3000:]


def test_the_note_names_are_all_exported_by_hyperpodrun():
    import hyperpodrun
    assert set(NAMES) <= set(hyperpodrun.__all__)
    for line in NOTE_IMPORTS.replace("(\n", "").splitlines():   # every module path is a real module of ours
        if line.startswith("from "):
            __import__(line.split()[1])


def test_the_factory_builds_a_channel_to_a_real_agent_control_server():
    """HPAgentK8sAPIFactory(endpoint=...) against the agent's own ControlServer: the channel says HELLO and
    heartbeats with what `status` gives, and a command the agent sends arrives at `on_command`."""
    from hyperpodrun import HPAgentK8sAPIFactory
    from hyperpodrun import protocol as P
    from hyperpodrun.agent.control.server import ControlServer
    from conftest import wait_until

    server = ControlServer()
    got: list[P._Msg] = []
    arrived = threading.Event()

    def on_command(msg: P._Msg) -> None:
        got.append(msg)
        arrived.set()
    factory = HPAgentK8sAPIFactory(endpoint=server.endpoint, heartbeat_interval=0.05)
    client = factory(5, on_command, lambda: {"generation": 0, "step": 7, "state": "running"})
    try:
        client.start(P.Hello(rank=5, local_rank=1, pid=client.pid, generation=0))
        seen: list[tuple[bytes, P._Msg]] = []
        poller = zmq.Poller()
        poller.register(server.sock, zmq.POLLIN)

        def heard_both() -> bool:
            if poller.poll(100):
                seen.extend(server.receive())
            kinds = [m.type for _, m in seen]
            return "hello" in kinds and "heartbeat" in kinds
        wait_until(heard_both, timeout=10, message="HELLO and a heartbeat from the channel")
        beat = next(m for _, m in seen if m.type == "heartbeat")
        assert beat.rank == 5 and beat.step == 7
        ident = next(i for i, m in seen if m.type == "hello")
        assert server.send(ident, P.Go(generation=1, master_addr="127.0.0.1", master_port=1234))
        assert arrived.wait(10), "the agent's GO did not reach on_command"
        assert isinstance(got[0], P.Go) and got[0].master_port == 1234
    finally:
        client.close()
        server.close()


def test_the_factory_and_hpwrapper_refuse_what_cannot_work(monkeypatch):
    from hyperpodrun import HPAgentK8sAPIFactory, HPWrapper
    from hyperpodrun.errors import ApiTypeError, ApiValueError, OutOfOrderError
    with pytest.raises(ApiValueError, match="heartbeat_interval"):
        HPAgentK8sAPIFactory(heartbeat_interval=0)
    with pytest.raises(ApiTypeError, match="hp_api_factory"):
        HPWrapper(hp_api_factory="k8s")
    monkeypatch.delenv("HYPERPODRUN_CONTROL", raising=False)
    with pytest.raises(OutOfOrderError, match="no agent"):
        HPAgentK8sAPIFactory()(0, lambda m: None, dict)
    wrapper = HPWrapper(hp_api_factory=HPAgentK8sAPIFactory())
    assert isinstance(wrapper.hp_api_factory, HPAgentK8sAPIFactory)
