"""The documented exit codes of hyperpodrun and the one hierarchy of the errors it raises on purpose.

Every exception hyperpodrun raises on purpose derives from `HyperpodrunError`, so that a caller can catch
"anything hyperpodrun refused" in one clause. Where callers (or Python itself) rely on a builtin class the
error derives from that one too: a bad argument is also a `ValueError`, a state that cannot be saved also a
`TypeError` (HPWrapper's default `fatal_exceptions` treats it as a programming error), a full cache also an
`OSError` with errno ENOSPC, and so on. Each message names what went wrong and what to change.

The classes live here, in one module that imports nothing heavy; the modules that raise them re-export the
names users already import from there (`hyperpodrun.StateLostError`, `hyperpodrun.state.checkpoint.
StateLostError`, `hyperpodrun.data.CacheFullError`, `hyperpodrun.auth.AuthError`, ...).

Not errors and deliberately outside the hierarchy: `RestartInterrupt` (a BaseException that unwinds the
training function at a restart, hyperpodrun/runtime/interrupt.py) and `SystemExit`.
"""
from __future__ import annotations

import errno
from typing import Any

# Documented exit codes (docs/exit-codes.md).
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
#: a node was lost and no replacement joined within --replace-timeout
EXIT_NODE_NOT_REPLACED = 79
#: this agent was declared lost (silent past --node-timeout) and its node rank given to another agent
EXIT_FENCED = 80
#: a process outside the job took a rank's place in a worker group, again after one retry on a fresh store
#: (runtime/roll_call.py); a worker that finds one exits with it too (not counted as a failure of the script)
EXIT_INTRUDER = 81
#: an operator stopped the job through the status API (POST /stop with the token of --api-token-file;
#: agent/control/api_stop.py): the workers were stopped as on SIGTERM
EXIT_API_STOP = 82


class HyperpodrunError(Exception):
    """Base class of every error hyperpodrun raises on purpose."""


# ------------------------------------------------------------------------------------------ launch and agent
class ConfigError(HyperpodrunError):
    """A flag or environment value is invalid; the message names it and the fix.

    Deliberately not a ValueError: raised inside a LaunchConfig validator it passes through pydantic as it
    is, so the CLI prints exactly its message (hyperpodrun/launch/config.py)."""


class RendezvousError(HyperpodrunError):
    """The agents could not meet (store unreachable, timeout, size mismatch)."""


class FencedError(HyperpodrunError):
    """This agent was declared lost (its lease was not renewed for --node-timeout) and another agent holds
    its node rank now: it must not change the job any more (exit code EXIT_FENCED)."""


class WorkerSpawnError(HyperpodrunError):
    """A worker process could not be started."""


class ProtocolError(HyperpodrunError, ValueError):
    """A control-plane frame that is not a valid message (hyperpodrun/protocol.py; it is dropped), or a peer's
    restore inventory that is not one (state/restore/restore_plan.py)."""


class AuthError(HyperpodrunError):
    """A peer did not prove it knows the job's key, or a signed value does not verify (hyperpodrun/auth.py)."""


