"""Validated launch configuration: what the CLI hands to the agent.

Every flag ends up here; validation errors carry the flag's name and the fix, so the CLI can print them
as one short usage error (exit 2) instead of a traceback.
"""
from __future__ import annotations

import os
import re
import signal
import stat
import tempfile
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hyperpodrun.errors import ConfigError

STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3

# Bounds of the numeric flags (README, Flags). A value past them is a typo or an overflow, never a job: an
# agent asked for 10**20 workers would grow until the OOM killer ends it, a timeout of 1e400 s never fires.
#: workers per node (the largest machines have a few hundred CPU cores; a GPU node has 8-16 GPUs)
MAX_NPROC_PER_NODE = 1024
#: nodes in one job
MAX_NNODES = 65536
#: restart budgets and failure counts
MAX_COUNT = 1_000_000
#: every timeout: one week
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: every polling interval: at least 1 ms (a busy loop otherwise), at most one hour
MIN_INTERVAL_S = 0.001
MAX_INTERVAL_S = 3600.0

#: how each LaunchConfig field is spelt on the command line, where it is not --<field-with-dashes>
FLAG_OF_FIELD = {"join_timeout": "--rdzv-conf join_timeout", "rdzv_port": "--master-port/--rdzv-endpoint port",
                 "entrypoint": "TRAINING_SCRIPT", "rdzv_host": "--rdzv-endpoint host"}


def parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max). Elastic ranges are refused by the caller, not here."""
    text = str(value).strip()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes {value!r} is not a number of nodes; use N or N:N (e.g. --nnodes 2)")
    if lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {value!r}: need 1 <= MIN <= MAX (e.g. --nnodes 2 or 2:2)")
    return lo, hi


def parse_std_map(value: str, flag: str, nproc: int) -> dict[int, int]:
    """torchrun's `-r/-t` syntax: `3` for every local rank, or `0:3,1:0` per local rank."""
    text = str(value).strip()
    allowed = "0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
    if re.fullmatch(r"[0-3]", text):
        return {lr: int(text) for lr in range(nproc)}
    out: dict[int, int] = {lr: STD_NONE for lr in range(nproc)}
    if not text:
        raise ConfigError(f"{flag} is empty; use {allowed}, or a per-rank map such as 0:3,1:0")
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-3])\s*", item)
        if not m:
            raise ConfigError(
                f"{flag} {value!r}: {item!r} is not LOCAL_RANK:MODE; MODE is {allowed} (e.g. {flag} 0:3,1:0)")
        lr, mode = int(m.group(1)), int(m.group(2))
        if lr >= nproc:
            raise ConfigError(f"{flag} {value!r}: local rank {lr} does not exist with {nproc} processes per node")
        out[lr] = mode
    return out


def parse_signal(value: str | int, flag: str = "--shutdown-signal") -> int:
    """`SIGTERM`, `TERM`, `15` -> 15."""
    text = str(value).strip()
    if text.isdigit():
        num = int(text)
        try:
            signal.Signals(num)
        except ValueError:
            raise ConfigError(f"{flag} {value!r} is not a signal number on this system (e.g. 15 or SIGTERM)")
        return num
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ConfigError(f"{flag} {value!r} is not a signal name (e.g. SIGTERM, SIGINT, SIGKILL, SIGUSR1)")


def parse_endpoint(value: str, default_port: int = 29400) -> tuple[str, int]:
    """`host:port`, `host`, `[v6]:port` -> (host, port)."""
    text = value.strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", text)
    if m:
        host, port = m.group(1), m.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None
    if not host:
        raise ConfigError(f"--rdzv-endpoint {value!r} has no host; use HOST:PORT (e.g. 10.0.0.1:29400)")
    try:
        p = int(port) if port not in (None, "") else default_port
    except ValueError:
        raise ConfigError(f"--rdzv-endpoint {value!r}: port {port!r} is not a number; use HOST:PORT")
    if not 0 <= p <= 65535:
        raise ConfigError(f"--rdzv-endpoint {value!r}: port must be 0-65535")
    return host, p


def temp_log_base() -> str:
    """The per-user log directory in the temp dir (`$TMPDIR/hyperpodrun-logs-<uid>`): a predictable path in a
    directory every user can write, so it is kept ours alone (`private_log_base`)."""
    return os.path.join(tempfile.gettempdir(), f"hyperpodrun-logs-{os.getuid()}")


def default_log_dir(create: bool = False) -> str:
    """Where logs go without --log-dir; `hyperpodrun logs` looks here by default too.

    HYPERPODRUN_LOG_DIR / PET_LOG_DIR are the user's, like --log-dir; otherwise the per-user temp dir, which
    `create=True` makes (or accepts) as ours alone - ConfigError when another user got there first."""
    env = os.environ.get("HYPERPODRUN_LOG_DIR") or os.environ.get("PET_LOG_DIR")
    if env:
        return env
    return private_log_base() if create else temp_log_base()


def private_log_base() -> str:
    """Create `temp_log_base()` 0700, or accept it only when it is a real directory of ours that nobody else
    can write (one of ours that is merely readable by others, from an older version, is narrowed to 0700)."""
    from hyperpodrun import safe_fs
    path = temp_log_base()
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077
                    and not st.st_mode & 0o022):
                os.chmod(path, 0o700)
        return safe_fs.private_dir(path)
    except (OSError, safe_fs.UnsafePathError) as exc:
        raise ConfigError(f"the default log directory is not safe to use: {exc}; or give --log-dir DIR")


