"""The `hyperpodrun` command: torchrun's flags (both spellings, PET_* defaults) plus ours.

`hyperpodrun [FLAGS] script.py [ARGS]` launches a job; `hyperpodrun logs ...` and `hyperpodrun inject ...`
are tools around a running or finished job. Bad input exits 2 with one clear line, never a traceback.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import click

from hyperpodrun import __version__
from hyperpodrun.launch import settings
from hyperpodrun.errors import EXIT_USAGE, ConfigError
from hyperpodrun.launch.flags import UNSUPPORTED, build_config
from hyperpodrun.launch.host_checks import NUMA_MODES

SUBCOMMANDS = ("logs", "inject", "coordinator")

EPILOG = "\b\nRefused torchrun flags and values (exit 2, one line):\n" + "\n".join(
    f"  {flag}: {why}" for flag, why in UNSUPPORTED.values()) + """
  --rdzv-backend other than static, c10d, etcd (etcd-v2): not supported
  --logs-specs other than default: no LogsSpecs plugin is loaded (hyperpodrun's own log layout, docs/logs.md)
  --event-log-handler other than null, console: hyperpodrun writes its own event log
Accepted with no effect: --start-method, --event-log-handler null|console.
Arguments after TRAINING_SCRIPT go to it; a first `--` right after it is dropped, as torchrun does.
Subcommands: `hyperpodrun logs [LOG_DIR]`, `hyperpodrun inject ...`, `hyperpodrun coordinator --host H --port P`
(each with --help)."""


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


def oopt(flag: str, *short: str, also_env: tuple[str, ...] = (), **kw: Any):
    """One of our options: both spellings, PET_* and HYPERPODRUN_* environment defaults (then `also_env`)."""
    env = [_pet(flag), "HYPERPODRUN_" + flag[2:].replace("-", "_").upper(), *also_env]
    return click.option(*_names(flag, *short), envvar=env, show_envvar=False, **kw)


class _LaunchCommand(click.Command):
    """click's parsing plus torchrun's rule for `--`: argparse (REMAINDER after the script) drops the first
    `--` of the command line when it comes right before or right after the script; any other `--` reaches
    the script. click already drops one before the script; this drops one right after it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)
        rest = super().parse_args(ctx, list(args))
        script_args = tuple(ctx.params.get("training_script_args") or ())
        at = len(given) - len(script_args) - 1      # where the script stands in `given`
        if script_args[:1] == ("--",) and "--" in given and given.index("--") == at + 1:
            ctx.params["training_script_args"] = script_args[1:]
        return rest


def _env_sources(ctx: click.Context) -> dict[str, str]:
    """Option name -> the environment variable its value was taken from."""
    out: dict[str, str] = {}
    for param in ctx.command.params:
        if param.name and ctx.get_parameter_source(param.name) == click.core.ParameterSource.ENVIRONMENT:
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            found = next((n for n in names if os.environ.get(n)), None)
            if found:
                out[param.name] = found
    return out


OFF = "off"
#: the shells of torchrun's --print-completion, and the variable click's completion reads at run time
COMPLETION_SHELLS = ("bash", "zsh", "tcsh")
COMPLETE_VAR = "_HYPERPODRUN_COMPLETE"


def _print_completion(ctx: click.Context, _param: click.Parameter, shell: Optional[str]) -> None:
    """--print-completion SHELL: click's own completion script for `hyperpodrun`, then exit 0 (as --version)."""
    if shell is None or ctx.resilient_parsing:
        return
    from click.shell_completion import get_completion_class
    cls = get_completion_class(shell)
    if cls is None:
        raise click.UsageError(f"--print-completion {shell}: click's shell completion has no {shell} script; "
                               "use bash or zsh")
    click.echo(cls(ctx.command, {}, "hyperpodrun", COMPLETE_VAR).source())
    ctx.exit(0)


@click.command(cls=_LaunchCommand, epilog=EPILOG,
               context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                                 "max_content_width": 110, "show_default": True})
