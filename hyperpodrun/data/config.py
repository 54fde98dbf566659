"""CacheResumeMMAPConfig: where the MMAP data cache lives and how far it reads ahead and keeps behind.

Validated when built, so a wrong value fails at start-up with a message naming the field and the fix,
not later inside a producer thread.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hyperpodrun.data.errors import MMAPConfigError

#: resume policies (see CacheResumeMMAPConfig.resume)
RESUME_POLICIES = ("auto", "replay", "never")
_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: most batches a producer reads ahead: each is a file (and memory) in the cache directory
MAX_PREFETCH_LENGTH = 4096


def default_cache_dir() -> str:
    """`/dev/shm/pdl_cache-<uid>`: one per user. A name without the uid was taken by whichever user came first
    (another user's `/dev/shm/pdl_cache` turned this user's cache off, and two honest users collided)."""
    return f"/dev/shm/pdl_cache-{os.getuid()}"


def _int(name: str, value: Any, minimum: int, fix: str, maximum: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MMAPConfigError(f"CacheResumeMMAPConfig({name}={value!r}): must be an integer; {fix}")
    if value < minimum:
        raise MMAPConfigError(f"CacheResumeMMAPConfig({name}={value!r}): must be >= {minimum}; {fix}")
    if maximum is not None and value > maximum:
        raise MMAPConfigError(f"CacheResumeMMAPConfig({name}={value!r}): must be <= {maximum}; {fix}")


@dataclass(frozen=True)
class CacheResumeMMAPConfig:
    """Settings of the MMAP data cache (names from the product note).

    cache_dir: directory for the batch files; a tmpfs (/dev/shm) so that files are memory and survive the
        death of a worker process. Default: /dev/shm/pdl_cache-<uid> (one per user). Missing, unwritable,
        full, or not this user's alone (another user created it first, a symlink): the loader reads the
        wrapped loader directly, with one warning.
    prefetch_length: batches produced from the current step on (the current one included).
    lookback_length: batches kept behind the current step, so a restart that goes back that far (the
        restored step is at most one step behind) still reads from the cache.
        A producer keeps at most prefetch_length + lookback_length batch files.
    share_key: ranks passing the same key see identical batches (a data-replication group, e.g. the
        tensor-parallel ranks of one data shard); they share one producer and one copy per node.
        None: every rank has its own producer.
    max_bytes: cap on the bytes of one producer's batch files; reaching it is handled like a full tmpfs.
    resume: how a producer continues past the cached batches when it has to start again (a new process,
        or a step outside the cache): "auto" uses the loader's state (StatefulDataLoader-style
        state_dict(), or a ResumableSampler) and fails with DataStateLostError when there is none;
        "replay" also re-reads a stateless source from the start of the epoch, skipping batches (correct
        only for a deterministic source); "never" serves cached batches only and fails beyond them.
    wait_timeout: seconds a consumer waits for one batch before raising CacheTimeoutError.
    cleanup_stale: remove other runs' files whose owner is gone, when the cache is first opened.
    enabled: False reads the wrapped loader directly (same API; for comparisons).
    """

    cache_dir: str = field(default_factory=default_cache_dir)
    prefetch_length: int = 10
    lookback_length: int = 2
    share_key: Optional[str] = None
    max_bytes: Optional[int] = None
    resume: str = "auto"
    wait_timeout: float = 600.0
    cleanup_stale: bool = True
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cache_dir, (str, os.PathLike)) or not str(self.cache_dir).strip():
            raise MMAPConfigError(f"CacheResumeMMAPConfig(cache_dir={self.cache_dir!r}): must be a directory path, "
                                  "e.g. '/dev/shm/pdl_cache' (a tmpfs)")
        object.__setattr__(self, "cache_dir", os.path.abspath(os.path.expanduser(str(self.cache_dir))))
        _int("prefetch_length", self.prefetch_length, 1,
             "it counts the batches read ahead, the current one included (the product note uses 10)",
             maximum=MAX_PREFETCH_LENGTH)
        _int("lookback_length", self.lookback_length, 0,
             "it counts the batches kept behind the current step (2 covers a restored step one step back)")
        if self.share_key is not None and (not isinstance(self.share_key, str) or not _KEY.match(self.share_key)):
            raise MMAPConfigError(f"CacheResumeMMAPConfig(share_key={self.share_key!r}): use 1-64 characters of "
                                  "[A-Za-z0-9_.-] naming the data-replication group (e.g. f'dp{dp_rank}'), "
                                  "or None for one producer per rank")
        if self.max_bytes is not None:
            _int("max_bytes", self.max_bytes, 1, "give the cap in bytes, or None for no cap")
        if self.resume not in RESUME_POLICIES:
            raise MMAPConfigError(f"CacheResumeMMAPConfig(resume={self.resume!r}): must be one of "
                                  f"{', '.join(RESUME_POLICIES)}")
        if isinstance(self.wait_timeout, bool) or not isinstance(self.wait_timeout, (int, float)) \
                or not self.wait_timeout > 0:
            raise MMAPConfigError(f"CacheResumeMMAPConfig(wait_timeout={self.wait_timeout!r}): must be positive "
                                  "seconds (how long a consumer waits for one batch)")
        for flag in ("cleanup_stale", "enabled"):
            if not isinstance(getattr(self, flag), bool):
                raise MMAPConfigError(f"CacheResumeMMAPConfig({flag}={getattr(self, flag)!r}): must be True or False")

    @property
    def window(self) -> int:
        """Most batch files one producer keeps."""
        return self.prefetch_length + self.lookback_length


__all__ = ["CacheResumeMMAPConfig", "RESUME_POLICIES"]
