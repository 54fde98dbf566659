"""`node<N>.agent.json` in the run directory: where `hyperpodrun inject` finds a running agent.

One model for the file, written by the agent (agent/agent.py) and read by the tool (hyperpodrun/tools.py),
so the two cannot drift. The file is private (0600, never through a symlink: hyperpodrun/safe_fs.py) and
replaced atomically.
"""
from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from hyperpodrun import safe_fs

#: a node<N>.agent.json is a few hundred bytes; more is not read
MAX_BYTES = 64 * 1024


class AgentInfo(BaseModel):
    """A running agent that takes control requests."""

    model_config = ConfigDict(extra="ignore")

    version: int = 1
    control: str            # the control socket's zmq endpoint (ipc://...)
    pid: int
    host: str
    node_rank: int
    rank_offset: int
    nproc_per_node: int

    @staticmethod
    def path(run_dir: str, node_rank: int) -> str:
        return os.path.join(run_dir, f"node{node_rank}.agent.json")

    def hosts(self, rank: int) -> bool:
        """Whether global rank `rank` runs on this agent's node."""
        return self.rank_offset <= rank < self.rank_offset + self.nproc_per_node

    def write(self, run_dir: str) -> str:
        path = self.path(run_dir, self.node_rank)
        with os.fdopen(safe_fs.open_private(path + ".tmp"), "w") as fh:
            fh.write(self.model_dump_json())
        os.replace(path + ".tmp", path)
        return path

    @classmethod
    def read(cls, path: str) -> "AgentInfo":
        """The file at `path` when it is a regular file of ours (never through a symlink, never a FIFO:
        hyperpodrun/trusted_read.py); UnsafePathError otherwise, pydantic's ValidationError when malformed."""
        from hyperpodrun import trusted_read
        return cls.model_validate_json(trusted_read.read_bytes(path)[:MAX_BYTES])
