"""HPAgentK8sAPIFactory: the factory of a worker's channel to its node agent, as `HPWrapper(hp_api_factory=...)`
takes it.

Why a factory: in the product note the worker reaches its agent through an API object built by
`HPAgentK8sAPIFactory()`; here the agent is hyperpodrun's own, on the same node, and the channel is the control
connection (hyperpodrun/runtime/control.py: heartbeats out, RESTART/GO/SHUTDOWN in). The factory says where
that connection goes and how often it beats; the process's control session (session.py) calls it once, when
the wrapped function first runs under `hyperpodrun --inprocess-restart`. A script may pass its own factory
(a callable with the same signature) to wrap or observe the channel.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hyperpodrun import env as E
from hyperpodrun import protocol as P
from hyperpodrun.errors import ApiValueError, OutOfOrderError


class HPAgentK8sAPIFactory:
    """Builds this worker's channel to its node agent.

    endpoint: the agent's control endpoint (default: the one hyperpodrun gives the worker, HYPERPODRUN_CONTROL).
    heartbeat_interval: seconds between heartbeats (default: what the agent asked for, --heartbeat-interval;
        a longer one than the agent's --heartbeat-timeout gets the rank declared hung).
    """

    def __init__(self, endpoint: Optional[str] = None, heartbeat_interval: Optional[float] = None) -> None:
        if heartbeat_interval is not None and (isinstance(heartbeat_interval, bool)
                                               or not isinstance(heartbeat_interval, (int, float))
                                               or not heartbeat_interval > 0):
            raise ApiValueError(f"HPAgentK8sAPIFactory(heartbeat_interval={heartbeat_interval!r}): seconds, > 0")
        self.endpoint = endpoint
        self.heartbeat_interval = heartbeat_interval

    def __call__(self, rank: int, on_command: Callable[[P._Msg], None], status: Callable[[], dict]) -> Any:
        """The channel (a started-on-demand ControlClient) of rank `rank`: `on_command` receives the agent's
        commands on the channel's own thread, `status` gives what each heartbeat carries."""
        from hyperpodrun.runtime.control import ControlClient
        ctx = E.worker_context()
        endpoint = self.endpoint or ctx.control
        if not endpoint:
            raise OutOfOrderError("HPAgentK8sAPIFactory: no agent to connect to (the process does not run under "
                                  "hyperpodrun --inprocess-restart, and no endpoint= was given)")
        return ControlClient(endpoint, rank, self.heartbeat_interval or ctx.heartbeat_interval, on_command, status)

    def __repr__(self) -> str:
        return f"HPAgentK8sAPIFactory(endpoint={self.endpoint!r}, heartbeat_interval={self.heartbeat_interval!r})"
