"""`CheckpointlessMegatronStrategy` at the product note's path (the implementation:
hyperpodrun/integrations/megatron_strategy.py)."""
from hyperpodrun.integrations.megatron_strategy import CheckpointlessMegatronStrategy

__all__ = ["CheckpointlessMegatronStrategy"]
