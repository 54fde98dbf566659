"""The agent's HYPERPODRUN_* environment settings, read and checked in one place.

Why one model: a setting that is misspelt or out of range (`HYPERPODRUN_WARM_RESPAWN=maybe`,
`HYPERPODRUN_LOG_LEVEL=loud`) must stop the launch with one line naming the variable and the values it
takes, before any worker starts; it must not be silently taken as a default, nor surface later as a
traceback inside the agent. The CLI calls `load()` once at start-up; the agent's modules ask `current()`.

Variables the agent sets for its workers (HYPERPODRUN_RANK-like identity, HYPERPODRUN_CONTROL, ...) are
not settings and are not read here. HYPERPODRUN_LOG_DIR and HYPERPODRUN_JOB_SECRET are read where they are
used (hyperpodrun/config.py, hyperpodrun/auth.py).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from pydantic import BaseModel, ConfigDict

from hyperpodrun.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: default of HYPERPODRUN_SYMPTOM_GRACE_S (see agent/control.py: symptom_grace)
DEFAULT_SYMPTOM_GRACE_S = 0.25
MAX_SYMPTOM_GRACE_S = 60.0
#: default of HYPERPODRUN_EXIT_GRACE_S (see agent/report.py: CauseWindow)
DEFAULT_EXIT_GRACE_S = 2.0


class Settings(BaseModel):
    """The HYPERPODRUN_* settings of the agent, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: HYPERPODRUN_LOG_LEVEL: the agent's log level (a name, or a number as the logging module takes)
    log_level: int = logging.INFO
    #: HYPERPODRUN_WARM_RESPAWN: fork respawned ranks from a warm zygote (agent/warm_spawner.py)
    warm_respawn: bool = True
    #: HYPERPODRUN_WARM_IMPORTS: modules the zygote imports ahead (None: the known frameworks the script uses)
    warm_imports: Optional[tuple[str, ...]] = None
    #: HYPERPODRUN_SYMPTOM_GRACE_S: how long a symptom of another rank's fault waits for the real cause
    symptom_grace_s: float = DEFAULT_SYMPTOM_GRACE_S
    #: HYPERPODRUN_EXIT_GRACE_S: how long a worker exit that looks like a symptom of another rank's failure
    #: waits for that failure's own exit (process-level restarts); ends early once the real one is seen
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S


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


def _seconds(name: str, raw: str, hi: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= hi:   # nan and inf fail here too
        raise ConfigError(f"{name}={raw!r} is not a number of seconds in 0..{hi:g}")
    return value


def _modules(name: str, raw: str) -> tuple[str, ...]:
    mods = tuple(m.strip() for m in raw.split(",") if m.strip())
    for mod in mods:
        if not all(part.isidentifier() for part in mod.split(".")):
            raise ConfigError(f"{name}={raw!r}: {mod!r} is not a module name; give a comma-separated list "
                              "such as torch,transformers")
    return mods


def load(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read and check the settings from `environ` (default os.environ); ConfigError names the bad one."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}

    def raw(key: str) -> Optional[str]:
        val = env.get(f"HYPERPODRUN_{key}")
        return val if val not in (None, "") else None

    if (text := raw("LOG_LEVEL")) is not None:
        values["log_level"] = _level("HYPERPODRUN_LOG_LEVEL", text)
    if (text := raw("WARM_RESPAWN")) is not None:
        values["warm_respawn"] = _bool("HYPERPODRUN_WARM_RESPAWN", text)
    if (text := env.get("HYPERPODRUN_WARM_IMPORTS")) is not None:   # "" is valid: import nothing ahead
        values["warm_imports"] = _modules("HYPERPODRUN_WARM_IMPORTS", text)
    if (text := raw("SYMPTOM_GRACE_S")) is not None:
        values["symptom_grace_s"] = _seconds("HYPERPODRUN_SYMPTOM_GRACE_S", text, MAX_SYMPTOM_GRACE_S)
    if (text := raw("EXIT_GRACE_S")) is not None:
        values["exit_grace_s"] = _seconds("HYPERPODRUN_EXIT_GRACE_S", text, MAX_SYMPTOM_GRACE_S)
    return Settings(**values)


_current: Optional[Settings] = None


def current() -> Settings:
    """The settings of this process: loaded once (the CLI loads them first, so a bad value already stopped
    the launch; anywhere else a bad value falls back to the defaults with one warning)."""
    global _current
    if _current is None:
        try:
            _current = load()
        except ConfigError as exc:
            logging.getLogger("hyperpodrun").warning("%s; using the defaults", exc)
            _current = Settings()
    return _current


def use(settings: Settings) -> Settings:
    """Make `settings` this process's settings (the CLI, after load())."""
    global _current
    _current = settings
    return settings
