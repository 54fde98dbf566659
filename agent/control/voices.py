"""Which control-socket identities may speak for a worker: those of its HELLO.

Why: the control socket (agent/control/server.py) takes any process of this user, and every worker message names
its sender by the pid it claims. Without a binding, another process of the user could report a fault, a
step or a completion in a rank's name. So the first HELLO from a worker process binds its rank to the zmq
identity it came from and that identity's sibling (the worker's other control socket:
protocol.sibling_identities); from then on a message in that process's name from any other identity is
dropped, and logged once per identity as a `foreign_message` event. Before its HELLO a process is heard only
from identities of the form its own sockets use (protocol.worker_identity, naming its pid); a respawned rank
(a new pid) starts unbound again.
"""
from __future__ import annotations

import logging
from typing import Optional

from hyperpodrun import protocol as P
from hyperpodrun.agent.ports import Events
from hyperpodrun.agent.rankstate import RankState

log = logging.getLogger("hyperpodrun.agent")

#: identities named in one foreign_message event are cut to this many bytes
_SHOWN = 40


def _own_form(ident: bytes, pid: Optional[int]) -> bool:
    """Whether `ident` has the form of one of the control sockets of process `pid`."""
    if pid is None:
        return False
    suffix = f"-{pid}".encode()
    return ident[:1] in (P.MONITOR_CHANNEL.encode(), P.MAIN_CHANNEL.encode()) and ident.endswith(suffix) \
        and ident[1:-len(suffix)].isdigit()


class Voices:
    """The binding of each rank's current process to the identities of its HELLO (see the module doc)."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self._told: set[tuple[Optional[int], bytes]] = set()

    def admit(self, st: RankState, ident: bytes, msg: P._Msg) -> bool:
        """Whether `msg`, received from `ident` in the name of `st`'s process, is that process speaking; a HELLO
        that is binds the rank. False: drop it (an event says so, once per identity and process)."""
        if st.voices:
            if ident in st.voices:
                return True
            return self._foreign(st, ident, msg, "another identity said HELLO for it")
        if not _own_form(ident, st.pid):
            return self._foreign(st, ident, msg, "not one of its control sockets")
        if isinstance(msg, P.Hello):
            st.voices = P.sibling_identities(ident)
        return True

    def _foreign(self, st: RankState, ident: bytes, msg: P._Msg, why: str) -> bool:
        shown = ident[:_SHOWN].decode("ascii", errors="backslashreplace")
        kind = getattr(msg, "type", "?")
        if (st.pid, ident) in self._told:
            log.debug("dropped another %s in the name of rank %d (pid %s) from %r", kind, st.rank, st.pid, shown)
            return False
        self._told.add((st.pid, ident))
        self.events.emit("foreign_message", f"dropped a {kind} message in the name of rank {st.rank} (pid {st.pid}) "
                         f"from control identity {shown!r}: {why}; only the rank's own process may speak for it",
                         rank=st.rank, pid=st.pid, kind=kind, identity=shown, level=logging.WARNING)
        return False
