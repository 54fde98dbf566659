"""Exceptions of the MMAP data cache: each names what went wrong and what to change."""
from __future__ import annotations

import errno

from hyperpodrun.errors import ConfigError, HyperpodrunError
from hyperpodrun.runtime.checkpoint import StateLostError


class MMAPConfigError(ConfigError, ValueError):
    """A `CacheResumeMMAPConfig` field is invalid; the message names the field and the fix."""


class CacheFullError(OSError):
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


__all__ = ["MMAPConfigError", "CacheFullError", "CacheCorruptError", "DataStateLostError", "CacheTimeoutError"]
