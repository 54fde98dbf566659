"""`CheckpointlessAbortManager` and `CheckpointlessFinalizeCleanup` at the product note's path (the
implementation: hyperpodrun/runtime/abort.py)."""
from hyperpodrun.runtime.abort import AbortProcessGroups, CheckpointlessAbortManager, CheckpointlessFinalizeCleanup

__all__ = ["CheckpointlessAbortManager", "CheckpointlessFinalizeCleanup", "AbortProcessGroups"]
