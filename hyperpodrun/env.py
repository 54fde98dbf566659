"""The worker environment contract: torchrun's variables with torchrun's values, plus ours.

Names live here once; the agent computes them, the runtime reads them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# ours (documented in the README, "Worker environment")
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

# the product note's Tier-1 switches (stock PyTorch knows neither; see README "Rootless bootstrap")
HPCT_USE_ROOTLESS = "HPCT_USE_ROOTLESS"
TORCH_SKIP_TCPSTORE = "TORCH_SKIP_TCPSTORE"

# under --inprocess-restart NCCL must clean up, not kill the survivors (DESIGN §3)
INPROCESS_NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
}


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


def hand_down_key(env: dict[str, str], secret: bytes) -> None:
    """Give the workers (and the warm spawner) the workers' key, derived one-way from the job secret, and
    never the secret itself (hyperpodrun/auth.py): a rank can authenticate peer copies, not sign the agents'
    records."""
    from hyperpodrun import auth
    env.pop(auth.SECRET_ENV, None)
    env[HYPERPODRUN_JOB_KEY] = auth.derive(secret, "worker").hex()


def inprocess_env_overrides(base: Mapping[str, str]) -> list[str]:
    """Names of NCCL settings the user set that conflict with in-process restart (warned about)."""
    return [k for k, v in INPROCESS_NCCL_DEFAULTS.items() if k in base and base[k] != v]
