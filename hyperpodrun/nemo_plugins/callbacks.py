"""`CheckpointlessCallback` at the product note's path (the implementation:
hyperpodrun/runtime/lightning_callback.py)."""
from hyperpodrun.runtime.lightning_callback import CheckpointlessCallback

__all__ = ["CheckpointlessCallback"]
