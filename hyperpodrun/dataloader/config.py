"""`CacheResumeMMAPConfig` at the product note's path (the implementation: hyperpodrun/data/config.py)."""
from hyperpodrun.data.config import CacheResumeMMAPConfig

__all__ = ["CacheResumeMMAPConfig"]
