"""Who is connected to our ports: the kernel's TCP tables (/proc/net/tcp, /proc/net/tcp6) read for the uid
on the other end of a connection.

Why: on one node the workers' store and their gloo listeners are on loopback, which keeps out other hosts
but not other users of the same host. Every user can read these tables, and so can we: the table lists both
ends of a loopback connection, the client's end with the client's uid. A connection to one of our ports
whose client end belongs to another uid is a process outside the job (the job's processes all run as one
uid). The agent watches for them (agent/security/intruders.py) and a rank that failed its roll call names the uid it
finds here (runtime/roll_call.py). A client on another host is not in our tables: its uid stays unknown.

Nothing here needs privileges and nothing raises on an unreadable or malformed table: it answers "none".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED, TIME_WAIT, LISTEN = 0x01, 0x06, 0x0A


@dataclass(frozen=True)
class TcpEntry:
    """One row of a TCP table: the local and remote port, the state, the owner's uid and the socket inode."""

    local_port: int
    remote_port: int
    state: int
    uid: int
    inode: int
    local: str = ""      # address:port as the table writes it (hex)
    remote: str = ""


def _port(field: str) -> int:
    return int(field.rpartition(":")[2], 16)


_MAPPED = "0000000000000000FFFF0000"   # ::ffff:a.b.c.d as the tcp6 table writes it (then a.b.c.d as tcp does)


def _endpoint(field: str) -> str:
    """`field` with an IPv4-mapped IPv6 address written as the IPv4 table writes it: one end of a connection
    may be a v6 socket (torch's clients are) and the other a v4 one, in the other table."""
    addr, _, port = field.rpartition(":")
    if len(addr) == 32 and addr.startswith(_MAPPED):
        addr = addr[len(_MAPPED):]
    return f"{addr}:{port}"


def parse(text: str) -> list[TcpEntry]:
    """The rows of one table's text (its header line and any malformed row skipped)."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            rows.append(TcpEntry(local_port=_port(parts[1]), remote_port=_port(parts[2]), state=int(parts[3], 16),
                                 uid=int(parts[7]), inode=int(parts[9]), local=_endpoint(parts[1]), remote=_endpoint(parts[2])))
        except ValueError:
            continue
    return rows


def read_tables(paths: Iterable[str] = TABLES) -> list[TcpEntry]:
    """Every row of this network namespace's TCP tables ([] where they cannot be read)."""
    rows: list[TcpEntry] = []
    for path in paths:
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                rows += parse(fh.read())
        except OSError:
            continue
    return rows


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (empty when it is gone or not ours to read)."""
    found: set[int] = set()
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(base, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                found.add(int(target[8:-1]))
            except ValueError:
                continue
    return found


def listening_ports(pids: Iterable[int], rows: Optional[list[TcpEntry]] = None) -> set[int]:
    """The TCP ports processes `pids` listen on (their gloo listeners, a peer-copy receiver, ...)."""
    inodes: set[int] = set()
    for pid in pids:
        inodes |= socket_inodes(pid)
    rows = read_tables() if rows is None else rows
    return {row.local_port for row in rows if row.state == LISTEN and row.inode in inodes}


def foreign_clients(ports: Iterable[int], uid: Optional[int] = None,
                    rows: Optional[list[TcpEntry]] = None) -> set[tuple[int, int]]:
    """(uid, port) of each connection to one of `ports` on this host from a client on this host whose uid is
    not `uid` (default: ours). A connection counts only when both of its ends are in our tables (the
    server's end: local = the client's remote and the other way round), so another user's connection to a
    port of the same number on another host is not taken for one to ours. A connection that is closing
    still counts (its client may just have exited); one in TIME_WAIT has lost its uid (the kernel shows 0)."""
    wanted = set(ports)
    mine = os.getuid() if uid is None else uid
    rows = read_tables() if rows is None else rows
    server_ends = {(row.local, row.remote) for row in rows if row.local_port in wanted and row.state != LISTEN}
    return {(row.uid, row.remote_port) for row in rows
            if row.remote_port in wanted and row.uid != mine and row.state not in (LISTEN, TIME_WAIT)
            and (row.remote, row.local) in server_ends}
