"""Validated launch configuration: what the CLI hands to the agent, and every check of it.

LaunchConfig owns all validation of a launch, as pydantic validators:
- field validators turn a flag's text into the field's value (`--nproc-per-node auto`, `--tee 0:3,1:0`,
  `--shutdown-signal TERM`; hyperpodrun/launch/flag_syntax.py), and the field constraints bound every number;
- `_from_flags` (before the fields, only for `LaunchConfig.from_flags`) refuses the flags hyperpodrun does not
  support and derives the topology fields (rendezvous host and port, node rank, master address) from
  torchrun's flags;
- `_standby_auto` (before the fields) turns `--standby-workers auto` into this host's count;
- `_check_together` (after the fields) checks what involves several of them;
- `_check_host` (after, only for `from_flags`) checks them against this machine: the script exists, the
  log directory takes data, the job secret is usable, NVML loads (hyperpodrun/launch/host_checks.py).
A problem is one line naming the flag (and the environment variable its value came from) and the fix: a
ConfigError raised by a validator passes through pydantic unchanged; a bound that does not hold becomes
one through `describe_validation_error`. The CLI prints it and exits 2.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from hyperpodrun.env import virtual_device
from hyperpodrun.errors import ConfigError
from hyperpodrun.launch.flag_syntax import (STD_ALL, STD_ERR, STD_NONE, STD_OUT, as_bool, node_rank_from, parse_conf,
                                            parse_endpoint, parse_filters, parse_nnodes, parse_rank_list, parse_signal,
                                            parse_signal_list, parse_std_map, refuse_unsupported, split_args)
from hyperpodrun.launch.bounds import (  # noqa: F401 (re-exported)
    MAX_NPROC_PER_NODE, MAX_NNODES, MAX_COUNT, MAX_TIMEOUT_S, MIN_INTERVAL_S, MAX_INTERVAL_S,
    DEFAULT_JOIN_TIMEOUT_S, DEFAULT_LAST_CALL_S, DEFAULT_COORDINATOR_TIMEOUT_S, DEFAULT_NODE_TIMEOUT_S,
    MIN_NODE_TIMEOUT_S, DEFAULT_REPLACE_TIMEOUT_S, DEFAULT_METRICS_HOST)
from hyperpodrun.launch import rdzv_conf
from hyperpodrun.launch.host_checks import (count_workers, default_log_dir, own_address, private_log_base, standby_auto,
                                     temp_log_base)

#: how each LaunchConfig field is spelt on the command line, where it is not --<field-with-dashes>
FLAG_OF_FIELD = {"join_timeout": "--rdzv-conf join_timeout", "coordinator_timeout": "--rdzv-conf coordinator_timeout",
                 "rdzv_port": "--master-port/--rdzv-endpoint port",
                 "entrypoint": "TRAINING_SCRIPT", "rdzv_host": "--rdzv-endpoint host"}

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
    "node_timeout": f"a number of seconds from {MIN_NODE_TIMEOUT_S:g} to {MAX_TIMEOUT_S:.0f} (one week)",
    "replace_timeout": _WEEK,
    "standby_workers": "auto, or a whole number of standbys per local rank from 0 to 8 (0 turns them off)",
    "metrics_port": "a port from 1 to 65535",
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


def _flag_mode(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("flags"))


def _join_timeout(conf: dict[str, str]) -> float:
    return rdzv_conf.join_timeout(conf, DEFAULT_JOIN_TIMEOUT_S, MAX_TIMEOUT_S, ACCEPTS["join_timeout"])


def _conf_seconds(conf: dict[str, str], key: str, default: float, *, zero_ok: bool) -> float:
    return rdzv_conf.seconds(conf, key, default, zero_ok=zero_ok, most=MAX_TIMEOUT_S)


def _derive_topology(flags: dict[str, Any], sources: Optional[dict[str, str]] = None) -> None:
    """torchrun's --nnodes, --standalone, --rdzv-backend/-endpoint/-conf, --master-addr/-port, --node-rank ->
    the fields nnodes, rdzv_backend, rdzv_host, rdzv_port, join_timeout, node_rank, master_addr and
    single_node (in place). `sources`: the environment variable each flag's value came from."""
    nnodes_text = flags.pop("nnodes", "1:1")
    lo, hi = parse_nnodes(nnodes_text)
    nnodes = hi
    backend = (flags.pop("rdzv_backend", None) or "static").strip()
    endpoint = (flags.pop("rdzv_endpoint", None) or "").strip()
    conf = parse_conf(flags.pop("rdzv_conf", None) or "")
    master_port = flags.pop("master_port", None)
    given_addr = flags.pop("master_addr", None)
    if flags.pop("standalone", False):
        if nnodes != 1:
            raise ConfigError("--standalone runs one node; drop --nnodes or --standalone")
        backend, endpoint = "c10d", "localhost:0"
    if backend not in ("static", "c10d", "etcd"):
        raise ConfigError(f"--rdzv-backend {backend!r} is not supported; use static, c10d or etcd")
    rdzv_conf.refuse_etcd_keys(backend, conf)
    etcd = rdzv_conf.etcd_conf(endpoint, conf) if backend == "etcd" and nnodes > 1 else None

    if lo != hi and backend == "etcd":
        raise ConfigError(f"--nnodes {nnodes_text}: the etcd backend runs a fixed number of nodes (no elastic range) "
                          f"yet; give --nnodes {hi}, or use --rdzv-backend c10d")
    if lo != hi and backend != "c10d":
        raise ConfigError(f"--nnodes {nnodes_text}: an elastic range needs the c10d rendezvous (node ranks are "
                          "handed out as agents join); add --rdzv-backend c10d --rdzv-endpoint HOST:PORT, or "
                          f"give a fixed size such as --nnodes {hi}")
    rdzv_host, rdzv_port = "localhost", 0
    single = nnodes == 1
    master_addr = given_addr or ("127.0.0.1" if not single else "localhost")
    if etcd is not None:   # the agents meet in etcd: node ranks in join order, as with c10d
        rdzv_host, rdzv_port = etcd.endpoints[0]
        node_rank = None
    elif backend == "etcd":   # one node: nothing to meet, etcd is not used
        node_rank = None
    elif backend == "c10d":
        if not endpoint:
            raise ConfigError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the host of one of the nodes)")
        rdzv_host, rdzv_port = parse_endpoint(endpoint)
        if not single and rdzv_port == 0:
            raise ConfigError("--rdzv-endpoint needs a port for several nodes (e.g. HOST:29400)")
        node_rank = None
    else:
        node_rank = node_rank_from(flags.get("node_rank"), (sources or {}).get("node_rank"), nnodes)
        rdzv_port = master_port if master_port is not None else 29500
        if not single and endpoint:
            rdzv_host, rdzv_port = parse_endpoint(endpoint, default_port=rdzv_port)
            master_addr = rdzv_host
        if not single and rdzv_port == 0:
            flag = "--rdzv-endpoint" if endpoint else "--master-port"
            raise ConfigError(f"{flag}: port 0 cannot be found by the other nodes; give every node the same fixed "
                              "port (e.g. --master-port 29500)")
    if single and node_rank not in (None, 0):
        raise ConfigError(f"--node-rank {node_rank} with one node; it must be 0 (or give --nnodes)")
    if single:
        # torchrun 2.13's MASTER_ADDR for one node: a static rendezvous only with --master-port or an endpoint
        # (then the master address, default 127.0.0.1); otherwise its c10d one (the node's own address)
        if backend == "static" and (master_port is not None or endpoint):
            master_addr = parse_endpoint(endpoint)[0] if endpoint else (given_addr or "127.0.0.1")
        else:
            master_addr = own_address(flags.get("local_addr"))
    flags.update(nnodes=nnodes, rdzv_backend=backend, rdzv_host=rdzv_host, rdzv_port=rdzv_port,
                 join_timeout=_join_timeout(conf), node_rank=node_rank, master_addr=master_addr, single_node=single,
                 min_nodes=lo, etcd=etcd, last_call_timeout=_conf_seconds(conf, "last_call_timeout", DEFAULT_LAST_CALL_S, zero_ok=True),
                 coordinator_timeout=_conf_seconds(conf, "coordinator_timeout", DEFAULT_COORDINATOR_TIMEOUT_S,
                                                   zero_ok=False))


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
    nnodes: int = Field(1, ge=1, le=MAX_NNODES)          # the most nodes (MAX of --nnodes MIN:MAX)
    min_nodes: Optional[int] = Field(None, ge=1, le=MAX_NNODES)   # MIN of --nnodes MIN:MAX (None: = nnodes)
    last_call_timeout: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    nproc_per_node: int = Field(1, ge=1, le=MAX_NPROC_PER_NODE)
    node_rank: Optional[int] = Field(0, ge=0, lt=MAX_NNODES)
    rdzv_backend: Literal["static", "c10d", "etcd"] = "static"
    etcd: Optional[rdzv_conf.EtcdConf] = None   # --rdzv-backend etcd: its members and TLS (launch/rdzv_conf.py)
    rdzv_host: str = "localhost"
    rdzv_port: int = Field(0, ge=0, le=65535)
    rdzv_id: str = "none"
    join_timeout: float = Field(DEFAULT_JOIN_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    coordinator_timeout: float = Field(DEFAULT_COORDINATOR_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    master_addr: str = "localhost"
    local_addr: Optional[str] = None
    single_node: bool = True
    role: str = "default"
    virtual_local_rank: bool = False     # torchrun's: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES=<its GPU> per worker
    numa_binding: Optional[Literal["node", "socket", "exclusive", "core-complex"]] = None
    numa_cpus: dict[int, list[int]] = Field(default_factory=dict)   # --numa-binding's CPUs per local rank

    # supervision
    max_restarts: int = Field(0, ge=0, le=MAX_COUNT)
    monitor_interval: float = Field(0.1, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    shutdown_signal: int = int(signal.SIGTERM)
    shutdown_timeout: float = Field(30.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    signals_to_handle: list[int] = Field(
        default_factory=lambda: [int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)])

    # in-process restart (docs/ARCHITECTURE.md, "Restart protocol")
    inprocess_restart: bool = False
    inprocess_timeout: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    heartbeat_interval: float = Field(1.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    heartbeat_timeout: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    progress_timeout: Optional[float] = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    max_step_failures: int = Field(3, ge=1, le=MAX_COUNT)
    # processes started ahead per local rank slot that become a rank which died (agent/workers/standby.py). "auto" (the
    # command line's default; a config built in code has 0) is resolved by _standby_auto, which also sets
    # standby_auto: why auto gave this count (None: a number was given)
    standby_workers: int = Field(0, ge=0, le=8)
    standby_auto: Optional[str] = None
    standby_prerun: Literal["auto", "off"] = "auto"   # standbys run the script ahead (agent/workers/prerun.py)
    # node membership (agent/coordination/membership.py): a node whose agent is silent this long is lost; a lost node's
    # replacement (the same command started again) is awaited this long
    node_timeout: float = Field(DEFAULT_NODE_TIMEOUT_S, ge=MIN_NODE_TIMEOUT_S, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    replace_timeout: float = Field(DEFAULT_REPLACE_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)

    # GPU health (agent/health/gpu_health.py): NVML monitor where it loads (auto), required (nvml), or off (none)
    health_check: Literal["auto", "nvml", "none"] = "auto"
    health_interval: float = Field(5.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)

    # logs
    log_dir: str = Field(default_factory=default_log_dir)
    redirects: dict[int, int] = Field(default_factory=dict)
    tee: dict[int, int] = Field(default_factory=dict)
    local_ranks_filter: Optional[list[int]] = None
    log_line_prefix_template: Optional[str] = None    # None or "": the `[host:rank]: ` prefix
    # teed lines that contain one of these are also copied to <run-dir>/attempt_<g>/filtered_std{out,err}.log
    duplicate_stdout_filters: list[str] = Field(default_factory=list)
    duplicate_stderr_filters: list[str] = Field(default_factory=list)

    # security (hyperpodrun/auth.py): file with the job secret; None -> HYPERPODRUN_JOB_SECRET or one of our own
    job_secret_file: Optional[str] = None

    # --k8s-report: the pod's annotations and Events through the Kubernetes API (agent/observe/k8s_report.py)
    k8s_report: bool = False
    # --metrics-port (None: off), --metrics-host, --api-token-file: metrics, probes, the status API (docs/monitoring.md)
    metrics_port: Optional[int] = Field(None, ge=1, le=65535)
    metrics_host: str = DEFAULT_METRICS_HOST
    api_token_file: Optional[str] = None

    # hooks
    pre_train_script: Optional[str] = None
    pre_train_args: list[str] = Field(default_factory=list)
    post_train_script: Optional[str] = None
    post_train_args: list[str] = Field(default_factory=list)

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_flags(cls, flags: dict[str, Any], sources: Optional[dict[str, str]] = None) -> "LaunchConfig":
        """The config of the command line: `flags` are click's values by option name (text as typed, or
        from PET_*/HYPERPODRUN_* variables) plus `entrypoint` and `args`; `sources` names the environment
        variable each value came from, for the message. Every check runs, the host's included; ConfigError
        with one line on any problem."""
        try:
            return cls.model_validate(flags, context={"flags": True, "host": True, "sources": sources or {}})
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, sources)) from None

    @model_validator(mode="before")
    @classmethod
    def _from_flags(cls, data: Any, info: ValidationInfo) -> Any:
        if not _flag_mode(info) or not isinstance(data, dict):
            return data
        flags = dict(data)
        refuse_unsupported(flags)
        _derive_topology(flags, (info.context or {}).get("sources"))
        flags["rdzv_id"] = flags.get("rdzv_id") or "none"
        for key in ("shutdown_timeout", "log_dir", "job_secret_file", "local_ranks_filter", "metrics_host",
                    "api_token_file"):
            if flags.get(key) in (None, ""):
                flags.pop(key, None)   # not given: the field's default
        return flags

    @model_validator(mode="before")
    @classmethod
    def _standby_auto(cls, data: Any) -> Any:
        """`--standby-workers auto` -> this launch's count and why (host_checks.standby_auto): it is the
        default, so a launch that cannot have standbys gets 0 from it, never an error; a number is checked
        as given (_check_together)."""
        if not isinstance(data, dict) or str(data.get("standby_workers", "")).strip().lower() != "auto":
            return data
        script = not (as_bool(data.get("module")) or as_bool(data.get("no_python")))
        count, why = standby_auto(as_bool(data.get("inprocess_restart")), script)
        return {**data, "standby_workers": count, "standby_auto": why}

    # ------------------------------------------------------------------------------------------ flag syntax
    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                return int(text)
            return count_workers(text)
        return value

    @field_validator("shutdown_signal", mode="before")
    @classmethod
    def _signal(cls, value: Any) -> Any:
        return parse_signal(value) if isinstance(value, str) else value

    @field_validator("signals_to_handle", mode="before")
    @classmethod
    def _signals(cls, value: Any) -> Any:
        return parse_signal_list(value) if isinstance(value, str) else value

    @field_validator("redirects", "tee", mode="before")
    @classmethod
    def _std_map(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return {}
        if not isinstance(value, str):
            return value
        if value.strip() == "0":
            return {}
        nproc = info.data.get("nproc_per_node")
        if nproc is None:   # --nproc-per-node is invalid: that is the error to report
            return {}
        return parse_std_map(value, flag_of(info.field_name or ""), nproc)

    @field_validator("local_ranks_filter", mode="before")
    @classmethod
    def _rank_list(cls, value: Any, info: ValidationInfo) -> Any:
        return parse_rank_list(value, info.data.get("nproc_per_node")) if isinstance(value, str) else value

    @field_validator("duplicate_stdout_filters", "duplicate_stderr_filters", mode="before")
    @classmethod
    def _filters(cls, value: Any) -> Any:
        return [] if value is None else parse_filters(value) if isinstance(value, str) else value

    @field_validator("pre_train_args", "post_train_args", mode="before")
    @classmethod
    def _args(cls, value: Any, info: ValidationInfo) -> Any:
        return split_args(flag_of(info.field_name or ""), value) if isinstance(value, str) or value is None else value

    # ------------------------------------------------------------------------------------------ whole config
    @model_validator(mode="after")
    def _check_together(self) -> "LaunchConfig":
        if self.module and self.no_python:
            raise ConfigError("--no-python and -m/--module cannot be used together: pick one")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}; use 0..{self.nnodes - 1}")
        if self.standby_workers and not self.inprocess_restart:
            raise ConfigError(f"--standby-workers {self.standby_workers} needs --inprocess-restart (a standby "
                              "becomes a rank that died during an in-process restart); add it or drop the flag")
        if self.standby_workers and (self.module or self.no_python):
            raise ConfigError(f"--standby-workers {self.standby_workers} needs a script entry point (python "
                              "script.py): a standby runs the script; drop -m/--no-python or the flag")
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

    @model_validator(mode="after")
    def _check_host(self, info: ValidationInfo) -> "LaunchConfig":
        if not (info.context and info.context.get("host")):
            return self
        from hyperpodrun import auth
        from hyperpodrun.launch import host_checks
        host_checks.check_entrypoint(self.entrypoint, self.module, self.no_python, self.run_path)
        host_checks.check_hook_script(self.pre_train_script, "--pre-train-script")
        host_checks.check_hook_script(self.post_train_script, "--post-train-script")
        given = self.log_dir if "log_dir" in self.model_fields_set else None
        self.log_dir = host_checks.check_log_dir(given or default_log_dir(create=True))   # default: ours alone
        auth.checked_secret_file(self.job_secret_file)   # a bad secret: exit 2 here, not a failed job
        host_checks.check_status_api(self.metrics_port, self.metrics_host, self.api_token_file)
        if self.health_check == "nvml":
            host_checks.check_nvml()
        if self.virtual_local_rank:   # each local rank needs its own CUDA_VISIBLE_DEVICES entry
            virtual_device(self.nproc_per_node - 1, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self.numa_binding is not None and not self.numa_cpus:
            self.numa_cpus = host_checks.numa_cpus(self.numa_binding, self.nproc_per_node)
        return self

    @property
    def min_nnodes(self) -> int:
        """The fewest nodes the job runs on (MIN of --nnodes MIN:MAX; the fixed size otherwise)."""
        return min(self.min_nodes or self.nnodes, self.nnodes)

    @property
    def elastic(self) -> bool:
        """--nnodes MIN:MAX with MIN < MAX: the job forms, shrinks and grows between the two."""
        return self.min_nnodes < self.nnodes

    def console_ranks(self) -> set[int]:
        """Local ranks whose output is shown on the console."""
        if self.local_ranks_filter is None:
            return set(range(self.nproc_per_node))
        return set(self.local_ranks_filter)


__all__ = ["LaunchConfig", "describe_validation_error", "flag_of", "ACCEPTS", "FLAG_OF_FIELD", "MAX_NPROC_PER_NODE",
           "MAX_NNODES", "MAX_COUNT", "MAX_TIMEOUT_S", "MIN_INTERVAL_S", "MAX_INTERVAL_S", "STD_NONE", "STD_OUT",
           "STD_ERR", "STD_ALL", "parse_nnodes", "parse_std_map", "parse_signal", "parse_endpoint", "default_log_dir",
           "private_log_base", "temp_log_base"]
