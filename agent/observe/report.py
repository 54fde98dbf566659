"""The failure report: host, rank, exit code or signal, and the worker's traceback from its error file."""
from __future__ import annotations

import json
import os
import signal
from typing import Optional

from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.symptoms import looks_secondary


def read_error_file(path: Optional[str]) -> Optional[str]:
    """The traceback torch's `@record` wrote to TORCHELASTIC_ERROR_FILE, if any."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    msg = data.get("message", data)
    if isinstance(msg, dict):
        extra = msg.get("extraInfo", {}) or {}
        trace = extra.get("py_callstack") or msg.get("message")
        return str(trace) if trace else None
    return str(msg)


#: what libstdc++ prints when torch's gloo thread is ended while Python finalizes
TEARDOWN_ABORT_MARK = "terminate called without an active exception"


def teardown_abort_hint(exit_code: Optional[int], stderr_log: Optional[str]) -> Optional[str]:
    """What happened, when a rank died of SIGABRT with libstdc++'s "terminate called without an active
    exception" in its last stderr lines: torch's gloo worker thread dropped the last reference to a tensor
    after the interpreter had begun to exit (a torch race, the same under torchrun). None otherwise."""
    if exit_code not in (134, -signal.SIGABRT) or not stderr_log:
        return None
    text = exit_text(stderr_log, None)
    if not text or TEARDOWN_ABORT_MARK not in text:
        return None
    return ("it aborted in interpreter teardown (\"terminate called without an active exception\"): torch's "
            "gloo worker thread released a tensor while Python was exiting, a torch race that also happens "
            "under torchrun (its training may have finished). Workaround: before destroy_process_group(), drop "
            "the DDP model, the last works and their tensors and call gc.collect() (examples/train_demo.py "
            "does); under --inprocess-restart with HPWrapper such an abort after completion is not a failure")


def failure_summary(info: FailureInfo, with_traceback: bool = False) -> str:
    """`rank 3 (local rank 3) on host h failed: exit code 7` (+ what a teardown abort is, + traceback)."""
    text = (f"rank {info.rank} (local rank {info.local_rank}, pid {info.pid}) on host "
            f"{info.host} failed: {info.cause}")
    hint = teardown_abort_hint(info.exit_code, info.stderr_log)
    if hint:
        text += f"; {hint}"
    if with_traceback:
        trace = read_error_file(info.error_file)
        if trace:
            text += "\n  worker traceback (from its error file):\n" + "\n".join(
                "    " + line for line in trace.rstrip().splitlines())
    return text


#: bytes of a dead rank's stderr log read to tell a symptom from a real failure (its last lines)
TAIL_BYTES = 4096


def exit_text(stderr_path: Optional[str], error_file: Optional[str]) -> Optional[str]:
    """The last lines a dead rank wrote to its stderr log plus its error file's message; None when neither
    is kept (its stderr went straight to the console)."""
    parts = []
    if stderr_path:
        try:
            with open(stderr_path, "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - TAIL_BYTES))
                parts.append(fh.read().decode(errors="replace"))
        except OSError:
            pass
    trace = read_error_file(error_file)
    if trace:
        parts.append(trace[-TAIL_BYTES:])
    return "\n".join(parts) if parts else None


def exit_is_symptom(code: int, text: Optional[str]) -> bool:
    """Whether a failed exit is most likely the consequence of another rank's failure: its last stderr lines
    (or error file) show a peer-failure symptom (hyperpodrun/symptoms.py). Without any text, an abort
    (SIGABRT: what torch's teardown does after a broken collective) counts as one."""
    if text is not None and text.strip():
        return looks_secondary(text)
    return code == -signal.SIGABRT


class CauseWindow:
    """Picks the cause of a process-level fault among the ranks that failed close together.

    Why: when one rank exits, its peers' collectives break and they may exit or abort before the failing
    rank's own exit is seen (its interpreter is still tearing down). A failure that looks like a symptom
    opens a window of `grace_s`; the first failure in it that is not a symptom is the cause (it ends the
    window at once), else the first symptom when the window closes."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.deadline: Optional[float] = None
        self._seen: list[FailureInfo] = []

    @property
    def open(self) -> bool:
        return self.deadline is not None

    def add(self, info: FailureInfo, now: float) -> Optional[FailureInfo]:
        """A failed exit: returns the cause to act on now, or None to wait for a better one."""
        self._seen.append(info)
        if not info.symptom or self.grace_s <= 0:
            return self.take()
        if self.deadline is None:
            self.deadline = now + self.grace_s
        return None

    def due(self, now: float) -> Optional[FailureInfo]:
        """The cause once the window has closed without a real failure; None while it is open."""
        if self.deadline is None or now < self.deadline:
            return None
        return self.take()

    def take(self) -> Optional[FailureInfo]:
        """The cause among the failures seen (a real one first, else the first), with the others folded in."""
        if not self._seen:
            return None
        real = [i for i in self._seen if not i.symptom]
        cause = (real or self._seen)[0]
        others = [i for i in self._seen if i.rank != cause.rank]
        if others:
            cause = cause.with_(folded=tuple(f"rank {i.rank} {i.cause}" for i in others))
        self.clear()
        return cause

    def clear(self) -> None:
        self.deadline = None
        self._seen = []
