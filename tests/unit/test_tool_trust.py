"""`hyperpodrun logs` and `hyperpodrun inject` read only our own trees and print no terminal escapes (issue 33,
item 6; hyperpodrun/trusted_read.py): the trust rule on real directories and files (another uid's, by
os.chown as root; symlinks; a FIFO, which must not hang the tool), and the escapes in event and log text."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from hyperpodrun import trusted_read as T
from hyperpodrun.agent.control.agent_info import AgentInfo
from hyperpodrun.tools import tools

OTHER = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid need root (os.chown); CI runs as root")
OSC = "\x1b]0;owned\x07\x1b[2J\x9b31m"     # set the title, clear the screen, a C1 CSI


def run_dir(base: Path, name: str = "run1") -> Path:
    path = base / name
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    (path / "node0.events.jsonl").write_text(json.dumps({"ts": 1.5, "event": "fault", "host": "h", "node": 0,
                                                         "msg": f"rank 1: RuntimeError: {OSC}"}) + "\n")
    rank = path / "attempt_0" / "rank_0"
    rank.mkdir(parents=True)
    (rank / "stdout.log").write_text(f"hello {OSC}world\n")
    return path


def tool(*args: str) -> "object":
    return CliRunner().invoke(tools, list(args), catch_exceptions=False)


# ------------------------------------------------------------------------------------------ escapes
def test_control_characters_are_shown_not_sent() -> None:
    shown = T.printable(f"a\tb {OSC}\nc\r\x7f")
    assert not any(0 <= ord(c) < 32 and c != "\t" or 0x7f <= ord(c) <= 0x9f for c in shown), shown
    assert shown.startswith("a\tb \\x1b]0;owned\\x07") and "\\x9b" in shown and "\\x0a" in shown
    assert T.printable("x\ny", keep_newlines=True) == "x\ny"


def test_event_and_log_text_is_printed_without_escapes(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    for args in (["logs", "--events", str(run)], ["logs", str(run)]):
        res = tool(*args)
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output and "\x07" not in res.output and "\x9b" not in res.output
        assert "\\x1b]0;owned\\x07" in res.output


# ------------------------------------------------------------------------------------------ the rule
def test_the_rule_on_directories(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    T.check_dir(str(ours), private=True)
    os.chmod(ours, 0o755)
    T.check_dir(str(ours))                                  # a run dir under --log-dir: readable is fine
    with pytest.raises(T.UnsafePathError, match="mode 0755"):
        T.check_dir(str(ours), private=True)                # the default base must be ours alone
    os.chmod(ours, 0o777)
    with pytest.raises(T.UnsafePathError, match="other users could put files"):
        T.check_dir(str(ours))
    (tmp_path / "link").symlink_to(ours)
    with pytest.raises(T.UnsafePathError, match="symlink"):
        T.check_dir(str(tmp_path / "link"))


def test_a_fifo_or_a_symlink_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(T.UnsafePathError, match="not a regular file"):
        T.open_file(str(fifo))                              # O_NONBLOCK: the open returns, no writer needed
    target = tmp_path / "real"
    target.write_text("x")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(T.UnsafePathError, match="symlink"):
        T.open_file(str(tmp_path / "link"))
    assert T.read_bytes(str(target)) == b"x"


def test_logs_skips_a_fifo_among_the_worker_logs(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    os.mkfifo(run / "attempt_0" / "rank_0" / "stderr.log")
    res = tool("logs", str(run))
    assert res.exit_code == 0 and "hello" in res.output and "not a regular file" in res.output


def test_inject_does_not_follow_a_symlinked_agent_file(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    planted = tmp_path / "elsewhere.json"
    planted.write_text(AgentInfo(control="ipc:///tmp/theirs", pid=4242, host="h", node_rank=0, rank_offset=0,
                                 nproc_per_node=1).model_dump_json())
    (run / "node0.agent.json").symlink_to(planted)
    res = tool("inject", str(run), "--rank", "0", "--kind", "kill", "--timeout", "0.1")
    assert res.exit_code == 2 and "symlink" in res.output and "no running agent" in res.output, res.output


@needs_root
def test_files_and_run_dirs_of_another_user_are_not_read(tmp_path: Path) -> None:
    run = run_dir(tmp_path)
    info = run / "node0.agent.json"
    info.write_text(AgentInfo(control="ipc:///tmp/theirs", pid=4242, host="h", node_rank=0, rank_offset=0,
                              nproc_per_node=1).model_dump_json())
    os.chown(info, OTHER, OTHER)
    with pytest.raises(T.UnsafePathError, match="uid 65534"):
        AgentInfo.read(str(info))
    res = tool("inject", str(run), "--rank", "0", "--kind", "kill", "--timeout", "0.1")
    assert res.exit_code == 2 and "no running agent" in res.output, res.output
    theirs = run_dir(tmp_path, "run2")
    os.chown(theirs, OTHER, OTHER)
    res = tool("logs", str(theirs))                          # named directly: refused, one line, exit 2
    assert res.exit_code == 2 and "belongs to uid 65534" in res.output, res.output
    os.chown(run, OTHER, OTHER)
    res = tool("logs", str(tmp_path))                         # the newest run of ours: none left
    assert res.exit_code == 2 and "2 run(s) there are not this user's" in res.output, res.output


@needs_root
def test_a_default_log_base_another_user_created_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe of issue 33: with a fresh /tmp, another user's hyperpodrun-logs-<uid> with a planted
    node0.agent.json pointed root's `inject` at their endpoint."""
    for name in ("HYPERPODRUN_LOG_DIR", "PET_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = tmp_path / f"hyperpodrun-logs-{os.getuid()}"
    base.mkdir(mode=0o700)
    run = run_dir(base)
    (run / "node0.agent.json").write_text(AgentInfo(control="ipc:///tmp/theirs", pid=4242, host="h", node_rank=0,
                                                    rank_offset=0, nproc_per_node=1).model_dump_json())
    assert tool("logs", "--events").exit_code == 0             # ours: read
    os.chown(base, OTHER, OTHER)
    for args in (["inject", "--rank", "0", "--kind", "kill"], ["logs"]):
        res = tool(*args)
        assert res.exit_code == 2 and "belongs to uid 65534" in res.output and "4242" not in res.output, res.output
