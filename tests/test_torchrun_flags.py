"""torchrun options that hyperpodrun took over from refusing (issue 34), through real launches: the console
prefix of --log-line-prefix-template (also torchrun 2.13's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, compared
with torchrun itself) and the files of --duplicate-stdout/stderr-filters."""
from __future__ import annotations

import socket

from conftest import TORCHRUN, the_run_dir

HELLO = "import os\nprint('hello', os.environ['RANK'], flush=True)\n"


def _lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if "hello" in line}


def test_the_prefix_template_renders_torchruns_macros(launcher, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    template = "${hostname}|${role_name}|${rank}|${local_rank}|${other}: "
    res = launcher.run(["--nproc-per-node", "2", "--role", "trainer", "--log_line_prefix_template", template,
                        script], timeout=60)
    assert res.rc == 0, res
    host = socket.gethostname()
    assert _lines(res.out) == {f"{host}|trainer|{r}|{r}|${{other}}: hello {r}" for r in (0, 1)}, res.out
    # the log files keep the lines as written
    logs = sorted(launcher.log_dir.rglob("stdout.log"))
    assert [p.read_text() for p in logs] == ["hello 0\n", "hello 1\n"], logs


def test_the_prefix_template_of_the_environment_is_torchruns(launcher, tmp_path):
    """torchrun 2.13 reads the template from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (its macros without
    ${hostname}) and puts it before the lines it tees: the same lines here."""
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}:${rank}:${local_rank}> "}
    args = ["--nproc-per-node", "2", "--tee", "3", script]
    ours, theirs = launcher.start(args, env=env), launcher.start(args, env=env, cmd=[TORCHRUN])
    res_ours, res_theirs = ours.wait(60), theirs.wait(60)
    assert res_ours.rc == 0, res_ours
    assert res_theirs.rc == 0, res_theirs
    assert _lines(res_ours.out) == _lines(res_theirs.out) == {f"<default:{r}:{r}> hello {r}" for r in (0, 1)}, \
        (res_ours.out, res_theirs.out)


def test_duplicate_filters_copy_the_matching_lines_into_the_attempt_directory(launcher, tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text("import os, sys\nr = os.environ['RANK']\nprint('loss', r, flush=True)\nprint('noise', r)\n"
                      "print('NaN,inf', r, file=sys.stderr)\n")
    res = launcher.run(["--nproc-per-node", "2", "--duplicate-stdout-filters", "loss",
                        "--duplicate_stderr_filters", "NaN,,inf", script], timeout=60)
    assert res.rc == 0, res
    attempt = the_run_dir(launcher.log_dir) / "attempt_0"
    host = socket.gethostname()
    assert sorted((attempt / "filtered_stdout.log").read_text().splitlines()) == \
        [f"[{host}:{r}]: loss {r}" for r in (0, 1)]
    assert sorted((attempt / "filtered_stderr.log").read_text().splitlines()) == \
        [f"[{host}:{r}]: NaN,inf {r}" for r in (0, 1)]