class RollCallError(AuthError):
    """A member of a new process group did not prove it knows the workers' key (runtime/roll_call.py): a
    process outside the job took a rank's place. The generation fails, the agent retries it on a fresh store
    (not counted against --max-restarts or --max-step-failures) and ends the job with EXIT_INTRUDER when it
    happens again."""

    exit_code = EXIT_INTRUDER

    def __init__(self, message: str, ranks: tuple[int, ...] = (), uids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks, self.uids = ranks, uids


class UnsafePathError(HyperpodrunError):
    """A path we would read state from or write to is not ours alone (another owner, a symlink, wide modes)."""


# ------------------------------------------------------------------------------------------ worker API
class ApiValueError(HyperpodrunError, ValueError):
    """An argument given to the worker API (HPWrapper, CheckpointManager, the data cache, ...) is out of its
    range; the message names the call, the argument and what it takes."""


class ApiTypeError(HyperpodrunError, TypeError):
    """An argument given to the worker API has the wrong type; the message names what it takes."""


class MissingDependencyError(HyperpodrunError, ImportError):
    """An optional dependency a feature needs is not installed (e.g. Lightning for CheckpointlessCallback)."""


class CheckpointStoreError(HyperpodrunError, ValueError):
    """CheckpointManager(fallback_dir=...) names a durable store that cannot be used: a URL of a scheme not
    supported, a missing bucket, credentials the store refuses, a directory that cannot be written. Raised
    when the manager is made (before any step), so the job ends at start, not hours later."""


class SetupOrderError(HyperpodrunError, TypeError):
    """Something an in-process restart must create again on every re-entry was created before the HPWrapper
    function ran (a process group, e.g. by Hugging Face `TrainingArguments` built at module level). A
    programming error: a `TypeError`, so HPWrapper's default `fatal_exceptions` ends the job at once."""


class RankEnvironmentTimeout(HyperpodrunError, TimeoutError):
    """The launcher did not complete this process's rank environment in time (`wait_rank`)."""


class OutOfOrderError(HyperpodrunError, RuntimeError):
    """An internal object was used out of order (a bug in hyperpodrun: please report it)."""


class HealthCheckError(HyperpodrunError, RuntimeError):
    """This process cannot continue (e.g. a sticky CUDA error): the agent must replace it."""


class InjectedFault(HyperpodrunError, RuntimeError):
    """Raised by an injected `raise` fault (`hyperpodrun inject --kind raise`); retried like a user's error."""


# ------------------------------------------------------------------------------------------ checkpointless state
class StateLostError(HyperpodrunError, RuntimeError):
    """Some rank's committed state survives nowhere (exit code 75): the job ends instead of restarting from
    step 0."""

    exit_code = EXIT_STATE_LOST


class StateMismatchError(HyperpodrunError, KeyError):
    """The state given to `CheckpointManager.restore` has an entry the snapshot does not hold."""


class ReplicaLayoutError(ApiValueError):
    """The replica layout given to CheckpointManager does not fit the job, puts both copies of a shard on one
    node, or differs from the layout a snapshot was taken under: a usage error (one line, exit code 2), never
    retried - the next round would meet the same layout."""


class SnapshotCorrupt(HyperpodrunError, ValueError):
    """A snapshot is incomplete, failed its checksum or holds malformed metadata: it is ignored."""


class CodecError(HyperpodrunError, ValueError):
    """Encoded metadata is malformed or names something this process does not allow
    (hyperpodrun/state/codec/safe_codec.py)."""


class UnsupportedStateError(HyperpodrunError, TypeError):
    """A value of a type the metadata encoding does not carry (raised when saving, never at restore)."""

    def __init__(self, kind: type, path: list[Any], why: str = "") -> None:
        super().__init__(kind, path, why)
        self.kind, self.path, self.why = kind, path, why
        self.root = "value"

    def where(self) -> str:
        """Where the value sits, e.g. state['opt']['param_groups'][0]['extra']."""
        return self.root + "".join(f"[{p!r}]" for p in self.path)

    def __str__(self) -> str:
        name = f"{self.kind.__module__}.{self.kind.__qualname__}"
        return (f"{self.where()} is a {name}: {self.why or 'not a type snapshots can hold'}. Snapshots hold "
                "tensors, numpy arrays, None/bool/int/float/complex/str/bytes, lists, tuples, dicts, sets, "
                "namedtuples and Enum members; convert it (e.g. to a dict) or keep it out of the saved state")


# ------------------------------------------------------------------------------------------ MMAP data cache
class MMAPConfigError(ConfigError, ValueError):
    """A `CacheResumeMMAPConfig` field is invalid; the message names the field and the fix."""


class CacheFullError(HyperpodrunError, OSError):
    """The cache has no room for a batch (the tmpfs is full, or the configured `max_bytes` cap is reached).

    Raised with errno ENOSPC, like a full tmpfs, so both take the same path: the loader stops caching and
    reads the wrapped loader directly."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


class CacheCorruptError(HyperpodrunError):
    """A batch file does not have the layout this version writes (never read as a batch)."""


class DataStateLostError(StateLostError):
    """The data stream cannot be resumed at the requested step without risking a wrong batch.

    A subclass of `StateLostError` (exit code 75): `HPWrapper` ends the job instead of retrying it."""


class CacheTimeoutError(HyperpodrunError, TimeoutError):
    """No batch arrived within `wait_timeout` seconds (the producing rank is stuck or gone)."""


#: the worker API's usage errors: in a launched worker one that nobody catches ends the process with one line
#: and EXIT_USAGE (hyperpodrun/usage_exit.py), like a bad flag of the launcher
USAGE_ERRORS: tuple[type[HyperpodrunError], ...] = (ConfigError, ApiValueError, ApiTypeError, SetupOrderError,
                                                   MissingDependencyError, CheckpointStoreError)

__all__ = ["USAGE_ERRORS", 
    "EXIT_OK", "EXIT_USAGE", "EXIT_AGENT_ERROR", "EXIT_STATE_LOST", "EXIT_NO_USABLE_GPU", "EXIT_STEP_KEEPS_FAILING",
    "EXIT_WORKER_UNHEALTHY", "EXIT_RESTARTS_EXHAUSTED", "EXIT_INTRUDER", "EXIT_API_STOP", "RollCallError",
    "HyperpodrunError", "ConfigError", "RendezvousError", "WorkerSpawnError", "ProtocolError", "AuthError",
    "UnsafePathError", "ApiValueError", "ApiTypeError", "MissingDependencyError", "CheckpointStoreError", "SetupOrderError",
    "RankEnvironmentTimeout",
    "OutOfOrderError", "HealthCheckError", "InjectedFault", "StateLostError", "StateMismatchError",
    "ReplicaLayoutError", "SnapshotCorrupt", "CodecError", "UnsupportedStateError", "MMAPConfigError",
    "CacheFullError", "CacheCorruptError", "DataStateLostError", "CacheTimeoutError",
]
