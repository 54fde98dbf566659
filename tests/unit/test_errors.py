"""One error hierarchy (hyperpodrun/errors.py): everything hyperpodrun raises on purpose is a HyperpodrunError,
keeps the builtin class callers catch, and stays importable where users import it."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import hyperpodrun
from hyperpodrun import errors

PACKAGE = Path(hyperpodrun.__file__).parent

#: exceptions hyperpodrun/ may raise that are not errors of ours, and why
NOT_OURS = {
    "_Silent": "roll_call._wait: an internal signal its one caller turns into RollCallError right there",
    "SystemExit": "ends the process with the agent's exit code (HPWrapper on SHUTDOWN)",
    "RestartInterrupt": "unwinds the training function at a restart: control flow, a BaseException on purpose",
    "AttributeError": "the attribute protocol of module and class __getattr__",
    "KeyError": "codec_format.own_attr: an internal lookup its callers catch (or loads turns into CodecError)",
    "OSError": "peer_copy: a refused copy joins the OSError path of a broken connection, caught right there",
    "UsageError": "click: `hyperpodrun logs` / `inject` usage errors (exit 2, one line)",
    "ClickException": "click: the `inject` tool's failure line",
}
#: helpers that build the error they are raised with -> its class
FACTORIES = {"_lost": "DataStateLostError", "_set_by_us": "ConfigError", "saved_where": "UnsupportedStateError"}


def _raised_names() -> dict[str, list[str]]:
    """Name of each exception class raised in hyperpodrun/ -> where ('raise X(...)' and 'raise mod.X(...)')."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "agent" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
                found.setdefault(name, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_everything_raised_on_purpose_is_a_hyperpodrun_error() -> None:
    stray = {}
    for name, where in _raised_names().items():
        if name in NOT_OURS:
            continue
        cls = getattr(errors, FACTORIES.get(name, name), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.HyperpodrunError)):
            stray[name] = where
    assert not stray, f"raise a class of hyperpodrun/errors.py instead: {stray}"


def test_everything_the_agent_raises_on_purpose_is_a_hyperpodrun_error() -> None:
    """The same for hyperpodrun.agent (agent/): a raised name is looked up in the module that raises it (its own
    classes, IllegalTransition or WarmSpawnError, derive from HyperpodrunError too)."""
    import hyperpodrun.agent
    factories = {"_fail": "DeviceQueryError"}   # nvml_backend: builds the DeviceQueryError it is raised with
    stray = {}
    for path in sorted(Path(hyperpodrun.agent.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"hyperpodrun.agent.{path.stem}") if path.stem != "__init__" else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
                name = factories.get(name, name)
                cls = getattr(module, name, None) or getattr(errors, name, None)
                if name not in NOT_OURS and not (isinstance(cls, type) and issubclass(cls, errors.HyperpodrunError)):
                    stray.setdefault(name, []).append(f"agent/{path.name}:{node.lineno}")
    assert not stray, f"raise a class of hyperpodrun/errors.py (or one derived from HyperpodrunError): {stray}"


def test_every_class_of_the_hierarchy_derives_from_hyperpodrun_error() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) > 20
    assert all(issubclass(c, errors.HyperpodrunError) for c in classes)


@pytest.mark.parametrize("cls, builtin", [
    (errors.StateLostError, RuntimeError), (errors.DataStateLostError, errors.StateLostError),
    (errors.ApiValueError, ValueError), (errors.ApiTypeError, TypeError), (errors.UnsupportedStateError, TypeError),
    (errors.CodecError, ValueError), (errors.SnapshotCorrupt, ValueError), (errors.ProtocolError, ValueError),
    (errors.ReplicaLayoutError, ValueError), (errors.HealthCheckError, RuntimeError),
    (errors.InjectedFault, RuntimeError), (errors.CacheFullError, OSError), (errors.CacheTimeoutError, TimeoutError),
    (errors.MMAPConfigError, ValueError), (errors.MissingDependencyError, ImportError),
    (errors.RankEnvironmentTimeout, TimeoutError), (errors.StateMismatchError, KeyError),
])
def test_builtin_bases_are_kept(cls: type, builtin: type) -> None:
    assert issubclass(cls, builtin) and issubclass(cls, errors.HyperpodrunError)


def test_config_error_passes_through_pydantic() -> None:
    """Not a ValueError: raised in a LaunchConfig validator it reaches the CLI as it is (one line)."""
    assert not issubclass(errors.ConfigError, ValueError)


@pytest.mark.parametrize("module, name", [
    ("hyperpodrun.state.checkpoint", "StateLostError"), ("hyperpodrun.state.checkpoint", "SnapshotCorrupt"),
    ("hyperpodrun.state.checkpoint", "UnsupportedStateError"), ("hyperpodrun.state.codec.safe_codec", "CodecError"),
    ("hyperpodrun.state.codec.safe_codec", "UnsupportedStateError"), ("hyperpodrun.state.slots.snapshot_io", "SnapshotCorrupt"),
    ("hyperpodrun.state.restore.replicas", "ReplicaLayoutError"), ("hyperpodrun.runtime.health", "HealthCheckError"),
    ("hyperpodrun.runtime.inject", "InjectedFault"), ("hyperpodrun.protocol", "ProtocolError"),
    ("hyperpodrun.auth", "AuthError"), ("hyperpodrun.safe_fs", "UnsafePathError"),
    ("hyperpodrun.data", "CacheFullError"), ("hyperpodrun.data", "DataStateLostError"),
    ("hyperpodrun.data", "MMAPConfigError"), ("hyperpodrun.data.errors", "CacheCorruptError"),
    ("hyperpodrun.data.errors", "CacheTimeoutError"), ("hyperpodrun", "StateLostError"),
])
def test_public_names_stay_where_users_import_them(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_worker_api_argument_errors() -> None:
    from hyperpodrun import CheckpointManager, HPWrapper
    with pytest.raises(errors.ApiValueError, match=r"HPWrapper\(abort_timeout=0\)"):
        HPWrapper(abort_timeout=0)
    with pytest.raises(errors.ApiValueError, match=r"fallback_every=0"):
        CheckpointManager(fallback_dir="/tmp/x", fallback_every=0)
    for bad in (0, 1.5, -0.1, True, "2%"):
        with pytest.raises(errors.ApiValueError, match=r"max_overhead=.*between 0 and 1"):
            CheckpointManager(max_overhead=bad)   # type: ignore[arg-type]
    with pytest.raises(errors.ApiTypeError, match="state must be a dict"):
        CheckpointManager().save(1, [1, 2])
    assert errors.CacheFullError("full").errno == 28 and errors.StateLostError.exit_code == errors.EXIT_STATE_LOST
