"""The failure report: host, rank, exit code or signal, and the worker's traceback from its error file."""
from __future__ import annotations

import json
import os
from typing import Any, Optional


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


def failure_summary(info: dict[str, Any], with_traceback: bool = False) -> str:
    """`rank 3 (local rank 3) on host h failed: exit code 7` (+ traceback)."""
    text = (f"rank {info.get('rank')} (local rank {info.get('local_rank')}, pid {info.get('pid')}) on host "
            f"{info.get('host')} failed: {info.get('cause')}")
    if with_traceback:
        trace = read_error_file(info.get("error_file"))
        if trace:
            text += "\n  worker traceback (from its error file):\n" + "\n".join(
                "    " + line for line in trace.rstrip().splitlines())
    return text
