"""POST /stop of the status API (agent/observe/http_api.py): a graceful stop asked for over HTTP, carried out by
the agent's loop.

Why a flag and not a call: the request arrives on the HTTP server's thread, and only the loop thread may touch
the node's state (agent/agent.py). `request` sets the flag and wakes the loop; the loop's next pass calls
`carry_out`, which stops the node the way a SIGTERM does - `--shutdown-signal` to every worker, SIGKILL after
`--shutdown-timeout` - except that the node then exits with EXIT_API_STOP (82, docs/exit-codes.md), so that
whoever reads the exit code (a Kubernetes Job's podFailurePolicy, a script) can tell an operator's stop from
a signal or a failure. Unlike a signal (a container being stopped, which must not wait) the post-train
script still runs.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Optional

from hyperpodrun.agent.state import StopPlan
from hyperpodrun.errors import EXIT_API_STOP

if TYPE_CHECKING:
    from hyperpodrun.agent.node import Node
    from hyperpodrun.agent.ports import Events


class StopRequest:
    """The stop an operator asked for through the status API (see the module's docstring)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._flag = threading.Event()
        self._wake = wake
        self.carried_out = False

    @property
    def requested(self) -> bool:
        return self._flag.is_set()

    def request(self) -> Optional[int]:
        """From the HTTP thread: ask the loop to stop the node. Returns the exit code the node will end with."""
        self._flag.set()
        self._wake()
        return EXIT_API_STOP

    def carry_out(self, node: "Node", events: "Events", shutdown_signal: int) -> None:
        """On the loop thread, once: stop every worker and exit with EXIT_API_STOP (nothing when the node is
        already ending: a second stop, or a job that has just failed or finished, keeps its own code)."""
        if not self._flag.is_set() or self.carried_out:
            return
        self.carried_out = True
        if node.done or node.state.exiting:
            events.emit("api_stop_ignored", "stop requested through the status API: the node is already ending")
            return
        events.emit("api_stop", f"stop requested through the status API (POST /stop): stopping every worker, SIGKILL "
                    f"after {node.cfg.shutdown_timeout:g}s; exit code {EXIT_API_STOP}", level=logging.WARNING,
                    exit_code=EXIT_API_STOP)
        node.begin_stop(StopPlan.exit(EXIT_API_STOP), shutdown_signal)