@topt("--nnodes", default="1:1", help="Number of nodes, N, or MIN:MAX for an elastic job (c10d rendezvous; shrinks and grows with "
                                                "--inprocess-restart).")
@topt("--nproc-per-node", default="1", help="Workers per node: a number, auto, gpu or cpu.")
@topt("--rdzv-backend", default="static", help="static, c10d, or etcd (needs hyperpodrun[etcd]).")
@topt("--rdzv-endpoint", default="", show_default="none", help="HOST:PORT of the c10d rendezvous (one of the nodes, or a "
      "coordinator); etcd: the members, HOST:PORT,HOST:PORT,...")
@topt("--rdzv-id", default="none", help="Job id; the same on every node.")
@topt("--rdzv-conf", default="", show_default="none", help="KEY=VALUE,... (join_timeout=SECONDS; etcd: protocol, cacert, cert, key).")
@topt("--standalone", is_flag=True, show_default=OFF, help="Single-node job with a local rendezvous.")
@topt("--max-restarts", default="0", metavar="N", help="Job-wide process-level restart budget (at most 1000000).")
@topt("--monitor-interval", default="0.1", metavar="SECONDS", help="Seconds between supervision checks.")
@topt("--start-method", default="spawn", help="Accepted for compatibility; scripts are always exec'd.")
@topt("--event-log-handler", default="null", help="Accepted for compatibility (null).")
@topt("--role", default="default", help="Worker role name (ROLE_NAME).")
@topt("--module", "-m", is_flag=True, show_default=OFF, help="Run the entrypoint as a Python module (python -m).")
@topt("--no-python", is_flag=True, show_default=OFF, help="Run the entrypoint as a program, not with python.")
@topt("--run-path", is_flag=True, show_default=OFF, help="Run the script by path (same as the default here).")
@topt("--log-dir", default=None, show_default="$HYPERPODRUN_LOG_DIR, else $TMPDIR/hyperpodrun-logs-<uid>",
      help="Base directory of the run logs.")
@topt("--redirects", "-r", default="0", help="Redirect std streams to files only: 3, or 0:3,1:0 per rank.")
@topt("--tee", "-t", default="0", help="Tee std streams to files and console: 3, or 0:3,1:0 per rank.")
@topt("--local-ranks-filter", default="", show_default="all",
      help="Show only these local ranks on the console (e.g. 0,1).")
@click.option(*_names("--log-line-prefix-template"), envvar=[_pet("--log-line-prefix-template"),
              "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"], show_envvar=False, default=None, metavar="TEMPLATE",
              show_default="[host:rank]",
              help="Prefix of each console line of a worker; macros ${role_name}, ${rank}, ${local_rank}, "
                   "${hostname} (also TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE).")
@topt("--duplicate-stdout-filters", default=None, metavar="TEXT,...", show_default="none",
      help="Copy the console's stdout lines that contain one of these to <run-dir>/attempt_<g>/filtered_stdout.log "
           "(',,' is a comma).")
@topt("--duplicate-stderr-filters", default=None, metavar="TEXT,...", show_default="none",
      help="The same for stderr lines, into filtered_stderr.log.")
@click.option(*_names("--node-rank"), envvar=[_pet("--node-rank"), "JOB_COMPLETION_INDEX"], show_envvar=False,
              default=None, type=int, show_default="0, or $JOB_COMPLETION_INDEX on several nodes",
              help="This node's rank (static rendezvous). Not given (nor PET_NODE_RANK): a Kubernetes Indexed "
                   "Job's JOB_COMPLETION_INDEX on several nodes, else 0.")
@topt("--master-addr", default=None, show_default="127.0.0.1", help="Address of node 0 (static rendezvous).")
@topt("--master-port", default=None, type=click.IntRange(0, 65535), show_default="29500",
      help="Port on node 0 (static rendezvous).")
@topt("--local-addr", default=None, show_default="this host's FQDN", help="This node's address.")
@topt("--logs-specs", default=None, metavar="default", show_default="default",
      help="torchrun's LogsSpecs entry point: only default, hyperpodrun's own log layout (docs/logs.md).")
