"""The state-tier benchmark (scripts/bench/state_tier.py) in its tiny CPU form, so that it cannot rot before the
GPU run it exists for: two ways of writing the script (no CheckpointManager; model and optimizer built inside
the function), an exception twice, 2 ranks on gloo. It checks what the benchmark reports - every fault's
fault -> first completed step, the steps retrained, what restore() did on every rank, a steady step - and
that the NVRx row is there (run, or skipped with the reason). No speed is asserted: the figures are for the
GPU machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "state_tier.py"
SOURCES = {"live", "shm", "replica", "peer", "disk"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tiny_state_tier_benchmark_reports_every_fault_and_restore(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(BENCH), "--size", "tiny", "--model", "mlp", "--rows",
                          "none,inside,nvrx", "--kinds", "raise", "--faults", "2", "--nproc", "2",
                          "--job-timeout", "90", "--out", str(out)],
                         capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((out / "summary.json").read_text())
    assert data["meta"]["nproc"] == 2 and data["meta"]["machine"].get("torch")
    jobs = {(j["row"], j["kind"]): j for j in data["models"]["mlp"]["jobs"]}
    for row in ("none", "inside"):
        job = jobs[(row, "raise")]
        assert job["ok"] and job["exit_code"] == 0, job
        assert len(job["faults"]) == 2, job["faults"]
        for fault in job["faults"]:
            assert fault["fault_to_first_s"] > 0 and fault["to_state_s"] is not None, fault
            assert fault["retrained"] is not None and fault["retrained"] >= 0, fault
        assert job["fault_to_first_s"]["n"] == 2 and job["fault_to_first_s"]["median"] > 0
        assert job["steady_step_s"] and job["steady_step_s"] > 0 and job["steady_n"] > 0
        assert (out / "jobs" / f"mlp-{row}-raise" / "records" / "rank0.jsonl").exists()
    inside = jobs[("inside", "raise")]
    # every rank's restore() after each fault is recorded, with where the state came from and its phases
    assert sum(inside["restored_from"].values()) == 2 * 2, inside["restored_from"]
    assert set(inside["restored_from"]) <= SOURCES, inside["restored_from"]
    assert all(len(f["restore_phases"]) == 2 for f in inside["faults"]), inside["faults"]
    assert inside["restore_s"]["median"] is not None
    assert inside["steady_vs_none"] and inside["steady_vs_none"] > 0
    nvrx = jobs[("nvrx", "raise")]
    assert nvrx.get("ok") or "nvidia-resiliency-ext" in nvrx.get("skipped", ""), nvrx
    table = (out / "table.md").read_text()
    assert "| none: `HPWrapper` only" in table and "| inside: `CheckpointManager()`" in table, table
    assert "fault -> first step" in table and "Command: `python scripts/bench/state_tier.py" in table
