"""Standby pre-run, the worker's side: the park point at a script's first HPWrapper call (--standby-prerun).

Why: a standby (agent/workers/standby.py) that takes over a SIGKILLed rank has torch imported and its CUDA context
made, but it still ran the script from its first line after the fault: the framework's imports, a model built at
the script's top, a data module - seconds of a 0.6 B model's construction on the recovery's critical path. A
standby of `--standby-prerun auto` runs the script ahead instead, the way the rank it will become would
(agent/workers/prerun.py starts it), until the script first calls an HPWrapper function, and parks there: in
the call, before the function runs and before anything of the rank's (no process group, no store, no control
session). When a rank of its local rank slot dies, it is promoted: it takes the rank's environment and log
descriptors and goes on into the function as a replacement rank does (READY, GO, the restore from its peers).

What keeps it correct (docs/inprocess-restart.md, "Standby pre-run"):
- Until promotion it has no rank: the variables of env.RANK_BOUND_VARS are absent and watched. A script - or a
  library it calls - that reads or sets one of them before its HPWrapper function, or calls
  `init_process_group` there, computes something of one rank's at its top; the standby gives up (`give_up`:
  it tells the agent why, one `standby_prerun` event, and exits) and the job's standbys wait before the script
  from then on, as without pre-run. A script that ends, raises or exits before the call, or makes its first
  call from a thread other than the main one, gives up the same way.
- What the script printed before the park is kept (in memory files) and written to the rank's logs at the
  promotion, ahead of what it prints as the rank.
- The random state the function is entered with is the one the script left at the park (the standby's warm-up
  while it waits draws from no default generator, and the state is put back anyway).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional

from hyperpodrun.env import RANK_BOUND_VARS

log = logging.getLogger("hyperpodrun.runtime")

#: at most this much of what the script wrote to each of stdout and stderr before the park reaches the rank's log
REPLAY_BYTES = 1 << 20
#: our wrapper of init_process_group (installed once per process, left in place: a name the script bound to it
#: during the pre-run keeps working after the promotion)
_MARK = "__hyperpodrun_prerun__"

#: what the standby waits with at the park: reports itself ready (the dict is added to its report) and returns
#: the rank it becomes - (the SpawnRequest's argv, env and cwd, its stdout and stderr descriptors) - or None when
#: it is not needed any more (agent/workers/zygote.py, `await_rank`)
AwaitRank = Callable[[dict[str, Any]], Optional[tuple[dict[str, Any], list[int]]]]


@dataclass
class Prerun:
    """This process's pre-run: set by `arm` before the script starts."""

    chan: socket.socket                  # the standby's socket to the agent
    await_rank: AwaitRank
    env: dict[str, str]                  # the environment the agent gave it (before the script's own changes)
    cwd: str
    captured: dict[int, int]             # 1, 2 -> the memory file that holds what the script wrote there
    log_fd: Optional[int] = None         # where its own lines go before the promotion (the warm spawner's log)
    t0: float = field(default_factory=time.monotonic)
    state: str = "running"               # running -> parked -> promoted (or it gave up and is gone)


_current: Optional[Prerun] = None


def prerunning() -> bool:
    """Whether this process is a standby running the script ahead, not parked yet (cheap: HPWrapper asks it at
    every call)."""
    return _current is not None and _current.state == "running"


def promoted() -> bool:
    """Whether this process was a pre-run standby that became a rank."""
    return _current is not None and _current.state == "promoted"


def arm(prerun: Prerun) -> None:
    """Make this process a pre-run standby: from now until the park, the rank's variables are watched and
    `init_process_group` gives up (called by agent/workers/prerun.py just before the script runs)."""
    global _current
    _current = prerun
    _hook_init_process_group()
    _watch()


def give_up(why: str, detail: str = "") -> NoReturn:
    """The script cannot be run ahead: tell the agent `why` (it says so once and starts standbys that wait
    before the script), write `detail` (a traceback) to the warm spawner's log, and exit."""
    p = _current
    if p is not None:
        p.state = "gave_up"
        try:
            p.chan.send(json.dumps({"prerun_gave_up": why}).encode())
        except OSError:
            pass
        if p.log_fd is not None:
            try:
                os.write(p.log_fd, f"hyperpodrun standby {os.getpid()}: not running the script ahead: {why}\n"
                         f"{detail}".encode(errors="replace"))
            except OSError:
                pass
    os._exit(0)