_WEEK = f"a finite number of seconds, more than 0 and at most {MAX_TIMEOUT_S:.0f} (one week)"
_INTERVAL = f"a number of seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:.0f}"
#: what each bounded field accepts, in words (the second half of its error line)
ACCEPTS = {
    "nnodes": f"a whole number of nodes from 1 to {MAX_NNODES}",
    "nproc_per_node": f"a whole number of workers per node from 1 to {MAX_NPROC_PER_NODE} (or auto, gpu, cpu)",
    "node_rank": "a whole number from 0 to --nnodes minus 1",
    "rdzv_port": "a port from 0 to 65535",
    "join_timeout": _WEEK,
    "max_restarts": f"a whole number from 0 to {MAX_COUNT}",
    "max_step_failures": f"a whole number from 1 to {MAX_COUNT}",
    "monitor_interval": _INTERVAL,
    "heartbeat_interval": _INTERVAL,
    "health_interval": _INTERVAL,
    "shutdown_timeout": f"a finite number of seconds from 0 to {MAX_TIMEOUT_S:.0f} (one week)",
    "inprocess_timeout": _WEEK,
    "heartbeat_timeout": _WEEK,
    "progress_timeout": _WEEK,
}


def flag_of(field: str) -> str:
    """The command-line spelling of a LaunchConfig field."""
    return FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def describe_validation_error(exc: ValidationError, sources: Optional[dict[str, str]] = None) -> str:
    """A pydantic error of LaunchConfig as one line: `--flag VALUE: must be <what it accepts>`.

    `sources` maps a field to the environment variable its value came from, so the line names it."""
    parts = []
    for err in exc.errors():
        loc = err.get("loc") or ("",)
        field = str(loc[0])
        where = flag_of(field)
        if sources and field in sources:
            where += f" (from {sources[field]})"
        if field in ACCEPTS:
            parts.append(f"{where} {str(err.get('input'))!r}: must be {ACCEPTS[field]}")
        else:
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts))


class LaunchConfig(BaseModel):
    """Everything one agent needs to run its node's share of the job."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    # entrypoint
    entrypoint: str
    args: list[str] = Field(default_factory=list)
    module: bool = False
    no_python: bool = False
    run_path: bool = False

    # topology
    nnodes: int = Field(1, ge=1, le=MAX_NNODES)
    nproc_per_node: int = Field(1, ge=1, le=MAX_NPROC_PER_NODE)
    node_rank: Optional[int] = Field(0, ge=0, lt=MAX_NNODES)
    rdzv_backend: Literal["static", "c10d"] = "static"
    rdzv_host: str = "localhost"
    rdzv_port: int = Field(0, ge=0, le=65535)
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = Field(default_factory=dict)
    join_timeout: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    master_addr: str = "localhost"
    local_addr: Optional[str] = None
    single_node: bool = True
    role: str = "default"

    # supervision
    max_restarts: int = Field(0, ge=0, le=MAX_COUNT)
    monitor_interval: float = Field(0.1, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    shutdown_signal: int = int(signal.SIGTERM)
    shutdown_timeout: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    signals_to_handle: list[int] = Field(
        default_factory=lambda: [int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)])

    # in-process restart (DESIGN §4)
    inprocess_restart: bool = False
    inprocess_timeout: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    heartbeat_interval: float = Field(1.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    heartbeat_timeout: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    progress_timeout: Optional[float] = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    max_step_failures: int = Field(3, ge=1, le=MAX_COUNT)

    # GPU health (agent/gpu_health.py): NVML monitor where it loads (auto), required (nvml), or off (none)
    health_check: Literal["auto", "nvml", "none"] = "auto"
    health_interval: float = Field(5.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)

    # logs
    log_dir: str = Field(default_factory=default_log_dir)
    redirects: dict[int, int] = Field(default_factory=dict)
    tee: dict[int, int] = Field(default_factory=dict)
    local_ranks_filter: Optional[list[int]] = None

    # security (hyperpodrun/auth.py): file with the job secret; None -> HYPERPODRUN_JOB_SECRET or one of our own
    job_secret_file: Optional[str] = None

    # hooks
    pre_train_script: Optional[str] = None
    pre_train_args: list[str] = Field(default_factory=list)
    post_train_script: Optional[str] = None
    post_train_args: list[str] = Field(default_factory=list)

    # fault-injection seam (tests and chaos drills): lets `hyperpodrun inject` reach this agent
    allow_inject: bool = True

    @model_validator(mode="after")
    def _check_together(self) -> "LaunchConfig":
        if self.module and self.no_python:
            raise ConfigError("--no-python and -m/--module cannot be used together: pick one")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}; use 0..{self.nnodes - 1}")
        if self.inprocess_restart:
            if not self.heartbeat_interval < self.heartbeat_timeout:
                raise ConfigError(
                    f"--heartbeat-interval ({self.heartbeat_interval:g}s) must be shorter than "
                    f"--heartbeat-timeout ({self.heartbeat_timeout:g}s)")
            if not self.heartbeat_timeout < self.inprocess_timeout:
                raise ConfigError(
                    f"--heartbeat-timeout ({self.heartbeat_timeout:g}s) must be shorter than "
                    f"--inprocess-timeout ({self.inprocess_timeout:g}s)")
            if self.progress_timeout is not None and self.progress_timeout <= self.heartbeat_interval:
                raise ConfigError(
                    f"--progress-timeout ({self.progress_timeout:g}s) must be longer than "
                    f"--heartbeat-interval ({self.heartbeat_interval:g}s)")
        return self

    @property
    def world_size_hint(self) -> int:
        """World size when every node runs the same number of workers (the usual case)."""
        return self.nnodes * self.nproc_per_node

    def console_ranks(self) -> set[int]:
        """Local ranks whose output is shown on the console."""
        if self.local_ranks_filter is None:
            return set(range(self.nproc_per_node))
        return set(self.local_ranks_filter)