@topt("--numa-binding", type=click.Choice(NUMA_MODES), default=None, show_default=OFF,
      help="Bind each worker to the CPUs near its GPU (torch.numa.binding's modes); needs GPUs.")
@topt("--virtual-local-rank", is_flag=True, show_default=OFF,
      help="Every worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES naming only its GPU (its entry of yours).")
@topt("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", help="Signals forwarded to workers.")
@oopt("--shutdown-timeout", also_env=("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",), default=None, metavar="SECONDS",
      show_default="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30",
      help="Seconds between the shutdown signal and SIGKILL.")
@oopt("--shutdown-signal", default="SIGTERM", help="Signal a restart or stop sends first (name or number).")
@oopt("--inprocess-restart", is_flag=True, show_default=OFF, help="Restart healthy workers in-process on a fault.")
@oopt("--inprocess-timeout", default="60", metavar="SECONDS", help="Escalate to a process restart after this many s.")
@oopt("--heartbeat-interval", default="1", metavar="SECONDS", help="Seconds between worker heartbeats.")
@oopt("--heartbeat-timeout", default="10", metavar="SECONDS", help="A worker silent this long is hung.")
@oopt("--progress-timeout", default=None, metavar="SECONDS", show_default=OFF,
      help="A rank without progress this long is stuck.")
@oopt("--max-step-failures", default="3", metavar="N", help="Stop when one step fails this often.")
@oopt("--standby-workers", default="auto", metavar="auto|N",
      show_default="auto: 1 with --inprocess-restart on a CUDA host, else 0",
      help="Processes started ahead per local rank (torch imported, CUDA context made) that replace a rank "
           "that dies (--inprocess-restart). 0 turns them off.")
@oopt("--standby-prerun", default="auto", type=click.Choice(["auto", "off"], case_sensitive=False),
      help="auto: each standby runs the script ahead up to its first HPWrapper call and waits there (a script "
           "that reads its rank before that call is not run ahead); off: standbys wait before the script.")
@oopt("--node-timeout", default="5", metavar="SECONDS",
      help="A node whose agent is silent this long is lost (several nodes, --inprocess-restart).")
@oopt("--replace-timeout", default="120", metavar="SECONDS",
      help="How long the other nodes wait for a lost node's replacement (the same command started again).")
@oopt("--health-check", default="auto", type=click.Choice(["auto", "nvml", "none"]),
      help="GPU health monitor: auto (NVML where it loads), nvml (required), none.")
@oopt("--health-interval", default="5", metavar="SECONDS",
      help="Seconds between NVML polls (ECC, row remap, throttling).")
@oopt("--job-secret-file", default=None, show_default="$HYPERPODRUN_JOB_SECRET, else one of our own per job",
      help="File with the job secret, the same on every node (or HYPERPODRUN_JOB_SECRET); authenticates "
           "peer copies and the agents' store records. See docs/security.md.")
@oopt("--k8s-report", is_flag=True, show_default=OFF,
      help="Report to the Kubernetes API from inside a pod: annotations on this pod (generation, phase, last "
           "recovery) and Events for faults, restarts, node losses and GPU actions. Needs hyperpodrun[k8s] and "
           "RBAC on pods (get, patch) and events (create); see docs/kubernetes.md.")
@oopt("--metrics-port", default=None, metavar="PORT", show_default=OFF,
      help="Serve Prometheus metrics (/metrics), probes (/healthz, /readyz) and the status API (/status, POST "
           "/stop) on this port. Needs hyperpodrun[metrics]; see docs/monitoring.md.")
@oopt("--metrics-host", default=None, metavar="ADDRESS", show_default="127.0.0.1",
      help="Address the metrics and status server listens on (0.0.0.0: every interface, e.g. in a pod).")
@oopt("--api-token-file", default=None, metavar="PATH", show_default="none: mutating calls are refused",
      help="File with the bearer token that POST /stop must present (at least 16 bytes).")
@oopt("--pre-train-script", default=None, show_default="none", help="Run before the workers start (once per node).")
@oopt("--pre-train-args", default="", show_default="none",
      help="Arguments of the pre-train script (one shell-quoted string).")
