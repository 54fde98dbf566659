"""A usage error of the worker API (a bad CacheResumeMMAPConfig, CheckpointManager argument, a missing optional
dependency, ...) that the user's script does not catch ends a worker started by hyperpodrun the way a bad
launcher flag ends hyperpodrun: one line naming the problem and the fix, exit code 2 (docs/exit-codes.md),
not a traceback. Any other uncaught exception goes to the previous hook, unchanged."""
from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Optional

from hyperpodrun.env import HYPERPODRUN_AGENT_PID   # set by the agent for its workers


def one_line(exc: BaseException) -> str:
    """How a usage error is shown: `hyperpodrun: <class>: <message>` on one line."""
    text = " ".join(str(exc).split())
    return f"hyperpodrun: {type(exc).__name__}: {text}"


def install() -> None:
    """Install the hook in a worker started by hyperpodrun (once; elsewhere nothing changes)."""
    if not os.environ.get(HYPERPODRUN_AGENT_PID) or getattr(sys.excepthook, "_hyperpodrun_usage", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        from hyperpodrun.errors import EXIT_USAGE, USAGE_ERRORS
        if not isinstance(value, USAGE_ERRORS):
            previous(kind, value, tb)
            return
        for stream, text in ((sys.stdout, ""), (sys.stderr, one_line(value) + "\n")):
            try:
                stream.write(text)
                stream.flush()
            except Exception:   # a closed or full console: the exit code still says it
                pass
        os._exit(EXIT_USAGE)
    setattr(hook, "_hyperpodrun_usage", True)
    sys.excepthook = hook
