"""Exceptions of the MMAP data cache (defined with the rest of the hierarchy in hyperpodrun/errors.py, and
importable from here and from `hyperpodrun.data` as before)."""
from __future__ import annotations

from hyperpodrun.errors import (CacheCorruptError, CacheFullError, CacheTimeoutError, DataStateLostError,
                                MMAPConfigError)

__all__ = ["MMAPConfigError", "CacheFullError", "CacheCorruptError", "DataStateLostError", "CacheTimeoutError"]
