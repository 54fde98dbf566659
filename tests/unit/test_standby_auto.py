"""`--standby-workers auto`, the default (hyperpodrun/launch/host_checks.py standby_auto, LaunchConfig._standby_auto):
one standby per local rank for an in-process restart of a script on a host with CUDA GPUs, 0 otherwise - and,
being the default, never an error; a number keeps its checks; a bad value is one line. The GPU detection is
faked here (monkeypatched `host_checks.cuda_gpus`), and tested apart on fake device files."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from hyperpodrun.launch import host_checks
from hyperpodrun.cli import _env_sources, launch
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import ConfigError
from hyperpodrun.launch.flags import build_config


def _config(argv: list[str]) -> LaunchConfig:
    """What `hyperpodrun ARGV` would hand to the agent (ConfigError: the one line it would print)."""
    with launch.make_context("hyperpodrun", list(argv)) as ctx:
        opts = dict(ctx.params)
        script, args = opts.pop("training_script"), opts.pop("training_script_args")
        return build_config(opts, script, args, _env_sources(ctx))


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """run(flags, gpu=True|False) -> the config of `hyperpodrun --log-dir TMP FLAGS train.py` on a host
    with or without CUDA GPUs."""
    for key in ("PET_STANDBY_WORKERS", "HYPERPODRUN_STANDBY_WORKERS", "HYPERPODRUN_LOG_DIR", "PET_LOG_DIR",
                "HYPERPODRUN_JOB_SECRET", "PET_NPROC_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    asked: list[int] = []

    def go(flags: list[str], gpu: bool = True, entry: Optional[str] = None) -> LaunchConfig:
        def detect() -> tuple[bool, str]:
            asked.append(1)
            return (True, "CUDA present") if gpu else (False, "no CUDA GPU on this host")
        monkeypatch.setattr(host_checks, "cuda_gpus", detect)
        return _config(["--log-dir", str(tmp_path / "logs"), *flags, entry or str(script)])
    go.asked = asked  # type: ignore[attr-defined]
    return go


# ------------------------------------------------------------------------------------------ the resolution
def test_auto_is_the_default_one_standby_per_local_rank_on_a_gpu_host(run) -> None:
    cfg = run(["--inprocess-restart", "--nproc-per-node", "4"])
    assert (cfg.standby_workers, cfg.standby_auto) == (1, "auto: CUDA present")
    assert run(["--inprocess-restart", "--standby-workers", "auto"]).standby_workers == 1
    assert run(["--inprocess-restart", "--standby-workers", " AUTO "]).standby_workers == 1


def test_auto_is_off_without_a_gpu(run) -> None:
    cfg = run(["--inprocess-restart"], gpu=False)
    assert (cfg.standby_workers, cfg.standby_auto) == (0, "auto: no CUDA GPU on this host")


@pytest.mark.parametrize("flags, entry, why", [
    ([], None, "auto: no --inprocess-restart"),
    (["--inprocess-restart", "-m"], "some.module", "auto: standbys need a script entry point, not -m/--no-python"),
    (["--inprocess-restart", "--no-python"], "/bin/true", "auto: standbys need a script entry point"),
], ids=["no-inprocess", "module", "no-python"])
def test_auto_never_fails_a_launch_that_cannot_have_standbys(run, flags: list[str], entry: Optional[str],
                                                            why: str) -> None:
    """The default must not turn a plain launch into an error the way an explicit number does; the host is
    not even looked at."""
    cfg = run(flags, entry=entry)
    assert cfg.standby_workers == 0 and cfg.standby_auto is not None and cfg.standby_auto.startswith(why)
    assert run.asked == []


def test_a_number_is_kept_and_keeps_its_checks(run) -> None:
    for given in ("0", "2", "8"):
        cfg = run(["--inprocess-restart", "--standby-workers", given])
        assert (cfg.standby_workers, cfg.standby_auto) == (int(given), None)
    assert run(["--inprocess-restart", "--standby-workers", "1"], gpu=False).standby_workers == 1, \
        "an explicit number starts standbys on CPU too"
    with pytest.raises(ConfigError, match="--standby-workers 1 needs --inprocess-restart"):
        run(["--standby-workers", "1"])
    with pytest.raises(ConfigError, match="--standby-workers 1 needs a script entry point"):
        run(["--inprocess-restart", "--standby-workers", "1", "-m"], entry="some.module")


@pytest.mark.parametrize("value", ["foo", "-1", "9", "1.5", ""])
def test_a_bad_value_is_one_line_naming_the_flag_and_what_it_takes(run, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        run(["--inprocess-restart", "--standby-workers", value])
    line = str(err.value)
    assert line.startswith(f"--standby-workers {value!r}: must be auto, or a whole number of standbys per local "
                           "rank from 0 to 8 (0 turns them off)"), line
    assert "\n" not in line


@pytest.mark.parametrize("var", ["HYPERPODRUN_STANDBY_WORKERS", "PET_STANDBY_WORKERS"])
def test_the_environment_variable_form(run, monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "0")
    assert run(["--inprocess-restart"]).standby_workers == 0, "0 from the environment opts out"
    monkeypatch.setenv(var, "auto")
    assert run(["--inprocess-restart"]).standby_workers == 1
    assert run(["--inprocess-restart", "--standby-workers", "0"]).standby_workers == 0, "the flag wins"
    monkeypatch.setenv(var, "many")
    with pytest.raises(ConfigError, match=rf"^--standby-workers \(from {var}\) 'many': must be auto"):
        run(["--inprocess-restart"])


def test_a_config_built_in_code_has_no_standbys_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_checks, "cuda_gpus", lambda: (True, "CUDA present"))
    assert LaunchConfig(entrypoint="x.py", inprocess_restart=True).standby_workers == 0
    cfg = LaunchConfig(entrypoint="x.py", inprocess_restart=True, standby_workers="auto")
    assert (cfg.standby_workers, cfg.standby_auto) == (1, "auto: CUDA present")


# ------------------------------------------------------------------------------------------ GPU detection
@pytest.mark.parametrize("cvd, present", [
    (None, True), ("0", True), ("1,0", True), (" 3", True), ("GPU-8f2c", True), ("MIG-1a2b", True),
    ("", False), ("-1", False), ("none", False), (",0", False),
])
def test_cuda_gpus_reads_the_device_files_and_cuda_visible_devices(tmp_path: Path, cvd: Optional[str],
                                                                  present: bool) -> None:
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    got, why = host_checks.cuda_gpus(env, str(tmp_path / "nvidia[0-9]*"))
    assert got is present, why
    assert why == "CUDA present" if present else why == f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"


def test_no_gpu_device_file_means_no_cuda(tmp_path: Path) -> None:
    (tmp_path / "nvidiactl").touch()          # the control device alone (driver loaded, no GPU)
    (tmp_path / "nvidia-uvm").touch()
    assert host_checks.cuda_gpus({}, str(tmp_path / "nvidia[0-9]*")) == (False, "no CUDA GPU on this host")


def test_standby_auto_asks_the_host_only_when_standbys_could_run() -> None:
    asked: list[int] = []

    def detect() -> tuple[bool, str]:
        asked.append(1)
        return True, "CUDA present"
    assert host_checks.standby_auto(False, True, detect)[0] == 0
    assert host_checks.standby_auto(True, False, detect)[0] == 0
    assert asked == []
    assert host_checks.standby_auto(True, True, detect) == (host_checks.AUTO_STANDBY_WORKERS, "auto: CUDA present")
    assert host_checks.standby_auto(True, True, lambda: (False, "no CUDA GPU on this host")) == \
        (0, "auto: no CUDA GPU on this host")
