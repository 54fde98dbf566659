"""Standby pre-run, the agent's side (--standby-prerun auto|off, HYPERPODRUN_STANDBY_PRERUN).

Why: a standby (agent/workers/standby.py) saves a replacement rank the interpreter, the imports and the CUDA
context, but not the script's own top - a model or a data module built at module level, a framework's imports
the zygote does not know - which after a SIGKILL sits on the recovery's critical path (issue 35: 7.5-8 s from
the kill to the first step under Lightning with a standby). With pre-run the zygote's standby runs the script
ahead, as the rank it will become would, up to its first HPWrapper call, and parks there
(hyperpodrun/runtime/park.py); promoted, it only restores and goes on.

Here:
- `ahead_env`: the environment a standby runs the script with - its local rank slot's worker environment
  without the variables that name a rank (env.RANK_BOUND_VARS);
- `mismatch`: whether a parked standby can become the rank of a SpawnRequest (its environment must be the one
  the script ran with, apart from those variables);
- `run_ahead`: in the standby process, the start of the script (its session, output, environment, argv);
- `PrerunState`: the pool's memory of whether this job's script can be run ahead (the first standby that gives
  up says why once, event `standby_prerun`; every standby after it waits before the script, as without pre-run).
"""
from __future__ import annotations

import logging
import os
import runpy
import socket
import traceback
from typing import Any, Mapping, Optional

from hyperpodrun.env import RANK_BOUND_VARS
from hyperpodrun.runtime import park

log = logging.getLogger("hyperpodrun.agent")

#: the values of --standby-prerun
MODES = ("auto", "off")


def ahead_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """The environment a standby runs the script ahead with: the worker environment of its local rank slot
    without the variables that name a rank, its generation or its store."""
    return {k: v for k, v in worker_env.items() if k not in RANK_BOUND_VARS}


def mismatch(ahead: Mapping[str, str], task: Mapping[str, str]) -> Optional[str]:
    """Why a standby that ran the script with the environment `ahead` cannot become the rank whose environment is
    `task` (None: it can) - the script's top may have read any of the others (a GPU the rank was moved to, a
    setting changed since)."""
    rest = ahead_env(task)
    changed = sorted(k for k in rest.keys() | ahead.keys() if rest.get(k) != ahead.get(k))
    if not changed:
        return None
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return f"the rank's environment differs from the one its standby ran the script with ({shown})"


class PrerunState:
    """Whether the pool's standbys run the script ahead: on (`--standby-prerun auto`) until one gives up."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.gave_up: Optional[str] = None   # the first standby's reason

    @property
    def on(self) -> bool:
        return self.enabled and self.gave_up is None

    def give_up(self, why: str) -> tuple[str, int]:
        """A standby gave up for `why`: (the event's message, its level - INFO the first time, DEBUG after)."""
        first = self.gave_up is None
        self.gave_up = self.gave_up or why
        message = (f"standbys do not run this script ahead (--standby-prerun): {why}; a standby that becomes a "
                   "rank runs the script from its top after the fault")
        return message, logging.INFO if first else logging.DEBUG


def capture_output() -> dict[int, int]:
    """Point stdout and stderr at memory files (what the script prints ahead reaches the rank's logs at its
    promotion, park.replay); {} where memfd_create is missing (the output is then lost)."""
    captured: dict[int, int] = {}
    for fd in (1, 2):
        try:
            mem = os.memfd_create(f"hyperpodrun-prerun-{fd}", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return captured
        os.dup2(mem, fd)
        captured[fd] = mem
    return captured


def run_ahead(spec: Mapping[str, Any], chan: socket.socket, await_rank: park.AwaitRank) -> None:
    """In a standby the zygote forked (agent/workers/zygote.py): run the script `spec["argv"]` as its rank would
    - in a session of its own, in `spec["cwd"]`, with the environment `spec["env"]` - up to its first HPWrapper
    call, where it parks until it becomes a rank (park.park). Returns in that rank once the script has ended;
    a script that cannot be run ahead ends this process (park.give_up)."""
    os.setsid()   # a session and process group of its own: what the script starts goes with it (killpg, reaper)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log_fd = os.dup(2)
    os.set_inheritable(log_fd, False)
    captured = capture_output()
    from hyperpodrun.agent.workers.script_entry import enter_script
    script = enter_script(spec)
    park.arm(park.Prerun(chan, await_rank, dict(spec["env"]), os.getcwd(), captured, log_fd=log_fd))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if park.promoted():
            raise
        park.give_up(f"the script exited (code {exc.code!r}) before calling an HPWrapper function")
    except BaseException as exc:
        if park.promoted():
            raise
        park.give_up(f"the script raised {type(exc).__name__}: {str(exc)[:200]} before calling an HPWrapper "
                     "function", "".join(traceback.format_exception(exc)))
    if not park.promoted():
        park.give_up("the script ended without calling an HPWrapper function")


__all__ = ["MODES", "PrerunState", "ahead_env", "capture_output", "mismatch", "run_ahead"]
