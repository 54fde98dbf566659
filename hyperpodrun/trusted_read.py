"""What `hyperpodrun logs` and `hyperpodrun inject` may read, and how its text reaches the terminal.

Why: the tools look in predictable places (the default log base `$TMPDIR/hyperpodrun-logs-<uid>` in a
directory every user can write) and act on what they find: `inject` connects to the endpoint a
`node<N>.agent.json` names, `logs` prints event and log text. Another user who created that base first could
point `inject` at their own endpoint, hang `logs` on a FIFO, or print terminal escape sequences (OSC: set the
window title, write the clipboard, fake a prompt) into our terminal. So the tools apply the launcher's rule
(hyperpodrun/safe_fs.py) before reading:

- the default log base is used only when it is ours alone (a real directory, our uid, 0700);
- a run directory only when it is a real directory of ours that neither group nor others can write (the
  rule of the run directories the agent makes, under any --log-dir);
- every file (event logs, worker logs, node<N>.agent.json) is opened with O_NOFOLLOW and O_NONBLOCK (a FIFO
  never blocks the open) and read only when it is a regular file of ours;

and replace every control character (C0 but tab, DEL, C1: ESC starts every terminal escape) in event and log
text with a visible `\\xNN` before printing.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Optional

from hyperpodrun.errors import UnsafePathError   # a path the tools do not read (the message says why)

#: control characters replaced before printing: C0 but tab (and newline, where lines are printed whole), DEL, C1
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_CONTROL_KEEP_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with its control characters shown as `\\xNN` (never sent to the terminal as they are)."""
    pattern = _CONTROL_KEEP_NEWLINE if keep_newlines else _CONTROL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _why_not_ours(st: os.stat_result, what: str, private: bool) -> Optional[str]:
    if stat.S_ISLNK(st.st_mode):
        return f"{what} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); another user may have " \
               "created it"
    if st.st_mode & (0o077 if private else 0o022):
        return f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: other users could put files there"
    return None


def check_dir(path: str, private: bool = False) -> None:
    """Raise UnsafePathError unless `path` is a real directory of ours that group and others cannot write
    (`private`: cannot use at all: the default log base)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"{path}: {exc.strerror or exc}") from None
    why = _why_not_ours(st, path, private)
    if why is not None:
        raise UnsafePathError(why)


def is_ours(path: str, private: bool = False) -> bool:
    """`check_dir` as a yes/no."""
    try:
        check_dir(path, private)
    except UnsafePathError:
        return False
    return True


def open_file(path: str) -> int:
    """A read-only fd of `path`: never through a symlink, never a FIFO or device (the open does not block),
    only a regular file of ours. Raises UnsafePathError (or OSError: it is not there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePathError(f"{path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str, offset: int = 0) -> bytes:
    """What a trusted file holds from `offset` on (`open_file`)."""
    fd = open_file(path)
    with os.fdopen(fd, "rb") as fh:
        fh.seek(offset)
        return fh.read()


def event_files(run_dir: str) -> list[str]:
    return sorted(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.endswith(".events.jsonl"))


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Every record of the run's event logs that are regular files of ours, in time order (JSON objects with
    a numeric `ts` only; other lines and untrusted files are skipped)."""
    out: list[dict[str, Any]] = []
    for path in event_files(run_dir):
        try:
            data = read_bytes(path)
        except (OSError, UnsafePathError):
            continue
        for line in data.decode(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            ts = rec.get("ts") if isinstance(rec, dict) else None
            if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts) and 0 <= ts < 1e11:
                out.append(rec)
    return sorted(out, key=lambda r: r["ts"])
