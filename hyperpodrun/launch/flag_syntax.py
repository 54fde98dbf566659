"""The syntax of flag values: pure parsers from a flag's text to its value, and the table of refused flags.

Each parser raises ConfigError naming the flag, the value and an example of what it takes; none looks at
the machine (that is hyperpodrun/launch/host_checks.py). LaunchConfig's validators call them
(hyperpodrun/launch/config.py); the names are also importable from hyperpodrun.launch.config as before.
"""
from __future__ import annotations

import re
import shlex
import signal
import string
from typing import Any, Optional

from pydantic import TypeAdapter, ValidationError

from hyperpodrun.errors import ConfigError

STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3

#: torchrun flags that are refused (exit 2), and why; `hyperpodrun --help` lists them
UNSUPPORTED: dict[str, tuple[str, str]] = {}
#: torchrun flags accepted for compatibility with no effect, and the values they take
ACCEPTED_ONLY = {
    "start_method": ("spawn", "fork", "forkserver"),
    "event_log_handler": (None, "null", "console"),
}
#: --logs-specs names hyperpodrun honours: `default` (torchrun's entry point for its own LogsSpecs) means hyperpodrun's
#: own log layout, docs/logs.md; a plugin's class decides paths and tees our agent does not use, so it is refused
LOGS_SPECS = ("default",)


def check_logs_specs(value: Optional[str]) -> None:
    """`--logs-specs`: not given or `default`; any other name is a ConfigError with the fix."""
    if value is None or value.strip() in LOGS_SPECS:
        return
    raise ConfigError(f"--logs-specs {value!r}: hyperpodrun loads no LogsSpecs plugin, it writes its own log layout "
                      "(docs/logs.md); accepted: default (or drop the flag)")


def parse_filters(value: str) -> list[str]:
    """torchrun's --duplicate-stdout/stderr-filters list: `apple,orange` -> ['apple', 'orange']; `,,` is a comma
    inside a filter (torch/distributed/run.py, comma_separated_list). A line is copied when it contains any."""
    return [item.replace("\0", ",") for item in value.replace(",,", "\0").split(",")]


#: the macros of --log-line-prefix-template (torchrun's, rendered with string.Template.safe_substitute)
PREFIX_MACROS = ("role_name", "rank", "local_rank", "hostname")


def render_prefix(template: str, role: str, rank: int, local_rank: int, hostname: str) -> str:
    """--log-line-prefix-template for one worker, as torchrun renders it (LocalElasticAgent._start_workers):
    `${role_name}`, `${rank}` (global), `${local_rank}` and `${hostname}` are replaced, anything else is left
    as written (safe_substitute), and the result goes before each line as is."""
    return string.Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank,
                                                     hostname=hostname)


def refuse_unsupported(flags: dict[str, Any]) -> None:
    """The refused torchrun flags, and the accepted-only ones with a value they do not take (popped from
    `flags`, the LaunchConfig input)."""
    for key, (flag, why) in UNSUPPORTED.items():
        if flags.pop(key, None):
            raise ConfigError(f"{flag} is not supported by hyperpodrun ({why}); drop it (see docs/flags.md, "
                              "'Differences from torchrun')")
    check_logs_specs(flags.pop("logs_specs", None))
    handler = flags.pop("event_log_handler", None)
    if handler not in ACCEPTED_ONLY["event_log_handler"]:
        raise ConfigError(f"--event-log-handler {handler!r} is not supported; hyperpodrun writes "
                          "its own event log (hyperpodrun logs --events)")
    if flags.pop("start_method", "spawn") not in ACCEPTED_ONLY["start_method"]:
        raise ConfigError("--start-method must be spawn, fork or forkserver")


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
        raise ConfigError(f"--nnodes {value!r} is not a number of nodes; use N or N:N (e.g. --nnodes 2)") from None
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
            raise ConfigError(f"{flag} {value!r} is not a signal number on this system (e.g. 15 or SIGTERM)") \
                from None
        return num
    name = text.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ConfigError(f"{flag} {value!r} is not a signal name (e.g. SIGTERM, SIGINT, SIGKILL, SIGUSR1)") \
            from None


def parse_signal_list(value: str, flag: str = "--signals-to-handle") -> list[int]:
    """`SIGTERM,SIGINT` -> [15, 2] (empty items are skipped)."""
    return [parse_signal(s, flag) for s in filter(None, (x.strip() for x in value.split(",")))]


def parse_endpoint(value: str, default_port: int = 29400) -> tuple[str, int]:
    """`host:port`, `host`, `[v6]:port` -> (host, port)."""
    text = value.strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", text)
    port: Optional[str]
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
        raise ConfigError(f"--rdzv-endpoint {value!r}: port {port!r} is not a number; use HOST:PORT") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"--rdzv-endpoint {value!r}: port must be 0-65535")
    return host, p


def parse_conf(text: str) -> dict[str, str]:
    """`--rdzv-conf KEY=VALUE,...` -> {KEY: VALUE}."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"--rdzv-conf item {item!r} is not KEY=VALUE (e.g. --rdzv-conf join_timeout=900)")
        key, val = item.split("=", 1)
        out[key.strip()] = val.strip()
    return out


def parse_rank_list(value: str, nproc: Optional[int]) -> list[int]:
    """`--local-ranks-filter 0,1` -> [0, 1] (sorted, unique), each a local rank below `nproc`."""
    try:
        ranks = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise ConfigError("--local-ranks-filter must be a comma-separated list of local ranks, e.g. 0,1,2") from None
    if nproc is not None and (not ranks or any(r < 0 or r >= nproc for r in ranks)):
        raise ConfigError(f"--local-ranks-filter {value!r}: local ranks are 0..{nproc - 1}")
    return ranks


def split_args(flag: str, text: Optional[str]) -> list[str]:
    """A shell-quoted argument string (`--pre-train-args "-x 'a b'"`) -> its arguments."""
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc} (give the arguments as one shell-quoted string)") from None


_BOOL = TypeAdapter(bool)


def as_bool(value: Any) -> bool:
    """A boolean flag's raw value as LaunchConfig's validation will read it (True, "1", "yes", ...), for a
    validator that must look at it before the fields are validated; an invalid one reads False (its field
    reports it)."""
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        return False


#: set by Kubernetes in every pod of an Indexed Job (batch/v1): the pod's index, 0..completions-1
JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"


def node_rank_from(given: Optional[int], source: Optional[str], nnodes: int) -> int:
    """The static rendezvous' node rank: --node-rank or PET_NODE_RANK as given; else (click read it from
    JOB_COMPLETION_INDEX) the Indexed Job's pod index, on several nodes only - one node is rank 0 whatever
    the index; else 0. The index is unique only within one Job: a JobSet of several Jobs, or a PyTorchJob,
    gives PET_NODE_RANK, which comes first."""
    if given is None:
        return 0
    if source != JOB_INDEX_ENV:
        return given
    if nnodes == 1:
        return 0
    if given >= nnodes:
        raise ConfigError(f"{JOB_INDEX_ENV}={given} is not a node rank of --nnodes {nnodes}: the Indexed Job has more "
                          f"pods than nodes; set its completions and parallelism to {nnodes}, or give each pod "
                          "PET_NODE_RANK (extra pods as hot spares need the c10d rendezvous)")
    return given
