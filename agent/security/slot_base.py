"""The slot base: made by the agent before any worker runs, or a private one when the usual one is squatted.

Why: the workers keep their snapshot slots under `<shm>/hyperpodrun-<uid>` (hyperpodrun/state/slots/shm_runs.py),
a predictable name in a directory every user can write. Another user who creates it first (or a symlink, or
one of ours left open to others) makes every CheckpointManager refuse it (UnsafePathError: right, as it
would read what they planted) - and so ended the job. Checking at start was not enough: a base absent then
could be created by another user before the first worker made it. So the agent makes it itself at start,
exclusively (`os.mkdir` 0700, then checked: ours, a directory, 0700): once it is ours in the sticky /dev/shm
nobody else can replace it. When the name is taken already and not ours alone, the agent makes a fresh
private directory beside it (`mkdtemp`, 0700, a name nobody can guess) and hands it to its workers and
standbys as their HYPERPODRUN_SHM_DIR, with a `slot_base_squatted` event; the job runs on, and that directory
goes with the agent. A base that is ours alone already is left as it is.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from typing import Optional

from hyperpodrun import safe_fs
from hyperpodrun.launch import settings
from hyperpodrun.agent.ports import Events
from hyperpodrun.state.slots import shm_runs

log = logging.getLogger("hyperpodrun.agent")


def _squatter(base: str) -> Optional[str]:
    """Why `base` cannot hold our slots (None: it is absent, or ours alone)."""
    try:
        st = os.lstat(base)
    except OSError:
        return None
    if safe_fs.is_private_dir(base):
        return None
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return f"it has mode {stat.S_IMODE(st.st_mode):04o}"


def _claim(base: str) -> Optional[str]:
    """Make `base` ours now (0700) unless it exists; then why it cannot hold our slots (None: it is ours alone,
    or it could not be made at all - a missing or read-only <shm>: the workers say why they keep no slots)."""
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.debug("could not make the slot base %s (%s); the workers will try", base, exc.strerror or exc)
        return None
    return _squatter(base)


def private_shm_dir(events: Events, shm_dir: Optional[str] = None) -> Optional[str]:
    """Make the slot base under `shm_dir` (default: HYPERPODRUN_SHM_DIR, /dev/shm) ours, before any worker
    runs; when it is squatted, a private directory to give the workers as HYPERPODRUN_SHM_DIR. None when the
    usual base will do (or no private one can be made: then the workers say why they cannot keep slots)."""
    shm = shm_dir or settings.current().shm_dir
    base = shm_runs.checkpoint_base(shm)
    why = _claim(base)
    if why is None:
        return None
    try:
        private = tempfile.mkdtemp(prefix=f"hyperpodrun-{os.getuid()}.", dir=shm)   # 0700, ours, unguessable
    except OSError as exc:   # a full or read-only tmpfs: the workers could not keep slots there either
        log.warning("%s cannot hold this job's snapshots (%s) and no private directory could be made in %s (%s)",
                    base, why, shm, exc.strerror or exc)
        return None
    events.emit("slot_base_squatted", f"{base} cannot hold this job's snapshots ({why}: another user may have "
                f"created it); using the private {private} instead for this job. Remove {base} when you can",
                path=base, private=private, level=logging.WARNING)
    return private


def remove(private: Optional[str]) -> None:
    """The agent ends: its private slot base goes (the snapshots in it were only ever for this agent's job)."""
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)
