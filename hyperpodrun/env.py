"""The worker environment contract (docs/ARCHITECTURE.md, "Contracts"): torchrun's variables with torchrun's values,
plus ours.

Names live here once. The agent writes them (`worker_env`); the runtime reads ours, and the torchrun ones it
needs to know whether a launcher started it, through `worker_context()` - one reader, so that a value that
does not parse is one clear ConfigError and not a ValueError somewhere in the runtime. (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT are torchrun's and the user's too; the runtime reads them where it uses them.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from hyperpodrun.errors import ConfigError

# ours (documented in docs/flags.md, "Worker environment")
HYPERPODRUN_CONTROL = "HYPERPODRUN_CONTROL"            # ipc:// endpoint of the agent's control server
HYPERPODRUN_RUN_DIR = "HYPERPODRUN_RUN_DIR"            # the run's log directory
HYPERPODRUN_GENERATION = "HYPERPODRUN_GENERATION"      # restart generation this process was started in
HYPERPODRUN_INPROCESS = "HYPERPODRUN_INPROCESS"        # "1" under --inprocess-restart
HYPERPODRUN_NODE_RANK = "HYPERPODRUN_NODE_RANK"
HYPERPODRUN_HOST = "HYPERPODRUN_HOST"                  # host name used in log prefixes and reports
HYPERPODRUN_HEARTBEAT_INTERVAL = "HYPERPODRUN_HEARTBEAT_INTERVAL"
HYPERPODRUN_AGENT_PID = "HYPERPODRUN_AGENT_PID"
HYPERPODRUN_ROOTLESS = "HYPERPODRUN_ROOTLESS"          # "1" when the agent hosts the workers' stores
HYPERPODRUN_JOB_KEY = "HYPERPODRUN_JOB_KEY"            # hex of the workers' key, derived from the job secret
#: the worker's real local rank: LOCAL_RANK is 0 for every worker under --virtual-local-rank, and what is the
#: agent's per-local-rank (slot directories, the HELLO to the agent) reads this one (`real_local_rank`)
HYPERPODRUN_LOCAL_RANK = "HYPERPODRUN_LOCAL_RANK"
#: the folder with the workers' sitecustomize (the roll call in torch's init_process_group), first on PYTHONPATH
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")

# the product note's Tier-1 switches (stock PyTorch knows neither; see docs/deployment.md, "Rootless bootstrap")
HPCT_USE_ROOTLESS = "HPCT_USE_ROOTLESS"
TORCH_SKIP_TCPSTORE = "TORCH_SKIP_TCPSTORE"

# under --inprocess-restart NCCL must clean up, not kill the survivors (docs/ARCHITECTURE.md, "Contracts")
INPROCESS_NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # ProcessGroupNCCL's heartbeat monitor polls the generation's store for its "should dump" flag; after an
    # in-process restart that store is closed and each poll printed a c10::Error trace ("Failed to check the
    # \"should dump\" flag"). The agent's heartbeats and --progress-timeout watch for hangs instead.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

#: --standby-prerun: what a standby that runs the script ahead of a fault does not have until it becomes a rank -
#: the variables that name its place in the job (global rank, node rank, world size), its generation, its store,
#: its error file and its control channel, all decided when a rank dies. It has the rest of a worker's
#: environment from the start: the job's (LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID, HYPERPODRUN_RUN_DIR, ...) and its
#: local rank slot's (LOCAL_RANK, HYPERPODRUN_LOCAL_RANK, CUDA_VISIBLE_DEVICES under --virtual-local-rank) - a
#: standby only ever becomes a rank of its slot. A script that reads or sets one of these before its first
#: HPWrapper call is not run ahead (hyperpodrun/runtime/park.py).
RANK_BOUND_VARS = ("RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
                   "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
                   HYPERPODRUN_GENERATION, HYPERPODRUN_CONTROL, HYPERPODRUN_NODE_RANK)


@dataclass(frozen=True)
class WorkerIdentity:
    """Where one worker sits in the job."""

    local_rank: int
    rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    role: str = "default"


def worker_env(
    base: Mapping[str, str],
    who: WorkerIdentity,
    *,
    master_addr: str,
    master_port: int,
    generation: int,
    max_restarts: int,
    run_id: str,
    error_file: str,
    run_dir: str,
    host: str,
    control: Optional[str] = None,
    inprocess: bool = False,
    heartbeat_interval: float = 1.0,
) -> dict[str, str]:
    """The full environment of one worker process."""
    env = dict(base)
    env.update({
        "LOCAL_RANK": str(who.local_rank),
        HYPERPODRUN_LOCAL_RANK: str(who.local_rank),
        "RANK": str(who.rank),
        "GROUP_RANK": str(who.group_rank),
        "ROLE_RANK": str(who.rank),
        "ROLE_NAME": who.role,
        "LOCAL_WORLD_SIZE": str(who.local_world_size),
        "WORLD_SIZE": str(who.world_size),
        "GROUP_WORLD_SIZE": str(who.group_world_size),
        "ROLE_WORLD_SIZE": str(who.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(generation),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        HYPERPODRUN_RUN_DIR: run_dir,
        HYPERPODRUN_GENERATION: str(generation),
        HYPERPODRUN_NODE_RANK: str(who.group_rank),
        HYPERPODRUN_HOST: host,
        HYPERPODRUN_AGENT_PID: str(os.getpid()),
        HYPERPODRUN_ROOTLESS: "1",
        "PYTHONUNBUFFERED": base.get("PYTHONUNBUFFERED", "1"),
    })
    if control:
        env[HYPERPODRUN_CONTROL] = control
    if inprocess:
        env[HYPERPODRUN_INPROCESS] = "1"
        env[HYPERPODRUN_HEARTBEAT_INTERVAL] = str(heartbeat_interval)
        for key, value in INPROCESS_NCCL_DEFAULTS.items():
            env[key] = base.get(key, value)
    return env


def virtual_device(local_rank: int, visible: Optional[str]) -> str:
    """torchrun's --virtual-local-rank: the one CUDA_VISIBLE_DEVICES entry local rank `local_rank` gets - its entry
    (by position) of `visible`, the CUDA_VISIBLE_DEVICES it would have had, or the local rank itself when that is
    unset (torch 2.13's LocalElasticAgent._set_local_rank_env). ConfigError when `visible` has no such entry."""
    if visible is None:
        return str(local_rank)
    entries = visible.split(",")
    if local_rank >= len(entries):
        raise ConfigError(f"--virtual-local-rank: local rank {local_rank} has no GPU in CUDA_VISIBLE_DEVICES="
                          f"{visible!r} ({len(entries)} entries); list one GPU per worker there or lower "
                          "--nproc-per-node")
    return entries[local_rank].strip()


def virtual_local_rank_env(env: Mapping[str, str], local_rank: int) -> dict[str, str]:
    """What --virtual-local-rank changes in a worker's environment `env`: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES
    naming only its own GPU (so `cuda:0` is it). HYPERPODRUN_LOCAL_RANK keeps the real local rank."""
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": virtual_device(local_rank, env.get("CUDA_VISIBLE_DEVICES"))}


def real_local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This worker's real local rank: HYPERPODRUN_LOCAL_RANK (set by the agent), else LOCAL_RANK, else 0 - what
    keys per-local-rank state (slot directories), which --virtual-local-rank must not fold onto rank 0's."""
    env = os.environ if environ is None else environ
    for name in (HYPERPODRUN_LOCAL_RANK, "LOCAL_RANK"):
        text = env.get(name, "").strip()
        if text:
            try:
                return int(text)
            except ValueError:
                raise _set_by_us(name, text, "a local rank") from None
    return 0


#: on one node the workers' own listeners (gloo's pairs, NCCL's bootstrap sockets) stay on the loopback interface
#: (docs/security.md): without these, gloo listens on the address the host name resolves to - a routable one
#: on many clusters - although every peer is on this host. NCCL's NVLink/P2P/SHM transports do not use them.
LOOPBACK_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_IFNAME = "lo"


def keep_on_loopback(env: dict[str, str]) -> list[str]:
    """Set each of LOOPBACK_IFNAME_VARS the user left unset to the loopback interface; a value the user set
    is kept. Returns the names it set (a single-node job's workers: agent/workers/launch.py)."""
    added = [name for name in LOOPBACK_IFNAME_VARS if not env.get(name)]
    for name in added:
        env[name] = LOOPBACK_IFNAME
    return added


def hand_down_hook(env: dict[str, str]) -> None:
    """Put BOOT_DIR first on the workers' PYTHONPATH, so that every worker - a plain script, Lightning, Hugging
    Face - holds the roll call when it forms its default process group (hyperpodrun/runtime/group_hook.py);
    the user's PYTHONPATH and sitecustomize still apply. Not with HYPERPODRUN_ROLL_CALL=0."""
    from hyperpodrun.launch import settings
    if not settings.read("roll_call", env):
        return
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *parts])


