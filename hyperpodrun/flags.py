"""Command-line flags -> a validated LaunchConfig (the checks that need more than one flag, the file system
or the machine: script paths, the log directory, GPU/CPU counts). Every problem is a ConfigError naming the
flag and the fix; the CLI prints it as one line and exits 2.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import socket
from typing import Any, Optional

from pydantic import ValidationError

from hyperpodrun import auth
from hyperpodrun.config import (ACCEPTS, MAX_NPROC_PER_NODE, MAX_TIMEOUT_S, LaunchConfig, default_log_dir,
                                describe_validation_error, parse_endpoint, parse_nnodes, parse_signal, parse_std_map)
from hyperpodrun.errors import ConfigError

#: torchrun flags that are refused (exit 2), and why; `hyperpodrun --help` lists them
UNSUPPORTED = {
    "numa_binding": ("--numa-binding", "NUMA binding of the workers is not implemented"),
    "virtual_local_rank": ("--virtual-local-rank", "LOCAL_RANK is always the real local rank"),
    "logs_specs": ("--logs-specs", "hyperpodrun has its own log layout (README, Logs)"),
    "duplicate_stdout_filters": ("--duplicate-stdout-filters", "not implemented"),
    "duplicate_stderr_filters": ("--duplicate-stderr-filters", "not implemented"),
}


def _resolve_nproc(value: str) -> int:
    """A number (bounded here: other flags are checked against it before LaunchConfig is built), or the
    number of GPUs or CPUs."""
    text = str(value).strip()
    if text.isdigit():
        n = int(text)
        if not 1 <= n <= MAX_NPROC_PER_NODE:
            raise ConfigError(f"--nproc-per-node {value!r}: must be {ACCEPTS['nproc_per_node']}")
        return n
    if text == "cpu":
        return len(os.sched_getaffinity(0))
    if text in ("gpu", "auto", "cuda"):
        import torch
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "auto":
            return len(os.sched_getaffinity(0))
        raise ConfigError("--nproc-per-node gpu: no CUDA GPU is visible on this node; give a number instead")
    raise ConfigError(f"--nproc-per-node {value!r} is not a number or one of auto, gpu, cpu")


def _own_address(local_addr: Optional[str]) -> str:
    """--local-addr, else this host's FQDN as torchrun's c10d rendezvous gives it ('localhost' if it does not
    resolve: the workers must reach the agent's store)."""
    if local_addr:
        return local_addr
    fqdn = socket.getfqdn()
    try:
        socket.getaddrinfo(fqdn, None)
    except OSError:
        return "localhost"
    return fqdn


def _parse_conf(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"--rdzv-conf item {item!r} is not KEY=VALUE (e.g. --rdzv-conf join_timeout=900)")
        key, val = item.split("=", 1)
        out[key.strip()] = val.strip()
    return out


#: bytes the start-up probe writes into --log-dir: a full filesystem refuses data, not always an empty file
_LOG_PROBE_BYTES = 64 * 1024


def _check_log_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    probe = os.path.join(path, f".hyperpodrun-write-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * _LOG_PROBE_BYTES)   # ENOSPC here (local filesystems) or at close (NFS)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(f"--log-dir {path!r}: its filesystem is full ({exc.strerror}); free some space "
                              "or pick another directory")
        raise ConfigError(f"--log-dir {path!r} is not writable ({exc.strerror or exc}); "
                          "pick a directory you can write to")
    return path


def _split_args(flag: str, text: Optional[str]) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc} (give the arguments as one shell-quoted string)")


def _check_entry(entry: str, flag: str, what: str) -> None:
    """A script or program path that is not a file: say whether it is missing or a directory."""
    if os.path.isdir(entry):
        raise ConfigError(f"{flag} {entry!r} is a directory, not a {what}; give the {what} inside it")


