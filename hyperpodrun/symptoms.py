"""What a rank's failure looks like when it is only the consequence of another rank's failure.

When one rank dies, its peers' collectives fail too ("Connection closed by peer", a reset, an aborted
communicator) and they may exit, even abort, before the dead rank's own exit is seen. Both the worker
runtime (which marks such a fault report `secondary`) and the agent (which reads a dead rank's last stderr
lines) use these markers, so that the rank named as the cause of a restart is the one that failed first.
"""
from __future__ import annotations

#: lower-case fragments of the messages a rank sees when a peer, not itself, failed
SECONDARY_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "socket closed",
                     "communicator was aborted", "process group", "processgroup", "timed out",
                     "connection refused", "has been aborted", "destroyed", "not initialized")


def looks_secondary(text: str) -> bool:
    """Whether `text` (an exception message, the tail of a stderr log) shows a peer-failure symptom."""
    low = text.lower()
    return any(marker in low for marker in SECONDARY_MARKERS)
