"""The user's HYPERPODRUN_* environment settings, read and checked in one place.

Why one model: a setting that is misspelt or out of range (`HYPERPODRUN_WARM_RESPAWN=maybe`,
`HYPERPODRUN_LOG_LEVEL=loud`, a job secret of 4 bytes) must stop the launch with one line naming the
variable and the values it takes, before any worker starts; it must not be silently taken as a default,
nor surface later as a traceback inside the agent. The CLI calls `load()` once at start-up and pins the
result with `use()`; the agent's modules ask `current()`. In a process where nothing was pinned (a worker,
a plain `python train.py`, a test) `current()` follows the environment as it is now.

What is not here, on purpose:
- the variables the agent sets for its workers (HYPERPODRUN_CONTROL, _RUN_DIR, _GENERATION, ...): they are
  the worker environment contract, written and read in hyperpodrun/env.py;
- `HYPERPODRUN_<FLAG>` defaults of our own flags (HYPERPODRUN_INPROCESS_TIMEOUT, ...) and torchrun's PET_*:
  they are flags, read by click in hyperpodrun/cli.py and checked by LaunchConfig like the flag itself.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Optional

from pydantic import BaseModel, ConfigDict, SecretBytes

from hyperpodrun.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: default of HYPERPODRUN_SYMPTOM_GRACE_S (see agent/control/server.py: symptom_grace)
DEFAULT_SYMPTOM_GRACE_S = 0.25
MAX_SYMPTOM_GRACE_S = 60.0
#: default of HYPERPODRUN_EXIT_GRACE_S (see agent/observe/report.py: CauseWindow)
DEFAULT_EXIT_GRACE_S = 2.0
#: default of HYPERPODRUN_SHM_DIR: the tmpfs that holds the checkpointless snapshots
DEFAULT_SHM_DIR = "/dev/shm"
#: default of HYPERPODRUN_DURABLE_TIMEOUT_S: a request to the durable store that waits longer is retried
DEFAULT_DURABLE_TIMEOUT_S = 30.0
#: bounds of the job secret (HYPERPODRUN_JOB_SECRET or --job-secret-file; hyperpodrun/auth.py)
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
#: the variable with the user's job secret (the same on every node)
SECRET_ENV = "HYPERPODRUN_JOB_SECRET"


class Settings(BaseModel):
    """The HYPERPODRUN_* settings, validated (each field names its variable)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: HYPERPODRUN_LOG_LEVEL: the agent's log level (a name, or a number as the logging module takes)
    log_level: int = logging.INFO
    #: HYPERPODRUN_WARM_RESPAWN: fork respawned ranks from a warm zygote (agent/workers/warm_spawner.py)
    warm_respawn: bool = True
    #: HYPERPODRUN_WARM_IMPORTS: modules the zygote imports ahead (None: the known frameworks the script uses)
    warm_imports: Optional[tuple[str, ...]] = None
    #: HYPERPODRUN_GC_FREEZE: freeze what exists when HPWrapper first calls the function out of the cyclic
    #: garbage collector's view, so a collection on the restart path scans only what training made since
    gc_freeze: bool = True
    #: HYPERPODRUN_ROLL_CALL: every new default process group proves that each member knows the workers' key
    #: before any user collective (runtime/roll_call.py); 0 turns it off
    roll_call: bool = True
    #: HYPERPODRUN_NCCL_ABORT_BACKGROUND: a restart's NCCL communicator aborts run in a thread of their own
    #: while the rank goes on to the next generation (runtime/abort.py); 0: in the restarting thread
    nccl_abort_background: bool = True
    #: HYPERPODRUN_STANDBY_KERNEL_WARM: a standby launches the usual training kernels once, tiny, before it
    #: reports ready (agent/workers/kernel_warm.py), so the rank it becomes does not load them lazily after a fault
    standby_kernel_warm: bool = True
    #: HYPERPODRUN_SYMPTOM_GRACE_S: how long a symptom of another rank's fault waits for the real cause
    symptom_grace_s: float = DEFAULT_SYMPTOM_GRACE_S
    #: HYPERPODRUN_EXIT_GRACE_S: how long a worker exit that looks like a symptom of another rank's failure
    #: waits for that failure's own exit (process-level restarts); ends early once the real one is seen
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S
    #: HYPERPODRUN_RESTART_GRACE_S: how long a rank may take to leave the failed generation after RESTART before
    #: the agent kills and replaces it (None: max(2 x --heartbeat-interval, min(--heartbeat-timeout,
    #: --inprocess-timeout / 4))). Raise it above the process group's timeout where gloo collectives must
    #: always be left in-process (docs/ARCHITECTURE.md, "Restart protocol")
    restart_grace_s: Optional[float] = None
    #: HYPERPODRUN_LOG_DIR: the base directory of the run logs when --log-dir is not given
    log_dir: Optional[str] = None
    #: HYPERPODRUN_SHM_DIR: the tmpfs under which CheckpointManager keeps its snapshots
    shm_dir: str = DEFAULT_SHM_DIR
    #: HYPERPODRUN_DURABLE_TIMEOUT_S: how long one request to the durable store (S3) may wait for a connection
    #: or an answer before it is retried (hyperpodrun/state/durable/stores.py)
    durable_timeout_s: float = DEFAULT_DURABLE_TIMEOUT_S
    #: HYPERPODRUN_JOB_SECRET: the user's job secret (stripped; never shown in a repr)
    job_secret: Optional[SecretBytes] = None


