"""Helpers shared by the benchmark scripts (run them from anywhere; this directory is on sys.path then)."""
from __future__ import annotations

import os
import shutil
import sys


def find_launcher(name: str) -> str:
    """The launcher next to this Python (the venv's bin/), else on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(cand):
        return cand
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found next to {sys.executable} nor on PATH")
    return found
