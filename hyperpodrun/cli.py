"""The `hyperpodrun` command: torchrun's flags (both spellings, PET_* defaults) plus ours.

`hyperpodrun [FLAGS] script.py [ARGS]` launches a job; `hyperpodrun logs ...` and `hyperpodrun inject ...`
are tools around a running or finished job. Bad input exits 2 with one clear line, never a traceback.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import socket
import sys
from typing import Any, Optional

import click
from pydantic import ValidationError

from hyperpodrun import __version__
from hyperpodrun.config import (LaunchConfig, default_log_dir, parse_endpoint, parse_nnodes, parse_signal,
                                parse_std_map)
from hyperpodrun.errors import EXIT_USAGE, ConfigError

SUBCOMMANDS = ("logs", "inject")

UNSUPPORTED = {
    "numa_binding": "--numa-binding",
    "virtual_local_rank": "--virtual-local-rank",
    "logs_specs": "--logs-specs",
    "duplicate_stdout_filters": "--duplicate-stdout-filters",
    "duplicate_stderr_filters": "--duplicate-stderr-filters",
}


def _names(flag: str, *short: str) -> list[str]:
    """`--nproc-per-node` -> ['--nproc-per-node', '--nproc_per_node'] (+ short forms)."""
    names = [*short, flag]
    if "-" in flag[2:]:
        names.append("--" + flag[2:].replace("-", "_"))
    return names


def _pet(flag: str) -> str:
    return "PET_" + flag[2:].replace("-", "_").upper()


def topt(flag: str, *short: str, **kw: Any):
    """A torchrun option: both spellings, PET_* environment default."""
    return click.option(*_names(flag, *short), envvar=_pet(flag), show_envvar=False, **kw)


def oopt(flag: str, *short: str, **kw: Any):
    """One of our options: both spellings, PET_* and HYPERPODRUN_* environment defaults."""
    env = [_pet(flag), "HYPERPODRUN_" + flag[2:].replace("-", "_").upper()]
    return click.option(*_names(flag, *short), envvar=env, show_envvar=False, **kw)


def _fail(message: str) -> "click.UsageError":
    return click.UsageError(message)


def _resolve_nproc(value: str) -> int:
    text = str(value).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ConfigError("--nproc-per-node must be at least 1")
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


def _check_log_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".hyperpodrun-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"--log-dir {path!r} is not writable ({exc.strerror or exc}); "
                          "pick a directory you can write to")
    return path


def _split_args(flag: str, text: Optional[str]) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc} (give the arguments as one shell-quoted string)")


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"--{loc.replace('_', '-')}: {err.get('msg')}")
    return "; ".join(parts)


def build_config(opts: dict[str, Any], script: str, script_args: tuple[str, ...]) -> LaunchConfig:
    """Flags -> validated LaunchConfig. Raises ConfigError with the flag name and the fix."""
    for key, flag in UNSUPPORTED.items():
        if opts.get(key):
            raise ConfigError(f"{flag} is not supported by hyperpodrun yet; drop it (see README, "
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
            raise ConfigError(f"training script {entry!r} does not exist; check the path "
                              "(or use -m for a module, --no-python for a program)")
    elif opts["no_python"] and not opts["run_path"]:
        if not (os.path.isfile(entry) or shutil.which(entry)):
            raise ConfigError(f"--no-python: program {entry!r} is neither a file nor on PATH")

    join_key = "join_timeout" if "join_timeout" in conf else "timeout"
    try:
        join_timeout = float(conf.get(join_key, 600))
    except ValueError:
        join_timeout = float("nan")
    if not 0 < join_timeout < float("inf"):
        raise ConfigError(f"--rdzv-conf {join_key}={conf[join_key]} is not a positive number of seconds "
                          "(e.g. --rdzv-conf join_timeout=900)")
    sigs = [parse_signal(s, "--signals-to-handle") for s in
            filter(None, (x.strip() for x in (opts["signals_to_handle"] or "").split(",")))]
    shutdown_timeout = opts["shutdown_timeout"]
    if shutdown_timeout is None:
        env_val = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        try:
            shutdown_timeout = float(env_val) if env_val else 30.0
        except ValueError:
            raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env_val!r} is not a number of seconds")
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
            log_dir=_check_log_dir(opts["log_dir"] or default_log_dir()),
            redirects=parse_std_map(opts["redirects"], "--redirects", nproc) if opts["redirects"] not in (None, "0")
            else {},
            tee=parse_std_map(opts["tee"], "--tee", nproc) if opts["tee"] not in (None, "0") else {},
            local_ranks_filter=local_filter,
            job_secret_file=opts["job_secret_file"],
            pre_train_script=opts["pre_train_script"],
            pre_train_args=_split_args("--pre-train-args", opts["pre_train_args"]),
            post_train_script=opts["post_train_script"],
            post_train_args=_split_args("--post-train-args", opts["post_train_args"]),
        )
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc))


POS = click.FloatRange(min=0, min_open=True)


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                                 "max_content_width": 110})
@topt("--nnodes", default="1:1", help="Number of nodes, N or N:N (elastic MIN<MAX is not supported yet).")
@topt("--nproc-per-node", default="1", help="Workers per node: a number, auto, gpu or cpu.")
@topt("--rdzv-backend", default="static", help="static or c10d.")
@topt("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (one of the nodes).")
@topt("--rdzv-id", default="none", help="Job id; the same on every node.")
@topt("--rdzv-conf", default="", help="KEY=VALUE,... (join_timeout=SECONDS).")
@topt("--standalone", is_flag=True, help="Single-node job with a local rendezvous.")
@topt("--max-restarts", default=0, type=click.IntRange(min=0), help="Job-wide process-level restart budget.")
@topt("--monitor-interval", default=0.1, type=POS, help="Seconds between supervision checks.")
@topt("--start-method", default="spawn", help="Accepted for compatibility; scripts are always exec'd.")
@topt("--event-log-handler", default="null", help="Accepted for compatibility (null).")
@topt("--role", default="default", help="Worker role name (ROLE_NAME).")
@topt("--module", "-m", is_flag=True, help="Run the entrypoint as a Python module (python -m).")
@topt("--no-python", is_flag=True, help="Run the entrypoint as a program, not with python.")
@topt("--run-path", is_flag=True, help="Run the script by path (same as the default here).")
@topt("--log-dir", default=None, help="Base directory of the run logs (default: a per-user temp dir).")
@topt("--redirects", "-r", default="0", help="Redirect std streams to files only: 3, or 0:3,1:0 per rank.")
@topt("--tee", "-t", default="0", help="Tee std streams to files and console: 3, or 0:3,1:0 per rank.")
@topt("--local-ranks-filter", default="", help="Show only these local ranks on the console (e.g. 0,1).")
@topt("--duplicate-stdout-filters", default="", hidden=True)
@topt("--duplicate-stderr-filters", default="", hidden=True)
@topt("--node-rank", default=0, type=click.IntRange(min=0), help="This node's rank (static rendezvous).")
@topt("--master-addr", default=None, help="Address of node 0 (static rendezvous).")
@topt("--master-port", default=None, type=click.IntRange(0, 65535), help="Port on node 0 (default 29500).")
@topt("--local-addr", default=None, help="This node's address.")
@topt("--logs-specs", default=None, hidden=True)
@topt("--numa-binding", default=None, hidden=True)
@topt("--virtual-local-rank", is_flag=True, hidden=True)
@topt("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", help="Signals forwarded to workers.")
@oopt("--shutdown-timeout", default=None, type=click.FloatRange(min=0),
      help="Seconds between the shutdown signal and SIGKILL (default 30, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT).")
@oopt("--shutdown-signal", default="SIGTERM", help="Signal a restart or stop sends first (name or number).")
@oopt("--inprocess-restart", is_flag=True, help="Restart healthy workers in-process on a fault.")
@oopt("--inprocess-timeout", default=60.0, type=POS, help="Escalate to a process restart after this many s.")
@oopt("--heartbeat-interval", default=1.0, type=POS, help="Seconds between worker heartbeats.")
@oopt("--heartbeat-timeout", default=10.0, type=POS, help="A worker silent this long is hung.")
@oopt("--progress-timeout", default=None, type=POS, help="A rank without progress this long is stuck (off).")
@oopt("--max-step-failures", default=3, type=click.IntRange(min=1), help="Stop when one step fails this often.")
@oopt("--health-check", default="auto", type=click.Choice(["auto", "nvml", "none"]),
      help="GPU health monitor: auto (NVML where it loads), nvml (required), none.")
@oopt("--health-interval", default=5.0, type=POS, help="Seconds between NVML polls (ECC, row remap, throttling).")
@oopt("--job-secret-file", default=None,
      help="File with the job secret, the same on every node (or HYPERPODRUN_JOB_SECRET); authenticates "
           "peer copies and the agents' store records. See README, Security.")
@oopt("--pre-train-script", default=None, help="Run before the workers start (once per node).")
@oopt("--pre-train-args", default="", help="Arguments of the pre-train script (one shell-quoted string).")
@oopt("--post-train-script", default=None, help="Run after the workers end (once per node).")
@oopt("--post-train-args", default="", help="Arguments of the post-train script.")
@click.version_option(__version__, "--version", prog_name="hyperpodrun")
@click.argument("training_script", metavar="TRAINING_SCRIPT")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def launch(training_script: str, training_script_args: tuple[str, ...], **opts: Any) -> None:
    """Launch TRAINING_SCRIPT on this node's workers (torchrun-compatible).

    Also: `hyperpodrun logs [LOG_DIR]` and `hyperpodrun inject ...`.
    """
    try:
        cfg = build_config(opts, training_script, training_script_args)
    except ConfigError as exc:
        raise _fail(str(exc))
    if cfg.health_check == "nvml":
        from hyperpodrun.agent.nvml_backend import NVML_FIX, probe_nvml
        problem = probe_nvml()
        if problem:
            raise _fail(f"--health-check nvml: {problem}. Fix: {NVML_FIX}")
    _setup_logging()
    from hyperpodrun.agent.agent import Agent  # the agent (and torch) load only once the flags are valid
    _exit_now(Agent(cfg).run())


def _exit_now(code: int) -> None:
    """The agent has ended its workers and cleaned up: exit without the interpreter's teardown of torch, which
    costs ~0.5 s of CPU (seconds on a busy node) between the last worker's end and our exit."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[hyperpodrun %(asctime)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hyperpodrun")
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("HYPERPODRUN_LOG_LEVEL", "INFO").upper())
    root.propagate = False


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: dispatch subcommands, else launch."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        from hyperpodrun.tools import tools
        tools.main(args=args, prog_name="hyperpodrun", standalone_mode=True)
        return
    try:
        launch.main(args=args, prog_name="hyperpodrun", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.Abort:
        sys.exit(130)
