"""The one GPU benchmark entry (scripts/bench/gpu.sh) without a GPU: `list` names every sequence, and a dry run
(DRY_RUN=1) of each prints the commands it would run - the benchmark scripts it names exist - and runs nothing.
No GPU, no torch import, a few seconds."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_SH = ROOT / "scripts" / "bench" / "gpu.sh"
SEQUENCES = ["smoke", "recovery", "recovery-all", "recovery-fast", "standby-warm", "state-tier", "checkpointless",
             "inprocess", "health", "frameworks", "lightning", "numa", "restart-noise"]


def _gpu_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_SH), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=str(ROOT))


def test_list_names_every_sequence_with_a_purpose():
    out = _gpu_sh("list")
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0]: line.split(None, 1)[1] for line in out.stdout.splitlines() if line.strip()}
    assert sorted(listed) == sorted(SEQUENCES)
    assert _gpu_sh("--help").returncode == 0
    unknown = _gpu_sh("no-such-sequence")
    assert unknown.returncode == 2 and "state-tier" in unknown.stderr


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_dry_run_prints_the_commands_and_runs_nothing(sequence, tmp_path):
    out_dir = tmp_path / "out"
    work = tmp_path / "work"
    res = _gpu_sh(sequence, DRY_RUN="1", OUT=str(out_dir), BENCH_DIR=str(work))
    assert res.returncode == 0, res.stdout + res.stderr
    commands = [line[2:] for line in res.stdout.splitlines() if line.startswith("+ ")]
    assert commands[0].startswith("source scripts/bench/gpu_env.sh") or "--stages " + sequence in commands[1]
    assert any(c.startswith(("python3 ", "timeout ", "hyperpodrun ", "env ")) for c in commands), commands
    for script in set(re.findall(r"(?:scripts/bench|examples)/[\w/]+\.(?:py|sh)", res.stdout)):
        assert (ROOT / script).is_file(), script
    assert not out_dir.exists() and not work.exists()


def test_default_results_folder_is_named_by_date_commit_and_sequence():
    res = _gpu_sh("health", DRY_RUN="1", OUT="")
    folder = re.search(r"results in (\S+)", res.stdout).group(1)
    assert re.fullmatch(r"scripts/bench/results/\d{4}-\d\d-\d\d-(?:[0-9a-f]{4,}|nogit)-health", folder), folder
