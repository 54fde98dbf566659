"""HPWrapper freezes what exists at its first call (hyperpodrun.runtime.torch_state.freeze_before_training), so
the restart path's garbage collection scans only what training made since; cycles made later are still
collected, and HYPERPODRUN_GC_FREEZE=0 turns it off. Each case runs in a fresh interpreter (freezing is per
process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import gc, json, weakref
import torch
from hyperpodrun.runtime.torch_state import freeze_before_training
class Node:
    pass
before = Node(); before.self = before
freeze_before_training()
frozen = gc.get_freeze_count()
freeze_before_training()                       # once per process
again = gc.get_freeze_count()
after = Node(); after.self = after             # a cycle made by training, after the freeze
ref = weakref.ref(after)
del after
gc.collect()
print(json.dumps({"frozen": frozen, "again": again, "cycle_after_collected": ref() is None,
                  "tracked_after": len(gc.get_objects())}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_exists_at_the_first_call_is_frozen_once_and_later_cycles_are_still_collected():
    got = probe()
    assert got["frozen"] > 10000, got            # torch's objects are out of the collector's view
    assert got["again"] == got["frozen"], got     # a second call freezes nothing more
    assert got["cycle_after_collected"], got
    assert got["tracked_after"] < got["frozen"] / 10, got   # what a full collection still scans


@pytest.mark.parametrize("value", ["0", "off"])
def test_hyperpodrun_gc_freeze_0_turns_it_off(value):
    got = probe(HYPERPODRUN_GC_FREEZE=value)
    assert got["frozen"] == 0, got
    assert got["cycle_after_collected"], got
