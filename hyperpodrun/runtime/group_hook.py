"""The roll call at torch's level: `torch.distributed.init_process_group` itself holds it (roll_call.py).

Why at torch's level and not only in HPWrapper: frameworks (Lightning, Hugging Face Trainer) and plain
scripts call torch's `init_process_group` directly, and a rank that never calls ours must still refuse an
outsider. The agent puts a `sitecustomize` on its workers' PYTHONPATH (hyperpodrun/_boot, env.py
`hand_down_hook`) that calls `install()` at interpreter start: it imports nothing heavy, it only arranges that
when `torch.distributed.distributed_c10d` has been executed its `init_process_group` is wrapped - before
`torch.distributed` copies the name into its own namespace, so `torch.distributed.init_process_group` and
`from torch.distributed import init_process_group` get the wrapper as well. HPWrapper calls `install()` too
(a worker started some other way).

When the roll call fails the process must not go on with the group: under HPWrapper (--inprocess-restart)
RollCallError propagates and HPWrapper fails the generation; otherwise the worker writes the message to its
error file and stderr and exits at once with EXIT_INTRUDER, which the agent retries without counting.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import time
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from hyperpodrun.errors import EXIT_INTRUDER, RollCallError

log = logging.getLogger("hyperpodrun.runtime")

C10D = "torch.distributed.distributed_c10d"
_MARK = "__hyperpodrun_roll_call__"


def _enabled() -> bool:
    from hyperpodrun.launch import settings
    return bool(settings.current().roll_call)


def _fail(exc: RollCallError) -> None:
    """Outside HPWrapper: say why and leave now - no user code may run with an outsider in the group."""
    from hyperpodrun import env as E
    ctx = E.worker_context()
    if ctx.under_inprocess_restart or not ctx.launched:
        log.error("hyperpodrun: %s", exc)
        raise exc
    message = f"hyperpodrun: {exc}; this generation fails and the agent retries it on a fresh store"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({"message": {"message": f"RollCallError: {exc}", "extraInfo": {
                    "py_callstack": f"RollCallError: {exc}", "timestamp": str(int(time.time()))}}}, fh)
        except OSError:
            pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_INTRUDER)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """`init_process_group` followed by the roll call in the group it formed."""
    if getattr(original, _MARK, False):
        return original

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        from hyperpodrun.runtime import roll_call
        try:
            result = original(*args, **kwargs)
        except Exception as exc:   # junk in the rendezvous keys: say who, not "fix your script"
            outsider = roll_call.outside_cause(exc) if _enabled() else None
            if outsider is None:
                raise
            _fail(outsider)
            raise outsider from exc
        if _enabled():
            try:
                took = roll_call.call()
            except RollCallError as exc:
                _fail(exc)
                raise
            if took is not None:
                log.debug("roll call passed in %.6fs", took)
        return result

    setattr(init_process_group, _MARK, True)
    return init_process_group


def patch(c10d: ModuleType) -> None:
    """Wrap `init_process_group` in torch's c10d module (and in torch.distributed, if it has the name yet)."""
    c10d.init_process_group = wrap(c10d.init_process_group)   # type: ignore[attr-defined]
    parent = sys.modules.get("torch.distributed")
    if parent is not None and hasattr(parent, "init_process_group"):
        setattr(parent, "init_process_group", getattr(c10d, "init_process_group"))


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it executed."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        try:
            patch(module)
        except Exception as exc:   # never break the user's import of torch
            log.warning("hyperpodrun: could not arrange the roll call (%s); groups form without it", exc)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torch's c10d module through the other finders and hands it to _Loader."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != C10D:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Arrange the roll call in this process (idempotent): patch now when c10d is loaded, else when it is."""
    module = sys.modules.get(C10D)
    if module is not None:
        patch(module)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