def _bool(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not on or off; use 1 or 0 (also true/false, yes/no, on/off)")


def _level(name: str, raw: str) -> int:
    text = raw.strip()
    if text.isdigit() and int(text) <= 50:
        return int(text)
    if text.upper() in _LEVELS:
        return int(logging.getLevelName(text.upper()))
    raise ConfigError(f"{name}={raw!r} is not a log level; use one of {', '.join(_LEVELS)} (or a number 0-50)")


def _grace(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_SYMPTOM_GRACE_S:   # nan and inf fail here too
        raise ConfigError(f"{name}={raw!r} is not a number of seconds in 0..{MAX_SYMPTOM_GRACE_S:g}")
    return value


def _positive_grace(name: str, raw: str) -> float:
    value = _grace(name, raw)
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds in 0..{MAX_SYMPTOM_GRACE_S:g} (above 0)")
    return value


def _timeout(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:   # nan and inf fail here too
        raise ConfigError(f"{name}={raw!r} is not a number of seconds in 0..3600 (above 0)")
    return value


def _modules(name: str, raw: str) -> tuple[str, ...]:
    mods = tuple(m.strip() for m in raw.split(",") if m.strip())
    for mod in mods:
        if not all(part.isidentifier() for part in mod.split(".")):
            raise ConfigError(f"{name}={raw!r}: {mod!r} is not a module name; give a comma-separated list "
                              "such as torch,transformers")
    return mods


def _path(_name: str, raw: str) -> str:
    return raw


def check_secret(secret: bytes, where: str, what: str = "job secret") -> bytes:
    """A job secret (or another `what`: the status API's token), stripped; ConfigError naming `where` it came
    from when it is too short."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: the {what} has {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
                          "(e.g. `openssl rand -hex 32`)")
    return secret


def _secret(name: str, raw: str) -> SecretBytes:
    return SecretBytes(check_secret(raw.encode(), name))


#: field -> (variable suffix, parser, whether an empty value counts as set)
_VARIABLES: dict[str, tuple[str, Callable[[str, str], Any], bool]] = {
    "log_level": ("LOG_LEVEL", _level, False),
    "warm_respawn": ("WARM_RESPAWN", _bool, False),
    "warm_imports": ("WARM_IMPORTS", _modules, True),   # "" is valid: import nothing ahead
    "gc_freeze": ("GC_FREEZE", _bool, False),
    "roll_call": ("ROLL_CALL", _bool, False),
    "nccl_abort_background": ("NCCL_ABORT_BACKGROUND", _bool, False),
    "standby_kernel_warm": ("STANDBY_KERNEL_WARM", _bool, False),
    "symptom_grace_s": ("SYMPTOM_GRACE_S", _grace, False),
    "exit_grace_s": ("EXIT_GRACE_S", _grace, False),
    "restart_grace_s": ("RESTART_GRACE_S", _positive_grace, False),
    "log_dir": ("LOG_DIR", _path, False),
    "shm_dir": ("SHM_DIR", _path, False),
    "durable_timeout_s": ("DURABLE_TIMEOUT_S", _timeout, False),
    "job_secret": ("JOB_SECRET", _secret, False),
}


def variable(field: str) -> str:
    """The environment variable of a Settings field (`shm_dir` -> `HYPERPODRUN_SHM_DIR`)."""
    return "HYPERPODRUN_" + _VARIABLES[field][0]


def _values(env: Mapping[str, str], strict: bool) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field, (suffix, parse, empty_is_set) in _VARIABLES.items():
        name = "HYPERPODRUN_" + suffix
        raw = env.get(name)
        if raw is None or (raw == "" and not empty_is_set):
            continue
        try:
            values[field] = parse(name, raw)
        except ConfigError as exc:
            if strict:
                raise
            if str(exc) not in _warned:   # lenient: this one variable falls back to its default
                _warned.add(str(exc))
                logging.getLogger("hyperpodrun").warning("%s; using the default", exc)
    return values


def read(field: str, environ: Mapping[str, str]) -> Any:
    """One setting from `environ`: its value, or its default when the variable is unset; ConfigError when
    it is bad."""
    suffix, parse, empty_is_set = _VARIABLES[field]
    raw = environ.get("HYPERPODRUN_" + suffix)
    if raw is None or (raw == "" and not empty_is_set):
        return Settings.model_fields[field].default
    return parse("HYPERPODRUN_" + suffix, raw)


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read and check the settings from `environ` (default os.environ); ConfigError names the bad one."""
    return Settings.model_validate(_values(os.environ if environ is None else environ, strict=True))


_pinned: Optional[Settings] = None
_warned: set[str] = set()


def current() -> Settings:
    """The settings of this process. Pinned by the CLI at start-up (a bad value already stopped the launch);
    elsewhere read from the environment at each call (tests and user code may change it), and a bad value
    falls back to that setting's default with one warning."""
    if _pinned is not None:
        return _pinned
    return Settings.model_validate(_values(os.environ, strict=False))


def use(settings: Settings) -> Settings:
    """Pin `settings` as this process's settings (the CLI, after load())."""
    global _pinned
    _pinned = settings
    return settings


def job_secret() -> Optional[bytes]:
    """HYPERPODRUN_JOB_SECRET (checked), or None when it is not set."""
    secret = current().job_secret
    return secret.get_secret_value() if secret is not None else None
