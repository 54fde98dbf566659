"""The event log on a log filesystem that fills up and gets its space back (found by scripts/bench/soak.py): a
record cut short by the full filesystem is lost, and only that one - the next record starts on a line of its
own once there is space again, instead of being glued to the torn one (and lost with it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hyperpodrun.agent.observe.events import JsonlSink


@pytest.fixture
def small_fs(tmp_path: Path):
    """A tmpfs of two pages (needs root, as CI has)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    where = tmp_path / "fs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_record_after_a_torn_one_is_kept(small_fs: Path) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * 4096)               # one of the two pages
    sink = JsonlSink(str(small_fs / "node0.events.jsonl"))
    sink.write({"event": "first", "ts": 1.0, "msg": "x" * 100}, 20, "")
    sink.write({"event": "torn", "ts": 2.0, "msg": "y" * 8000}, 20, "")     # runs out of space midway
    sink.write({"event": "dropped", "ts": 3.0}, 20, "")                      # no space at all: dropped
    filler.unlink()                                                         # the space comes back
    sink.write({"event": "after", "ts": 4.0}, 20, "")
    sink.close()
    lines = (small_fs / "node0.events.jsonl").read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line)["event"])
        except ValueError:
            parsed.append("?")
    assert parsed == ["first", "?", "after"], lines
