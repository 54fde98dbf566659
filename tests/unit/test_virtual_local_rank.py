"""--virtual-local-rank (torchrun's): every worker gets LOCAL_RANK=0 and a CUDA_VISIBLE_DEVICES naming only its
own GPU - its entry of the user's CUDA_VISIBLE_DEVICES, or its local rank - while what is keyed per local rank
(slot directories, the HELLO to the agent) keeps the real one (HYPERPODRUN_LOCAL_RANK)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hyperpodrun.agent.workers.launch import WorkerLauncher
from hyperpodrun.env import HYPERPODRUN_LOCAL_RANK, real_local_rank, virtual_device, virtual_local_rank_env
from hyperpodrun.errors import ConfigError
from test_config import _config, script  # noqa: F401  (script: the fixture)


def test_the_device_is_the_local_rank_or_its_entry_of_the_users_list() -> None:
    assert [virtual_device(lr, None) for lr in range(3)] == ["0", "1", "2"]
    assert [virtual_device(lr, "6,GPU-1a2b, 2") for lr in range(3)] == ["6", "GPU-1a2b", "2"]
    with pytest.raises(ConfigError, match=r"^--virtual-local-rank: local rank 2 has no GPU in "
                                          r"CUDA_VISIBLE_DEVICES='0,1' \(2 entries\)"):
        virtual_device(2, "0,1")


def test_the_env_composes_with_the_users_cuda_visible_devices() -> None:
    assert virtual_local_rank_env({}, 3) == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "3"}
    assert virtual_local_rank_env({"CUDA_VISIBLE_DEVICES": "4,5"}, 1) == {"LOCAL_RANK": "0",
                                                                          "CUDA_VISIBLE_DEVICES": "5"}


def test_a_gpu_maps_short_list_gives_the_rank_its_first_entry() -> None:
    """A rank moved to a spare GPU when too few are usable gets a list with its GPU first (agent/health/gpu_map.py)."""
    assert WorkerLauncher._virtual({"CUDA_VISIBLE_DEVICES": "7,1"}, 1)["CUDA_VISIBLE_DEVICES"] == "1"
    assert WorkerLauncher._virtual({"CUDA_VISIBLE_DEVICES": "7"}, 3)["CUDA_VISIBLE_DEVICES"] == "7"


def test_the_real_local_rank_beats_local_rank() -> None:
    assert real_local_rank({HYPERPODRUN_LOCAL_RANK: "3", "LOCAL_RANK": "0"}) == 3
    assert real_local_rank({"LOCAL_RANK": "2"}) == 2      # launched by torchrun
    assert real_local_rank({}) == 0
    with pytest.raises(ConfigError, match=HYPERPODRUN_LOCAL_RANK):
        real_local_rank({HYPERPODRUN_LOCAL_RANK: "x"})


@pytest.mark.parametrize("flag", ["--virtual-local-rank", "--virtual_local_rank"])
def test_both_spellings_set_it(script: str, tmp_path: Path, flag: str,  # noqa: F811
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _config(["--log-dir", str(tmp_path), "--nproc-per-node", "2", flag, script]).virtual_local_rank
    assert not _config(["--log-dir", str(tmp_path), script]).virtual_local_rank


def test_too_short_a_cuda_visible_devices_is_a_usage_error(script: str, tmp_path: Path,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match=r"^--virtual-local-rank: local rank 1 has no GPU in") as err:
        _config(["--log-dir", str(tmp_path), "--nproc-per-node", "2", "--virtual-local-rank", script])
    assert "\n" not in str(err.value)


def test_a_standby_is_forked_with_its_ranks_cuda_visible_devices() -> None:
    """Under --virtual-local-rank a slot's standby makes its CUDA context with the CUDA_VISIBLE_DEVICES its rank
    will get (the zygote sets it before CUDA starts), and a respawn's request with that value can take it."""
    import socket
    from types import SimpleNamespace

    from hyperpodrun.agent.workers.standby import StandbyPool

    calls: list[tuple[int, object]] = []
    ends: list[socket.socket] = []

    class Spawner:
        def check_ready(self) -> bool:
            return True

        def fork_standby(self, slot: int, slot_dir: object = None, cuda_visible: object = None) -> tuple:
            calls.append((slot, cuda_visible))
            ours, theirs = socket.socketpair()
            ends.extend((ours, theirs))
            return 10_000_000 + slot, ours          # no such pid: never polled here

    sup = SimpleNamespace(track_extra=lambda pid: None)
    warm = SimpleNamespace(spawner=Spawner())
    base = {"CUDA_VISIBLE_DEVICES": "4,5"}
    pool = StandbyPool(sup, None, warm, 1, 2, base,  # type: ignore[arg-type]
                       cuda_for=lambda lr: WorkerLauncher._virtual(base, lr)["CUDA_VISIBLE_DEVICES"])
    pool.poll()
    assert calls == [(0, "4"), (1, "5")]
    assert [pool.pool[lr][0].env_cuda for lr in (0, 1)] == ["4", "5"]
    plain = StandbyPool(sup, None, warm, 1, 1, base)  # type: ignore[arg-type]
    plain.poll()
    assert calls[-1] == (0, None) and plain.pool[0][0].env_cuda == "4,5"
    for end in ends:
        end.close()
