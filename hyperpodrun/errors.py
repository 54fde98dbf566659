"""Exception classes and the documented exit codes of hyperpodrun."""
from __future__ import annotations

# Documented exit codes (README "Exit codes").
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_AGENT_ERROR = 1
#: some rank's committed state survives nowhere (checkpointless state lost)
EXIT_STATE_LOST = 75
#: the node has no usable GPU left: the scheduler should replace the node
EXIT_NO_USABLE_GPU = 76
#: the same step failed --max-step-failures times in a row
EXIT_STEP_KEEPS_FAILING = 77
#: a worker's health check failed (or abort timed out): the agent replaces the process
EXIT_WORKER_UNHEALTHY = 74
#: the restart budget (--max-restarts) is exhausted (used when no worker exit code applies)
EXIT_RESTARTS_EXHAUSTED = 78


class HyperpodrunError(Exception):
    """Base class of every error hyperpodrun raises on purpose."""


class ConfigError(HyperpodrunError):
    """A flag or environment value is invalid; the message names it and the fix."""


class RendezvousError(HyperpodrunError):
    """The agents could not meet (store unreachable, timeout, size mismatch)."""


class WorkerSpawnError(HyperpodrunError):
    """A worker process could not be started."""
