"""hyperpodrun: a torchrun-compatible launcher with in-process restart, and the runtime its workers import.

Importing this package is cheap: it loads neither the agent nor Lightning. The runtime API
(HPWrapper, CheckpointManager, ...) is imported lazily on first attribute access.

The house (docs/ARCHITECTURE.md, "Layout"): here the CLI, the contracts every side shares (env, protocol,
errors, auth, safe_fs, netaddr, netwatch) and the tools; `launch` (flags -> LaunchConfig), `runtime` (the
in-process protocol in the workers), `state` (the checkpointless state tier), `data` (the MMAP cache),
`integrations` (Hugging Face, the Lightning strategy), `dataloader` / `inprocess` / `nemo_plugins` (the
product note's module paths, thin aliases), `agent` (the node agent, from the agent/ folder).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "HPWrapper": "hyperpodrun.runtime.wrapper",
    "CallWrapper": "hyperpodrun.runtime.wrapper",
    "wait_rank": "hyperpodrun.runtime.wrapper",
    "HPAgentK8sAPIFactory": "hyperpodrun.runtime.agent_channel",
    "CudaHealthCheck": "hyperpodrun.runtime.health",
    "CheckpointlessAbortManager": "hyperpodrun.runtime.abort",
    "CheckpointlessFinalizeCleanup": "hyperpodrun.runtime.abort",
    "AbortProcessGroups": "hyperpodrun.runtime.abort",
    "CheckpointManager": "hyperpodrun.state.checkpoint",
    "HyperpodrunError": "hyperpodrun.errors",
    "StateLostError": "hyperpodrun.errors",
    "CheckpointlessCallback": "hyperpodrun.runtime.lightning_callback",
    "CheckpointlessMegatronStrategy": "hyperpodrun.integrations.megatron_strategy",
    "CacheResumeMMAPConfig": "hyperpodrun.data",
    "MMAPDataModule": "hyperpodrun.data",
    "MMAPDataLoader": "hyperpodrun.data",
    "ResumableSampler": "hyperpodrun.data",
}

__all__ = ["__version__", *_LAZY]

from hyperpodrun import usage_exit as _usage_exit  # noqa: E402

_usage_exit.install()   # in a worker hyperpodrun started: an uncaught usage error is one line, exit code 2


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperpodrun' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
