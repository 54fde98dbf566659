"""`CudaHealthCheck` at the product note's path (the implementation: hyperpodrun/runtime/health.py)."""
from hyperpodrun.runtime.health import CudaHealthCheck

__all__ = ["CudaHealthCheck"]