def inprocess_env_overrides(base: Mapping[str, str]) -> list[str]:
    """Names of NCCL settings the user set that conflict with in-process restart (warned about)."""
    return [k for k, v in INPROCESS_NCCL_DEFAULTS.items() if k in base and base[k] != v]


# ------------------------------------------------------------------------------------------ worker side
@dataclass(frozen=True)
class WorkerContext:
    """What the launcher told this process through its environment (see `worker_context`)."""

    #: HYPERPODRUN_RUN_DIR: the run's log directory (None: not started by hyperpodrun)
    run_dir: Optional[str] = None
    #: TORCHELASTIC_RUN_ID: the job's id (hyperpodrun and torchrun set it)
    run_id: Optional[str] = None
    #: HYPERPODRUN_GENERATION: the restart generation this process was started in (or last joined)
    generation: int = 0
    #: TORCHELASTIC_RESTART_COUNT: torchrun's name of the generation
    restart_count: int = 0
    #: HYPERPODRUN_CONTROL: the agent's control endpoint (under --inprocess-restart)
    control: Optional[str] = None
    #: HYPERPODRUN_INPROCESS: "1" under --inprocess-restart
    inprocess: bool = False
    #: HYPERPODRUN_HEARTBEAT_INTERVAL: seconds between heartbeats
    heartbeat_interval: float = 1.0
    #: HYPERPODRUN_AGENT_PID: the agent whose life bounds this run's shared-memory state (None: unknown)
    agent_pid: Optional[int] = None
    #: HYPERPODRUN_NODE_RANK, HYPERPODRUN_HOST: where this worker runs
    node_rank: Optional[int] = None
    host: Optional[str] = None
    #: HYPERPODRUN_JOB_KEY: the workers' key (hyperpodrun/auth.py), never shown in a repr
    job_key: Optional[bytes] = field(default=None, repr=False)

    @property
    def launched(self) -> bool:
        """Whether a launcher (hyperpodrun, torchrun) started this process, and may start it again."""
        return self.run_dir is not None or self.run_id is not None

    @property
    def under_inprocess_restart(self) -> bool:
        """Whether this process runs under `hyperpodrun --inprocess-restart` (with a control endpoint)."""
        return self.inprocess and bool(self.control)


