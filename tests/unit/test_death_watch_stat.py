"""The death watch's reading of /proc/<pid>/stat (agent/workers/death_watch.py): a failure is seen when the exit
begins (PF_EXITING and a non-zero status); a clean exit, a running task or a line it cannot read is not."""
from __future__ import annotations

import os
import signal

from hyperpodrun.agent.workers.death_watch import PF_EXITING, PF_POSTCOREDUMP, exit_code_of, exiting_status


def stat_line(comm: str, flags: int, status: int) -> bytes:
    # 52 fields: pid (comm) state, then 48 numbers with flags at field 9 and the exit status last
    rest = ["S", "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 42 + [str(status)]
    return f"4242 ({comm}) {' '.join(rest)}\n".encode()


def test_a_task_exiting_with_a_signal_or_a_code_is_seen():
    assert exiting_status(stat_line("python3", 0x400000 | PF_EXITING, signal.SIGKILL)) == signal.SIGKILL
    assert exiting_status(stat_line("python3", PF_EXITING, 3 << 8)) == 3 << 8
    # the first mark of do_exit (before PF_EXITING) on Linux >= 5.16, with PF_SIGNALED
    assert exiting_status(stat_line("python3", 0x400000 | PF_POSTCOREDUMP | 0x400, 14)) == 14


def test_a_running_task_or_a_clean_exit_is_not():
    assert exiting_status(stat_line("python3", 0x400000, signal.SIGKILL)) is None   # not exiting (yet)
    assert exiting_status(stat_line("python3", 0x400000 | PF_EXITING, 0)) is None   # exit 0: wait for the real end


def test_a_command_name_with_spaces_and_parentheses_is_skipped_whole():
    assert exiting_status(stat_line("a) 9 (b) S 1", PF_EXITING, signal.SIGSEGV | 0x80)) == signal.SIGSEGV | 0x80


def test_a_short_or_garbled_line_is_not_read_as_a_death():
    assert exiting_status(b"4242 (python3) S 1 1 1") is None
    assert exiting_status(b"no parenthesis here") is None
    assert exiting_status(stat_line("python3", PF_EXITING, 9).replace(b" 9\n", b" x\n")) is None


def test_statuses_become_popen_return_codes():
    assert exit_code_of(signal.SIGKILL) == -signal.SIGKILL
    assert exit_code_of(signal.SIGSEGV | 0x80) == -signal.SIGSEGV   # with a core dump
    assert exit_code_of(3 << 8) == 3


def test_this_process_reads_as_running():
    with open(f"/proc/{os.getpid()}/stat", "rb") as fh:
        assert exiting_status(fh.read()) is None
