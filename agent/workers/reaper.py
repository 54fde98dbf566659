"""A tiny process bound to the agent that kills every worker session once the agent is gone.

Run as a separate script (no package imports, starts in milliseconds). The agent writes `add SID` /
`del SID` lines on our stdin as it starts and reaps workers. When stdin reaches EOF - the agent exited,
normally or by SIGKILL - every registered session is killed: the process group and any process whose
session id is the worker's (DataLoader workers, grandchildren that changed process group).
A parent-death signal alone is not enough: DataLoader workers poll for a dead parent only every 5 s.
"""
import os
import signal
import sys
import time


def session_members(sids: "set[int]") -> "list[int]":
    """PIDs of live processes whose session id is in `sids`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # fields after the command (which may hold spaces/parens): state ppid pgrp session ...
        rest = data[data.rfind(b")") + 2:].split()
        try:
            if int(rest[3]) in sids and rest[0] != b"Z":
                found.append(int(name))
        except (IndexError, ValueError):
            continue
    return found


def kill_sessions(sids: "set[int]", deadline_s: float = 5.0) -> None:
    """SIGKILL every process of the given sessions until none is left (or the deadline passes)."""
    end = time.monotonic() + deadline_s
    while True:
        for sid in sids:
            try:
                os.killpg(sid, signal.SIGKILL)
            except OSError:
                pass
        members = [p for p in session_members(sids) if p != os.getpid()]
        if not members or time.monotonic() > end:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    sids: "set[int]" = set()
    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        if parts[0] == "add":
            sids.add(int(parts[1]))
        elif parts[0] == "del":
            sids.discard(int(parts[1]))
    if sids:
        kill_sessions(sids)


if __name__ == "__main__":
    main()
