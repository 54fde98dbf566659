"""Directories and files that another local user cannot pre-create, redirect or read.

Why: our shared-memory and temp paths (`/dev/shm/hyperpodrun-<uid>/<run>`, `$TMPDIR/hyperpodrun-logs-<uid>`)
are predictable and live in world-writable directories. Another user could create them first (and plant
state we would read back), or put a symlink there (and have us write through it into a file we may write,
as root anything). So: directories are created with mode 0700 and accepted only when they are a real
directory (never a symlink), owned by us, and not open to group or others; files holding model state are
created 0600 and never opened through a symlink.
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

from hyperpodrun.errors import UnsafePathError


def _check_dir(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} is a symlink; hyperpodrun does not follow symlinks for its private "
                              "directories. Remove it (someone else may have planted it)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} exists and is not a directory; remove it")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                              "another user may have created it to plant state. Remove it, or point hyperpodrun "
                              "elsewhere")
    if st.st_mode & 0o077:
        raise UnsafePathError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; hyperpodrun keeps its private "
                              f"directories 0700. Fix: chmod 700 {path} (after checking its contents), or remove it")


def private_dir(path: str) -> str:
    """Create `path` (one level) with mode 0700, or accept an existing one only if it is ours alone.

    The parent must exist. Raises UnsafePathError naming the problem and the fix.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _check_dir(path, os.lstat(path))
    return path


def private_tree(base: str, *parts: str) -> str:
    """`private_dir` for `base` and each level of `parts` below it; returns the deepest path."""
    path = private_dir(base)
    for part in parts:
        if not part or part in (".", "..") or os.sep in part:
            raise UnsafePathError(f"{part!r} is not a plain directory name")
        path = private_dir(os.path.join(path, part))
    return path


def is_private_dir(path: str) -> bool:
    """Whether `path` is a directory we may read state from (ours, 0700-ish, not a symlink)."""
    try:
        _check_dir(path, os.lstat(path))
    except (OSError, UnsafePathError):
        return False
    return True


def open_private(path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode: int = 0o600) -> int:
    """os.open that never follows a symlink at `path` and creates the file with `mode` (default 0600).

    An existing file keeps its mode unless it is open to others, which is narrowed to `mode`.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file; remove it")
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def owned_dir(path: str, mode: int = 0o755) -> str:
    """Create `path` (one level; `mode` less the umask), or accept an existing one only if it is a real
    directory of ours that neither group nor others can write. For directories below one the user chose
    (e.g. a run directory under --log-dir): readable by others as the user's umask says, but never one
    another user created or could put a symlink into."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        _check_dir(path, st)   # raises with the reason
    if st.st_mode & 0o022:
        raise UnsafePathError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users could put files or "
                              f"symlinks there. Fix: chmod go-w {path} (after checking its contents), or remove it")
    return path


def owned_tree(base: str, *parts: str, mode: int = 0o755) -> str:
    """`owned_dir` for each level of `parts` below `base` (which is not checked); returns the deepest path."""
    path = base
    for part in parts:
        if not part or part in (".", "..") or os.sep in part:
            raise UnsafePathError(f"{part!r} is not a plain directory name")
        path = owned_dir(os.path.join(path, part), mode)
    return path


def open_append(path: str, mode: int = 0o600) -> int:
    """A log file opened for appending (created with `mode`), never through a symlink."""
    return open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)


def append_file(path: str) -> BinaryIO:
    """`open_append` as an unbuffered binary file object (a worker's stdout/stderr log)."""
    return os.fdopen(open_append(path), "ab", buffering=0)
