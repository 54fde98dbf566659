"""A usage error of the worker API in the user's script (an out-of-range CacheResumeMMAPConfig, a bad
CheckpointManager.save step) ends the job as a bad flag does: exit 2, one line per worker naming the problem,
no traceback - at module level and inside HPWrapper, with and without --inprocess-restart; other exceptions
keep their traceback."""
from __future__ import annotations

import subprocess

import pytest

from conftest import HYPERPODRUN, write_script

MODULE_LEVEL = """
from hyperpodrun import CacheResumeMMAPConfig
cfg = CacheResumeMMAPConfig(prefetch_length=10**12)
"""

IN_WRAPPER = """
import torch.distributed as dist
from hyperpodrun import CheckpointManager, HPWrapper
cm = CheckpointManager()

@HPWrapper(checkpoint_manager=cm)
def main(caller=None):
    dist.init_process_group("gloo")
    cm.save(-1, {})

main()
"""


def run(tmp_path, body: str, *flags: str) -> subprocess.CompletedProcess:
    path = write_script(tmp_path, "train.py", body)
    return subprocess.run([HYPERPODRUN, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), *flags,
                           str(path)], capture_output=True, text=True, timeout=180)


def worker_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("[") and "]: " in ln and "pynvml" not in ln
            and not ln.startswith("[hyperpodrun ")]


@pytest.mark.parametrize("flags", [(), ("--inprocess-restart",)], ids=["process", "inprocess"])
def test_an_uncaught_usage_error_at_module_level_is_one_line_and_exit_2(tmp_path, flags):
    res = run(tmp_path, MODULE_LEVEL, *flags)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = worker_lines(res.stderr)
    assert lines and all("hyperpodrun: MMAPConfigError: CacheResumeMMAPConfig(prefetch_length=1000000000000): "
                         "must be <= 4096" in ln for ln in lines), res.stderr[-3000:]


def test_a_usage_error_inside_hpwrapper_is_not_retried_and_is_one_line(tmp_path):
    res = run(tmp_path, IN_WRAPPER, "--inprocess-restart")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "in-process restart" not in res.stderr, res.stderr[-3000:]     # deterministic: not retried
    lines = worker_lines(res.stderr)
    assert lines and all("hyperpodrun: ApiValueError: CheckpointManager.save(step=-1)" in ln for ln in lines), \
        res.stderr[-3000:]


def test_other_exceptions_keep_their_traceback(tmp_path):
    res = run(tmp_path, "raise RuntimeError('boom from the script')\n")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" in res.stderr and "RuntimeError: boom from the script" in res.stderr, res.stderr[-3000:]
