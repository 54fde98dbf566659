"""The MMAP data cache (Tier 2): batches in shared memory, served by step, resumable after any restart.

`CacheResumeMMAPConfig` configures it, `MMAPDataLoader` serves a loader's batches by step
(`for step, batch in loader.iter_from(start)`), `MMAPDataModule` wraps a Lightning data module, and
`ResumableSampler` makes a plain DataLoader resumable at any step. See docs/mmap-data.md.
"""
from __future__ import annotations

from hyperpodrun.data.config import CacheResumeMMAPConfig
from hyperpodrun.data.datamodule import MMAPDataModule
from hyperpodrun.data.errors import (CacheCorruptError, CacheFullError, CacheTimeoutError, DataStateLostError,
                                     MMAPConfigError)
from hyperpodrun.data.loader import MMAPDataLoader
from hyperpodrun.data.sampler import ResumableSampler

__all__ = ["CacheResumeMMAPConfig", "MMAPDataLoader", "MMAPDataModule", "ResumableSampler", "MMAPConfigError",
           "CacheFullError", "CacheCorruptError", "CacheTimeoutError", "DataStateLostError"]
