"""--numa-binding MODE (torchrun's): the CPUs come from torch.numa.binding, asked in a child at launch (the agent
never starts CUDA); every thread of each worker is bound to them, however it was started. Without a GPU the
launch stops with torchrun's words, one line, exit 2."""
from __future__ import annotations

import subprocess
import sys
import os
from pathlib import Path

import pytest

from hyperpodrun.agent.workers.launch import bind_process
from hyperpodrun.errors import ConfigError
from hyperpodrun.launch import host_checks
from test_config import _config, script  # noqa: F401  (script: the fixture)


def _allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as fh:
        return next(line.split()[1] for line in fh if line.startswith("Cpus_allowed_list:"))


def test_every_thread_of_the_worker_is_bound() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                              "print('up', flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"up"
        bind_process(child.pid, [cpu])
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 2
        assert {_allowed_task(child.pid, t) for t in tids} == {str(cpu)}
    finally:
        child.kill()
        child.wait()


def _allowed_task(pid: int, tid: str) -> str:
    with open(f"/proc/{pid}/task/{tid}/status") as fh:
        return next(line.split()[1] for line in fh if line.startswith("Cpus_allowed_list:"))


@pytest.mark.parametrize("flag", ["--numa-binding", "--numa_binding"])
def test_the_cpus_are_asked_at_launch(script: str, tmp_path: Path, flag: str,  # noqa: F811
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int]] = []
    monkeypatch.setattr(host_checks, "numa_cpus", lambda mode, n: asked.append((mode, n)) or {0: [0], 1: [1]})
    cfg = _config(["--log-dir", str(tmp_path), "--nproc-per-node", "2", flag, "core-complex", script])
    assert (cfg.numa_binding, cfg.numa_cpus, asked) == ("core-complex", {0: [0], 1: [1]}, [("core-complex", 2)])
    assert _config(["--log-dir", str(tmp_path), script]).numa_cpus == {}


def test_without_a_gpu_the_launch_stops_with_torchruns_words(script: str, tmp_path: Path) -> None:  # noqa: F811
    if host_checks.cuda_gpus()[0]:
        pytest.skip("this host has GPUs: the binding is made, not refused")
    with pytest.raises(ConfigError) as err:
        _config(["--log-dir", str(tmp_path), "--numa-binding", "node", script])
    assert str(err.value).startswith("--numa-binding node: No accelerator available for NUMA binding; "), err.value
    assert "\n" not in str(err.value)
