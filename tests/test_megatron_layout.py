"""megatron_layout(): the CheckpointManager's layout read from megatron-core's own process groups, in a real
8-rank job (hyperpodrun, gloo, CPU) for TP/PP/CP/instance layouts and both of Megatron's usual rank orders. Runs
where megatron-core (and its einops) is installed - megatron-core 0.17 and later need Python 3.12 - and is
skipped otherwise."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("einops")
pytest.importorskip("megatron.core.parallel_state")

HERE = os.path.dirname(os.path.abspath(__file__))
HYPERPODRUN = os.path.join(os.path.dirname(sys.executable), "hyperpodrun")
LAYOUTS = ["1,2,1,2,tp-cp-ep-dp-pp", "2,2,1,2,tp-cp-ep-dp-pp", "1,2,1,2,tp-cp-ep-pp-dp", "2,1,2,2,tp-cp-ep-dp-pp",
           "1,1,1,4,tp-cp-ep-dp-pp", "2,2,2,1,tp-cp-ep-dp-pp"]


@pytest.mark.slow
def test_the_layout_read_from_megatron_gives_megatrons_replicas(tmp_path):
    env = dict(os.environ, OUT_DIR=str(tmp_path), LAYOUTS=";".join(LAYOUTS))
    got = subprocess.run([HYPERPODRUN, "--nproc-per-node", "8", "--log-dir", str(tmp_path / "logs"),
                          os.path.join(HERE, "scripts", "megatron_layout_job.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-4000:]
    for rank in range(8):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == len(LAYOUTS) and all(line.startswith("ok ") for line in lines), (rank, lines)
    first = (tmp_path / "rank0.txt").read_text().splitlines()
    assert first[1] == "ok world=8 tp=2 pp=2 cp=1 instances=2 order=tp-cp-ep-dp-pp"
    assert first[2].endswith("order=tp-cp-pp-ep-dp")