@oopt("--post-train-script", default=None, show_default="none", help="Run after the workers end (once per node).")
@oopt("--post-train-args", default="", show_default="none", help="Arguments of the post-train script.")
@click.option(*_names("--print-completion"), type=click.Choice(COMPLETION_SHELLS), default=None, is_eager=True,
              expose_value=False, callback=_print_completion, show_default=OFF,
              help="Print the shell completion script for bash or zsh and exit (tcsh: not offered by click).")
@click.version_option(__version__, "--version", prog_name="hyperpodrun")
@click.argument("training_script", metavar="TRAINING_SCRIPT")
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def launch(training_script: str, training_script_args: tuple[str, ...], **opts: Any) -> None:
    """Launch TRAINING_SCRIPT on this node's workers (torchrun-compatible)."""
    try:
        settings.use(settings.load())
        cfg = build_config(opts, training_script, training_script_args, _env_sources(click.get_current_context()))
        if cfg.k8s_report:   # the client and the pod are checked before anything starts (exit 2, one line)
            from hyperpodrun.agent.observe.k8s_api import preflight
            preflight()
    except ConfigError as exc:   # every check is LaunchConfig's (hyperpodrun/launch/config.py): print its one line
        raise click.UsageError(str(exc)) from None
    _setup_logging()
    _import_torch_quietly()
    from hyperpodrun.agent.agent import Agent  # the agent (and torch) load only once the flags are valid
    _exit_now(Agent(cfg).run())


def _import_torch_quietly() -> None:
    """torch's C++ store client logs a warning with a C++ stack for each broken connection (when the node that
    hosts the coordination store goes away, say) on the agent's stderr, ahead of the agent's own one-line
    report of it. The agent handles those errors itself, so it imports torch with C++ warnings off
    (TORCH_CPP_LOG_LEVEL=ERROR, read at import) unless the user chose a level; the workers' environment is
    left as the user's."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


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


_CLOSED_STD_FDS: list[int] = []


def _setup_logging() -> None:
    """The agent's log lines go to stderr through a writer thread (agent/workers/tee.py, ConsoleLogHandler): a stderr
    that nobody reads drops lines instead of freezing the agent's supervision loop in a log call."""
    from hyperpodrun.agent.workers.tee import ConsoleLogHandler
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is an OSError
        fd = 2
    handler = ConsoleLogHandler(fd)
    handler.setFormatter(logging.Formatter("[hyperpodrun %(asctime)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hyperpodrun")
    root.handlers[:] = [handler]
    root.setLevel(settings.current().log_level)
    root.propagate = False
    if 1 in _CLOSED_STD_FDS:
        root.warning("stdout is closed: the workers' console output is dropped (their log files keep it)")


def _one_line_error(exc: click.ClickException) -> None:
    """A usage error as one line on stderr (no usage block: `--help` is one flag away)."""
    message = " ".join(exc.format_message().split())
    hint = " (hyperpodrun --help lists the flags)" if isinstance(exc, click.NoSuchOption) else ""
    click.echo(f"Error: {message}{hint}", err=True)


def _open_std_fds() -> list[int]:
    """Put /dev/null on any of fds 0-2 that the caller closed (`hyperpodrun ... >&-`), so that no pipe or
    log file the agent opens later takes that number and gets console output written into it. Returns the
    fds that were closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)   # fd was free: the open itself may have landed there
    for fd, name, mode in ((1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))
    return closed


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point: dispatch subcommands, else launch. Usage errors: one line, exit 2."""
    global _CLOSED_STD_FDS
    _CLOSED_STD_FDS = _open_std_fds()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        from hyperpodrun.tools import tools
        command: click.Command = tools
    else:
        command = launch
    try:
        command.main(args=args, prog_name="hyperpodrun", standalone_mode=False, complete_var=COMPLETE_VAR)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        _one_line_error(exc)
        sys.exit(EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code)
    except click.Abort:
        sys.exit(130)
