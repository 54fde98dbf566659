"""The TCP sockets a process holds, read from /proc (its fds' socket inodes, matched in its network namespace's
tcp and tcp6 tables): what the loopback and network-security tests check a job's processes listen on. Imported
by the tests and by the worker scripts they run (the tests directory is put on their sys.path)."""
from __future__ import annotations

import os
import socket

LISTEN = "0A"   # the state /proc/net/tcp prints for a listening socket


def tcp_sockets(pid: object = "self") -> list[dict]:
    """{"state", "addr", "port"} of every TCP socket process `pid` holds ("self": the caller)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                lines = list(fh)[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            hexaddr, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # host-order 32-bit words
            found.append({"state": fields[3], "addr": socket.inet_ntop(family, raw), "port": int(hexport, 16)})
    return found
