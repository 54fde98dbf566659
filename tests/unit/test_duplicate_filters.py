"""--duplicate-stdout-filters / --duplicate-stderr-filters (torchrun's): teed console lines that contain one of
the filters are also copied, with their console prefix, to <run-dir>/attempt_<g>/filtered_stdout.log /
filtered_stderr.log (agent/workers/tee.py); `,,` is a comma inside a filter, as torchrun parses it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hyperpodrun.agent.workers.tee import Tee, worker_pipe
from hyperpodrun.launch.flag_syntax import parse_filters
from test_config import _config, script  # noqa: F401  (script: the fixture)


def test_filters_are_parsed_as_torchrun_parses_them() -> None:
    assert parse_filters("apple,orange") == ["apple", "orange"]
    assert parse_filters("a,,b,c") == ["a,b", "c"]
    assert parse_filters("loss") == ["loss"]


@pytest.mark.parametrize("spelling", ["-", "_"])
def test_both_spellings_set_the_filters(script: str, tmp_path: Path, spelling: str) -> None:  # noqa: F811
    out_flag, err_flag = (f"--duplicate{spelling}std{s}{spelling}filters" for s in ("out", "err"))
    cfg = _config(["--log-dir", str(tmp_path), out_flag, "loss,,acc,step", err_flag, "NaN", script])
    assert (cfg.duplicate_stdout_filters, cfg.duplicate_stderr_filters) == (["loss,acc", "step"], ["NaN"])
    plain = _config(["--log-dir", str(tmp_path), script])
    assert (plain.duplicate_stdout_filters, plain.duplicate_stderr_filters) == ([], [])


def test_matching_console_lines_are_copied_with_their_prefix(tmp_path: Path) -> None:
    dup = tmp_path / "filtered_stdout.log"
    console_r, console_w = os.pipe()
    tee = Tee()
    keys = []
    for rank in (0, 1):
        r, w = worker_pipe()
        keys.append(tee.attach(r, str(tmp_path / f"rank{rank}.log"), console_w, f"[h:{rank}]: ",
                               (str(dup), ["loss", "a,b"])))
        os.write(w, f"step 1 loss 0.{rank}\nnoise\nsaw a,b here\npartial loss".encode())
        os.close(w)
    for key in keys:
        tee.release(key)
    tee.close()
    os.close(console_w)
    lines = dup.read_text().splitlines()
    assert sorted(lines) == sorted(f"[h:{r}]: {text}" for r in (0, 1)
                                   for text in (f"step 1 loss 0.{r}", "saw a,b here", "partial loss"))
    assert (tmp_path / "rank0.log").read_text() == "step 1 loss 0.0\nnoise\nsaw a,b here\npartial loss"
    os.close(console_r)


def test_a_stream_not_on_the_console_is_not_copied(tmp_path: Path) -> None:
    """torchrun duplicates the teed streams only: a redirected one (file only) is not copied."""
    dup = tmp_path / "filtered_stderr.log"
    tee = Tee()
    r, w = worker_pipe()
    key = tee.attach(r, str(tmp_path / "rank0.log"), None, "[h:0]: ", (str(dup), ["x"]))
    os.write(w, b"x\n")
    os.close(w)
    tee.release(key)
    tee.close()
    assert not dup.exists()
