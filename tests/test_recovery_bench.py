"""The side-by-side recovery benchmark (scripts/bench/recovery.py) in its tiny form, so that it cannot rot: one
exception per system, 2 ranks; it writes the JSON, the markdown table and the timeline picture, with a row for
torchrun + checkpoints, hyperpodrun process-level and hyperpodrun in-process (and NVRx, or the reason it has none)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "recovery.py"


@pytest.mark.slow
def test_tiny_recovery_benchmark_writes_json_table_and_picture(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(BENCH), "--tiny", "--kinds", "raise", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "recovery.json").read_text())
    rows = {(r["system"], r["kind"]): r for r in data["results"]}
    for system in ("torchrun", "hpr-process", "hpr-inprocess"):
        r = rows[(system, "raise")]
        assert r["ok"] and len(r["faults"]) == 1 and r["faults"][0]["downtime_s"] > 0, r
    nvrx = rows[("nvrx", "raise")]
    assert nvrx.get("ok") or "nvidia-resiliency-ext" in nvrx.get("skipped", ""), nvrx
    assert data["meta"]["ckpt_every"] >= 1 and data["meta"]["save_s"] >= 0
    table = (out / "recovery.md").read_text()
    assert "| hpr-inprocess | raise | yes |" in table and "| torchrun | raise | yes |" in table, table
    assert (out / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
