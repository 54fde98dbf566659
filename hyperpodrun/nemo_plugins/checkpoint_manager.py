"""`CheckpointManager` at the product note's path (the implementation: hyperpodrun/state/checkpoint.py)."""
from hyperpodrun.state.checkpoint import CheckpointManager

__all__ = ["CheckpointManager"]
