"""--pre-train-script / --post-train-script: run once per node, before and after the workers."""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from typing import Any

log = logging.getLogger("hyperpodrun.agent")


def hook_argv(script: str, args: list[str]) -> list[str]:
    """An executable runs as is; a .py file with this Python; anything else with /bin/sh."""
    if os.access(script, os.X_OK) and not os.path.isdir(script):
        return [script, *args]
    if script.endswith(".py"):
        return [sys.executable, script, *args]
    return ["/bin/sh", script, *args]


def run_hook(kind: str, script: str, args: list[str], events: Any, sup: Any) -> int:
    """Run a hook to completion; return its exit status (signal N -> 128+N) and log a clear line."""
    argv = hook_argv(script, args)
    events.emit(f"{kind}_start", f"{kind} script: {shlex.join(argv)}")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    except OSError as exc:
        events.emit(f"{kind}_failed", f"{kind} script {script!r} cannot start: {exc.strerror}",
                    level=logging.ERROR)
        return 127
    sup.track_extra(proc.pid)
    code = proc.wait()
    status = 128 - code if code < 0 else code
    if status:
        events.emit(f"{kind}_failed", f"{kind} script {script!r} failed with exit code {status}; "
                    "fix the script or drop the flag", level=logging.ERROR, exit_code=status)
    else:
        events.emit(f"{kind}_done", f"{kind} script finished")
    return status