def _set_by_us(name: str, raw: str, what: str) -> ConfigError:
    return ConfigError(f"{name}={raw!r} is not {what}; hyperpodrun sets it for its workers (do not set it "
                       "yourself)")


def _whole(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise _set_by_us(name, raw, "a whole number") from None


def worker_context(environ: Optional[Mapping[str, str]] = None) -> WorkerContext:
    """Read the contract from `environ` (default: this process's environment, as it is now - the runtime
    updates the generation at each in-process restart). ConfigError names a value that does not parse."""
    env = os.environ if environ is None else environ
    interval_raw = env.get(HYPERPODRUN_HEARTBEAT_INTERVAL) or "1.0"
    try:
        interval = float(interval_raw)
    except ValueError:
        raise _set_by_us(HYPERPODRUN_HEARTBEAT_INTERVAL, interval_raw, "a number of seconds") from None
    key_raw = env.get(HYPERPODRUN_JOB_KEY)
    try:
        key = bytes.fromhex(key_raw) if key_raw else None
    except ValueError:
        raise ConfigError(f"{HYPERPODRUN_JOB_KEY} is not hex; it is set by hyperpodrun, do not set it "
                          "yourself") from None
    agent = env.get(HYPERPODRUN_AGENT_PID) or ""
    node = env.get(HYPERPODRUN_NODE_RANK) or ""
    return WorkerContext(
        run_dir=env.get(HYPERPODRUN_RUN_DIR), run_id=env.get("TORCHELASTIC_RUN_ID"),
        generation=_whole(env, HYPERPODRUN_GENERATION, 0),
        restart_count=_whole(env, "TORCHELASTIC_RESTART_COUNT", 0),
        control=env.get(HYPERPODRUN_CONTROL) or None, inprocess=env.get(HYPERPODRUN_INPROCESS) == "1",
        heartbeat_interval=interval, agent_pid=int(agent) if agent.isdigit() else None,
        node_rank=int(node) if node.isdigit() else None, host=env.get(HYPERPODRUN_HOST) or None, job_key=key)
