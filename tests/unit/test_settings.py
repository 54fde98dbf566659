"""The user's HYPERPODRUN_* settings (hyperpodrun/launch/settings.py) and the worker environment contract as the
runtime reads it (hyperpodrun/env.py): each read in one place, each bad value one clear error."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator

import pytest

from hyperpodrun import auth
from hyperpodrun.launch import settings
from hyperpodrun.env import WorkerContext, worker_context
from hyperpodrun.errors import ConfigError

SECRET = "a-job-secret-of-enough-bytes"


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing pinned, no HYPERPODRUN_* variable of the developer's shell."""
    import os
    for key in list(os.environ):
        if key.startswith("HYPERPODRUN_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(settings, "_pinned", None)
    monkeypatch.setattr(settings, "_warned", set())
    yield


def test_every_setting_parses() -> None:
    s = settings.load({"HYPERPODRUN_LOG_LEVEL": "warning", "HYPERPODRUN_WARM_RESPAWN": "no",
                       "HYPERPODRUN_WARM_IMPORTS": "", "HYPERPODRUN_SYMPTOM_GRACE_S": "0.5",
                       "HYPERPODRUN_EXIT_GRACE_S": "3", "HYPERPODRUN_LOG_DIR": "/tmp/logs",
                       "HYPERPODRUN_SHM_DIR": "/mnt/tmpfs", "HYPERPODRUN_JOB_SECRET": f"  {SECRET}\n",
                       "HYPERPODRUN_RESTART_GRACE_S": "12", "HYPERPODRUN_STANDBY_KERNEL_WARM": "off"})
    assert (s.log_level, s.warm_respawn, s.warm_imports, s.symptom_grace_s, s.exit_grace_s) == \
        (logging.WARNING, False, (), 0.5, 3.0)
    assert (s.log_dir, s.shm_dir, s.restart_grace_s) == ("/tmp/logs", "/mnt/tmpfs", 12.0)
    assert s.standby_kernel_warm is False and settings.Settings().standby_kernel_warm is True
    assert s.job_secret is not None and s.job_secret.get_secret_value() == SECRET.encode(), "stripped"
    assert SECRET not in repr(s) and SECRET not in str(s), "the secret never shows in a repr"
    assert settings.load({}) == settings.Settings() and settings.Settings().shm_dir == "/dev/shm"


@pytest.mark.parametrize("name, value, needle", [
    ("HYPERPODRUN_LOG_LEVEL", "loud", "is not a log level"),
    ("HYPERPODRUN_WARM_RESPAWN", "maybe", "is not on or off"),
    ("HYPERPODRUN_STANDBY_KERNEL_WARM", "2", "is not on or off"),
    ("HYPERPODRUN_WARM_IMPORTS", "torch,9lives", "'9lives' is not a module name"),
    ("HYPERPODRUN_SYMPTOM_GRACE_S", "soon", "is not a number of seconds in 0..60"),
    ("HYPERPODRUN_EXIT_GRACE_S", "inf", "is not a number of seconds in 0..60"),
    ("HYPERPODRUN_RESTART_GRACE_S", "0", "is not a number of seconds in 0..60 (above 0)"),
    ("HYPERPODRUN_JOB_SECRET", "short", "the job secret has 5 bytes; give at least 16"),
])
def test_a_bad_value_names_the_variable(name: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings.load({name: value})
    assert str(err.value).startswith(name) and needle in str(err.value), str(err.value)


def test_unpinned_settings_follow_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A worker or a test changes the environment: current() reads it now; a bad variable falls back to its
    own default (the others keep their values) with one warning."""
    monkeypatch.setenv("HYPERPODRUN_SHM_DIR", "/a")
    assert settings.current().shm_dir == "/a"
    monkeypatch.setenv("HYPERPODRUN_SHM_DIR", "/b")
    monkeypatch.setenv("HYPERPODRUN_LOG_LEVEL", "loud")
    with caplog.at_level(logging.WARNING, logger="hyperpodrun"):
        assert settings.current().shm_dir == "/b" and settings.current().log_level == logging.INFO
        settings.current()
    assert [r.getMessage() for r in caplog.records].count(
        "HYPERPODRUN_LOG_LEVEL='loud' is not a log level; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
        "(or a number 0-50); using the default") == 1


def test_pinned_settings_do_not_change(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = settings.use(settings.load({"HYPERPODRUN_SHM_DIR": "/pinned"}))
    monkeypatch.setenv("HYPERPODRUN_SHM_DIR", "/later")
    assert settings.current() is pinned and settings.current().shm_dir == "/pinned"


def test_job_secret_comes_through_the_settings(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth.job_secret(None) is None
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    assert auth.job_secret(None) == SECRET.encode()
    assert auth.job_secret(None, {auth.SECRET_ENV: "x" * 20}) == b"x" * 20, "an explicit environment"
    path = tmp_path / "secret"
    path.write_text("from-the-file-0123456789")
    path.chmod(0o600)
    assert auth.job_secret(str(path)) == b"from-the-file-0123456789", "the file wins"
    with pytest.raises(ConfigError, match="HYPERPODRUN_JOB_SECRET: the job secret has 3 bytes"):
        auth.checked_secret_file(None, {auth.SECRET_ENV: "abc"})


def test_log_dir_setting_is_the_default_log_dir(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from hyperpodrun.launch.host_checks import default_log_dir
    monkeypatch.delenv("PET_LOG_DIR", raising=False)
    monkeypatch.setenv("HYPERPODRUN_LOG_DIR", str(tmp_path))
    assert default_log_dir() == str(tmp_path)


#: a literal HYPERPODRUN_* variable read from the environment: os.environ[...], os.environ.get(...), os.getenv(...)
_ENV_READ = re.compile(r"""(environ\s*(\.\s*get\s*\(|\[)|getenv\s*\()\s*[rbf]?["']HYPERPODRUN_""")


def test_no_module_reads_a_setting_from_the_environment_itself() -> None:
    """Every HYPERPODRUN_* setting is read by hyperpodrun/launch/settings.py (the worker contract by hyperpodrun/env.py),
    so a bad value is refused once at start-up and a default is written in one place."""
    import hyperpodrun
    import hyperpodrun.agent
    roots = [Path(hyperpodrun.__file__).parent, Path(hyperpodrun.agent.__file__).parent]
    allowed = {roots[0] / "launch/settings.py", roots[0] / "env.py"}
    stray = [f"{path}:{n}: {line.strip()}" for root in roots for path in sorted(root.rglob("*.py"))
             if path not in allowed for n, line in enumerate(path.read_text().splitlines(), 1)
             if _ENV_READ.search(line)]
    assert not stray, "read these through hyperpodrun.launch.settings: " + "; ".join(stray)
    assert _ENV_READ.search('x = os.environ.get("HYPERPODRUN_WARM_IMPORTS")'), "the pattern finds a read"


def test_the_zygote_imports_what_the_setting_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperpodrun.agent.workers import zygote
    imported: list[str] = []

    def fake_import(name: str) -> None:
        imported.append(name)
        if name == "no_such_module":
            raise ImportError(name)
    monkeypatch.setattr(zygote.importlib, "import_module", fake_import)
    monkeypatch.setenv("HYPERPODRUN_WARM_IMPORTS", "json, no_such_module,json")
    failed = zygote.prewarm("train.py")
    assert imported == ["json", "no_such_module"] and len(failed) == 1 and failed[0].startswith("no_such_module:")
    imported.clear()
    monkeypatch.setenv("HYPERPODRUN_WARM_IMPORTS", "")
    assert zygote.prewarm("train.py") == [] and imported == [], "empty: nothing imported ahead"
    monkeypatch.delenv("HYPERPODRUN_WARM_IMPORTS")
    zygote.prewarm("no-such-script.py")
    assert imported == list(zygote.DEFAULT_IMPORTS), "unset: the defaults"


# ------------------------------------------------------------------------------------------ worker side
def test_worker_context_reads_the_contract() -> None:
    ctx = worker_context({"HYPERPODRUN_RUN_DIR": "/logs/run", "TORCHELASTIC_RUN_ID": "job",
                          "HYPERPODRUN_GENERATION": "4", "TORCHELASTIC_RESTART_COUNT": "4", "HYPERPODRUN_CONTROL": "ipc:///x",
                          "HYPERPODRUN_INPROCESS": "1", "HYPERPODRUN_HEARTBEAT_INTERVAL": "0.5",
                          "HYPERPODRUN_AGENT_PID": "77", "HYPERPODRUN_NODE_RANK": "1", "HYPERPODRUN_HOST": "h",
                          "HYPERPODRUN_JOB_KEY": "ab01"})
    assert ctx == WorkerContext(run_dir="/logs/run", run_id="job", generation=4, restart_count=4,
                                control="ipc:///x", inprocess=True, heartbeat_interval=0.5, agent_pid=77,
                                node_rank=1, host="h", job_key=b"\xab\x01")
    assert ctx.launched and ctx.under_inprocess_restart and "ab01" not in repr(ctx)
    plain = worker_context({})
    assert not plain.launched and not plain.under_inprocess_restart and plain.generation == 0
    assert worker_context({"TORCHELASTIC_RUN_ID": "t"}).launched, "started by torchrun"
    assert not worker_context({"HYPERPODRUN_INPROCESS": "1"}).under_inprocess_restart, "no control endpoint"


@pytest.mark.parametrize("name, value", [("HYPERPODRUN_GENERATION", "two"), ("TORCHELASTIC_RESTART_COUNT", "1.5"),
                                         ("HYPERPODRUN_HEARTBEAT_INTERVAL", "often"), ("HYPERPODRUN_JOB_KEY", "xyz")])
def test_worker_context_names_a_bad_value(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        worker_context({name: value})
    assert str(err.value).startswith(name) and "do not set it yourself" in str(err.value), str(err.value)


def test_the_zygote_loads_the_modules_behind_hyperpodruns_public_names(tmp_path) -> None:
    """`from hyperpodrun import CheckpointManager, MMAPDataLoader` at a script's top imports those modules only
    when the names are first used (hyperpodrun's lazy attributes): the zygote - and so a standby - loads them
    ahead, not the rank after a fault."""
    from hyperpodrun import _LAZY
    from hyperpodrun.agent.workers import zygote
    script = tmp_path / "train.py"
    script.write_text("import os\nfrom hyperpodrun import CheckpointManager, HPWrapper, __version__\n"
                      "import torch.nn as nn\n")
    names = zygote.script_imports(str(script))
    assert names == ["hyperpodrun", _LAZY["CheckpointManager"], _LAZY["HPWrapper"], "torch.nn"], names
    assert "hyperpodrun.state.checkpoint" in zygote.DEFAULT_IMPORTS