def build_config(opts: dict[str, Any], script: str, script_args: tuple[str, ...],
                 sources: Optional[dict[str, str]] = None) -> LaunchConfig:
    """Flags -> validated LaunchConfig. Raises ConfigError with the flag name and the fix; `sources` names
    the environment variable a flag's value came from (for the message)."""
    for key, (flag, why) in UNSUPPORTED.items():
        if opts.get(key):
            raise ConfigError(f"{flag} is not supported by hyperpodrun ({why}); drop it (see README, "
                              "'Differences from torchrun')")
    if opts["event_log_handler"] not in (None, "null", "console"):
        raise ConfigError(f"--event-log-handler {opts['event_log_handler']!r} is not supported; hyperpodrun writes "
                          "its own event log (hyperpodrun logs --events)")
    if opts["start_method"] not in ("spawn", "fork", "forkserver"):
        raise ConfigError("--start-method must be spawn, fork or forkserver")
    if opts["module"] and opts["no_python"]:
        raise ConfigError("--no-python and -m/--module cannot be used together: pick one")

    lo, hi = parse_nnodes(opts["nnodes"])
    if lo != hi:
        raise ConfigError(f"--nnodes {opts['nnodes']}: elastic ranges (MIN < MAX) are not supported yet; "
                          f"use a fixed size such as --nnodes {hi}")
    nnodes = hi
    nproc = _resolve_nproc(opts["nproc_per_node"])
    backend = (opts["rdzv_backend"] or "static").strip()
    endpoint = (opts["rdzv_endpoint"] or "").strip()
    rdzv_id = opts["rdzv_id"] or "none"
    conf = _parse_conf(opts["rdzv_conf"] or "")
    if opts["standalone"]:
        if nnodes != 1:
            raise ConfigError("--standalone runs one node; drop --nnodes or --standalone")
        backend, endpoint = "c10d", "localhost:0"
    if backend not in ("static", "c10d"):
        raise ConfigError(f"--rdzv-backend {backend!r} is not supported yet; use static or c10d")

    rdzv_host, rdzv_port = "localhost", 0
    single = nnodes == 1
    master_addr = opts["master_addr"] or ("127.0.0.1" if not single else "localhost")
    if backend == "c10d":
        if not endpoint:
            raise ConfigError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the host of one of the nodes)")
        rdzv_host, rdzv_port = parse_endpoint(endpoint)
        if not single and rdzv_port == 0:
            raise ConfigError("--rdzv-endpoint needs a port for several nodes (e.g. HOST:29400)")
        node_rank = None
    else:
        node_rank = opts["node_rank"]
        rdzv_port = opts["master_port"] if opts["master_port"] is not None else 29500
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
        if backend == "static" and (opts["master_port"] is not None or endpoint):
            master_addr = parse_endpoint(endpoint)[0] if endpoint else (opts["master_addr"] or "127.0.0.1")
        else:
            master_addr = _own_address(opts["local_addr"])

    entry = script
    if not opts["module"] and not opts["no_python"]:
        if not os.path.isfile(entry):
            _check_entry(entry, "training script", "script")
            raise ConfigError(f"training script {entry!r} does not exist; check the path "
                              "(or use -m for a module, --no-python for a program)")
    elif opts["no_python"] and not opts["run_path"]:
        if not (os.path.isfile(entry) or shutil.which(entry)):
            _check_entry(entry, "--no-python: program", "program")
            raise ConfigError(f"--no-python: program {entry!r} is neither a file nor on PATH")

    join_key = "join_timeout" if "join_timeout" in conf else "timeout"
    try:
        join_timeout = float(conf.get(join_key, 600))
    except ValueError:
        join_timeout = float("nan")
    if not 0 < join_timeout <= MAX_TIMEOUT_S:   # nan and inf fail here too
        raise ConfigError(f"--rdzv-conf {join_key}={conf[join_key]}: must be {ACCEPTS['join_timeout']} "
                          "(e.g. --rdzv-conf join_timeout=900)")
    sigs = [parse_signal(s, "--signals-to-handle") for s in
            filter(None, (x.strip() for x in (opts["signals_to_handle"] or "").split(",")))]
    shutdown_timeout = opts["shutdown_timeout"]
    sources = dict(sources or {})
    if shutdown_timeout is None:
        shutdown_timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or "30"
        if shutdown_timeout != "30":
            sources["shutdown_timeout"] = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    local_filter = None
    if opts["local_ranks_filter"]:
        try:
            local_filter = sorted({int(x) for x in opts["local_ranks_filter"].split(",") if x.strip()})
        except ValueError:
            raise ConfigError("--local-ranks-filter must be a comma-separated list of local ranks, e.g. 0,1,2")
        if not local_filter or any(r < 0 or r >= nproc for r in local_filter):
            raise ConfigError(f"--local-ranks-filter {opts['local_ranks_filter']!r}: local ranks are 0..{nproc - 1}")
    for script_flag in ("pre_train_script", "post_train_script"):
        path = opts[script_flag]
        if path and not os.path.isfile(path):
            _check_entry(path, f"--{script_flag.replace('_', '-')}", "script")
            raise ConfigError(f"--{script_flag.replace('_', '-')} {path!r} does not exist")

    try:
        return LaunchConfig(
            entrypoint=entry, args=list(script_args), module=opts["module"], no_python=opts["no_python"],
            run_path=opts["run_path"], nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank,
            rdzv_backend=backend, rdzv_host=rdzv_host, rdzv_port=rdzv_port, rdzv_id=rdzv_id, rdzv_conf=conf,
            join_timeout=join_timeout, master_addr=master_addr, local_addr=opts["local_addr"], single_node=single,
            role=opts["role"], max_restarts=opts["max_restarts"], monitor_interval=opts["monitor_interval"],
            shutdown_signal=parse_signal(opts["shutdown_signal"]), shutdown_timeout=shutdown_timeout,
            signals_to_handle=sigs, inprocess_restart=opts["inprocess_restart"],
            inprocess_timeout=opts["inprocess_timeout"], heartbeat_interval=opts["heartbeat_interval"],
            heartbeat_timeout=opts["heartbeat_timeout"], progress_timeout=opts["progress_timeout"],
            max_step_failures=opts["max_step_failures"],
            health_check=opts["health_check"], health_interval=opts["health_interval"],
            log_dir=_check_log_dir(opts["log_dir"] or default_log_dir(create=True)),   # default: ours alone
            redirects=parse_std_map(opts["redirects"], "--redirects", nproc) if opts["redirects"] not in (None, "0")
            else {},
            tee=parse_std_map(opts["tee"], "--tee", nproc) if opts["tee"] not in (None, "0") else {},
            local_ranks_filter=local_filter,
            job_secret_file=auth.checked_secret_file(opts["job_secret_file"]),   # a bad secret: exit 2 here
            pre_train_script=opts["pre_train_script"],
            pre_train_args=_split_args("--pre-train-args", opts["pre_train_args"]),
            post_train_script=opts["post_train_script"],
            post_train_args=_split_args("--post-train-args", opts["post_train_args"]),
        )
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, sources))