def park(function: str) -> None:
    """HPWrapper's call of `function`: in a pre-run standby, wait here for the rank to become and take it;
    anywhere else (a rank, a standby promoted already) return at once."""
    p = _current
    if p is None or p.state != "running":
        return
    if threading.current_thread() is not threading.main_thread():
        give_up(f"its HPWrapper function {function} was first called from the thread {threading.current_thread().name}")
    p.state = "parked"
    _unwatch()
    from hyperpodrun.state.state_dicts import rng_state, set_rng_state
    rng = rng_state()
    took = round(time.monotonic() - p.t0, 3)
    got = p.await_rank({"prerun": {"function": function, "prerun_s": took}})
    if got is None:          # not needed any more: the job ended, or the agent is gone
        os._exit(0)
    task, fds = got
    _promote(p, task, fds)
    set_rng_state(rng)
    log.debug("rank %s: a standby that ran the script ahead to %s (%.2fs)", os.environ.get("RANK"), function, took)


def _promote(p: Prerun, task: dict[str, Any], fds: list[int]) -> None:
    """Become the rank of `task`: its log descriptors (after what the script wrote ahead), the variables that name
    the rank, whatever else of its environment differs from the one the script ran with, its directory."""
    p.state = "promoted"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    for target, fd in zip((1, 2), fds):
        mem = p.captured.pop(target, None)
        if mem is not None:
            replay(mem, fd)
            os.close(mem)
        os.dup2(fd, target)
        os.close(fd)
    if p.log_fd is not None:
        os.close(p.log_fd)
        p.log_fd = None
    env: dict[str, str] = task["env"]
    for name in RANK_BOUND_VARS:
        if name in env:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)
    for name, value in env.items():     # the agent serves a standby only where these agree; the script's own
        if p.env.get(name) != value:    # changes to its environment stay, as in a rank that ran its top
            os.environ[name] = value
    if task.get("cwd") and task["cwd"] != p.cwd:
        os.chdir(task["cwd"])


def replay(mem: int, fd: int, limit: int = REPLAY_BYTES) -> int:
    """Write what memory file `mem` holds (at most `limit` bytes, then one line saying how much more there was)
    to `fd`; returns the bytes written. A descriptor that fails ends the replay, never the rank."""
    size = os.fstat(mem).st_size
    os.lseek(mem, 0, os.SEEK_SET)
    data = b""
    while len(data) < min(size, limit):
        chunk = os.read(mem, min(size, limit) - len(data))
        if not chunk:
            break
        data += chunk
    if size > limit:
        data += f"[hyperpodrun: {size - limit} more bytes that the script wrote before its HPWrapper function " \
                "are not shown]\n".encode()
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    return len(data) - len(view)


# ------------------------------------------------------------------------------------------ the watch
class _Watched(os._Environ):
    """os.environ (and os.environb) while the script runs ahead: a look at a rank's variable gives up."""

    def __getitem__(self, key: Any) -> Any:
        _touched(key, "read")
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _touched(key, "set")
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        _touched(key, "removed")
        super().__delitem__(key)


def _environs() -> list[Any]:
    return [e for e in (os.environ, getattr(os, "environb", None)) if e is not None]


def _watch() -> None:
    for env in _environs():
        if type(env) is os._Environ:
            setattr(env, "__class__", _Watched)


def _unwatch() -> None:
    for env in _environs():
        if type(env) is _Watched:
            setattr(env, "__class__", os._Environ)


def _touched(key: Any, verb: str) -> None:
    name = key.decode(errors="replace") if isinstance(key, bytes) else key
    if name in RANK_BOUND_VARS and prerunning():
        give_up(f"it {verb} {name} before its HPWrapper function (at {where()})")


def where() -> str:
    """file:line of the first caller outside this module, os and the mapping machinery (what touched a rank's
    variable) and, where that is a library's line, the script's line that led there."""
    skip = (__file__, os.__file__)
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    found: Optional[str] = None
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if found is None and name not in skip and not name.endswith(("_collections_abc.py", "<frozen os>",
                                                                     "<frozen _collections_abc>")):
            found = f"{name}:{frame.f_lineno}"
            if script is None or os.path.abspath(name) == script:
                return found
        elif found is not None and os.path.abspath(name) == script:
            return f"{found}, from {name}:{frame.f_lineno}"
        frame = frame.f_back
    return found or "?"


def _hook_init_process_group() -> None:
    """init_process_group before the park gives up (torch's env:// would read the watched variables anyway; an
    explicit store and rank would not). Wraps what is there - the roll call's wrapper, whose mark it keeps."""
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return
    original = c10d.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if prerunning():
            give_up(f"it called init_process_group before its HPWrapper function (at {where()})")
        return original(*args, **kwargs)
    setattr(init_process_group, _MARK, True)
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


__all__ = ["AwaitRank", "Prerun", "arm", "give_up", "park", "prerunning", "promoted", "replay", "where"]
