"""`HPWrapper` at the product note's path (the implementation: hyperpodrun/runtime/wrapper.py)."""
from hyperpodrun.runtime.wrapper import CallWrapper, HPWrapper

__all__ = ["HPWrapper", "CallWrapper"]
