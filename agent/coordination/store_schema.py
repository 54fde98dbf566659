"""The coordination store's schema: every key the agents use, and the records stored under them.

Why one module: the keys are the agents' wire contract across nodes (and across versions during a rolling
upgrade); spread over several modules they drift. No other module spells a key. Every key is relative to
the run's prefix `hyperpodrun/<run-id>/` (`run_prefix`). Records are pydantic models serialised as JSON -
never pickle. The ones that change the job's fate are signed with the job's key and bound to the run id and
the key's name (agent/coordination/job_state.py, `SignedRecords`); the rendezvous keys are written before the job's
key is known and are plain (docs/ARCHITECTURE.md, "Store schema").

A per-node mark `name` (done, left, barriers) is the signed record `node_mark(name, n)` of each node plus a
plain counter under `name` itself, which only says when the signed marks are worth reading.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

#: bump when a key's meaning or a record's shape changes incompatibly
SCHEMA_VERSION = 1


def run_prefix(run_id: str) -> str:
    """The prefix of every key of run `run_id` in the coordination store."""
    return f"hyperpodrun/{run_id}/"


# ------------------------------------------------------------------ rendezvous (plain records)
AUTH = "auth"                          # how the job secret was settled: "user:<check>" | "agreed:<secret>"
RDZV_COUNTER = "rdzv/counter"          # c10d: node ranks in join order (atomic add)
RDZV_JOINED = "rdzv/joined"            # how many agents have joined (atomic add)
RDZV_READY = "rdzv/ready"              # set by the last agent to join
RDZV_SIZE = "rdzv/size"                # elastic c10d: how many nodes the job formed with (first claim wins)
RDZV_NPROCS = "rdzv/nprocs"            # fixed size: every node's worker count (JSON list), set with RDZV_READY


def is_plain(key: str) -> bool:
    """Whether `key` is one of the plain (unsigned) rendezvous records."""
    return key == AUTH or key.startswith("rdzv/")


def rdzv_claim(node_rank: int) -> str:
    """static: one claim per node rank (a second agent with the same --node-rank is refused)."""
    return f"rdzv/claim/{node_rank}"


def rdzv_nproc(node_rank: int) -> str:
    """Workers of node `node_rank` (global ranks are assigned node by node)."""
    return f"rdzv/nproc/{node_rank}"


# ------------------------------------------------------------------ generations and the restart budget (signed)
GENERATION = "gen"                     # the job-wide restart generation (only moves forward)
RESTARTS_USED = "restarts_used"        # a RestartBudget: process-level restarts spent of --max-restarts


def restart_claim(generation: int) -> str:
    """A RestartClaim: the first agent to claim it owns the restart into `generation`."""
    return f"restart/{generation}"


def worker_store(generation: int) -> str:
    """The port of `generation`'s worker store ("PORT" on the store host; "ADDRESS:PORT" where a standalone
    coordinator serves the coordination store), published by the agent that hosts it."""
    return f"wstore/{generation}"


def worker_store_host(generation: int) -> str:
    """With a standalone coordinator: which agent hosts `generation`'s worker store (the first claim wins)."""
    return f"wstore_host/{generation}"


# ------------------------------------------------------------------ in-process rounds (signed)
def inprocess_ready(generation: int) -> str:
    """Mark: every rank of the node is READY for `generation` (the job-wide barrier before GO)."""
    return f"ipready/{generation}"


def inprocess_done(generation: int) -> str:
    """Mark: every rank of the node reported DONE in `generation` (before SHUTDOWN releases them)."""
    return f"ipdone/{generation}"


def root_cause(generation: int) -> str:
    """The FailureInfo naming the real cause of `generation`'s round, job-wide (first claim wins)."""
    return f"rootcause/{generation}"


# ------------------------------------------------------------------ membership (signed; agent/coordination/membership.py)
def node_holder(node_rank: int) -> str:
    """The incarnation (a random token per agent start) that holds node rank `node_rank` now."""
    return f"member/{node_rank}/holder"


def is_node_holder(key: str) -> bool:
    """Whether `key` is some node rank's holder record (`node_holder`)."""
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "member" and parts[1].isdigit() and parts[2] == "holder"


def node_lease(node_rank: int) -> str:
    """A NodeLease: the holder's renewal counter; a counter that stops moving for --node-timeout is a lost node."""
    return f"member/{node_rank}/lease"


NODE_LOSSES = "member/losses"          # a JSON list of every NodeLoss declared (the other agents read only this)
SPARES = "member/spares"               # a JSON list of the hot spares waiting: {"incarnation", "host", "since"}
OWNER = "member/owner"                 # an Owner: the agent that watches every lease (agent/coordination/owner.py)


def node_lost(node_rank: int, incarnation: str) -> str:
    """A NodeLoss: incarnation `incarnation` of node `node_rank` was declared lost (first claim wins)."""
    return f"member/{node_rank}/lost/{incarnation}"


def node_dropped(incarnation: str) -> str:
    """The holder record of a lost node rank the job shrank without (elastic): no replacement takes it over."""
    return f"dropped:{incarnation}"


# ------------------------------------------------------------------ elastic layouts (signed; agent/coordination/layout.py)
LAYOUT = "layout"                      # the newest Layout (what a replacement or a newcomer joins)


def layout(generation: int) -> str:
    """The Layout the job runs from `generation` on, when its nodes changed there (the store host writes it)."""
    return f"layout/{generation}"


def node_join(node_rank: int) -> str:
    """An elastic newcomer holding the free node rank `node_rank` asks to be admitted (a NodeJoin)."""
    return f"member/{node_rank}/join"


# ------------------------------------------------------------------ the end of the job (signed)
FAILED = "failed"                      # the FailureInfo that ended the job (first claim wins)
LEFT = "left"                          # mark: the node has read the job's result and may go


def done(generation: int) -> str:
    """Mark: every local worker of the node succeeded in `generation`."""
    return f"done/{generation}"


def sealed(name: str) -> str:
    """The seal of mark `name`: the node ranks whose marks were all verified set (signed_records.count)."""
    return f"{name}/sealed"


def node_mark(name: str, node_rank: int) -> str:
    """The signed mark of node `node_rank` under mark `name` ("1" set, "0" taken back)."""
    return f"{name}/node{node_rank}"


# ------------------------------------------------------------------ records
class FailureInfo(BaseModel):
    """A failure as the agents report it to each other and to the user: who failed, how, and what followed.

    Treated as a value: change it with `with_()`. Unknown fields of a newer agent's record are dropped."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: Optional[str] = None
    node: Optional[int] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    pid: Optional[int] = None
    exit_code: int = 1
    cause: str = ""
    summary: str = ""
    generation: Optional[int] = None
    step: Optional[int] = None
    exc_type: Optional[str] = None
    error_file: Optional[str] = None
    stderr_log: Optional[str] = None
    gpu: Optional[str] = None
    #: process level: the exit looks like a consequence of another rank's failure (agent/observe/report.py)
    symptom: bool = False
    #: in-process: a consequence of another rank's failure ("connection closed by peer"), not a cause
    secondary: bool = False
    #: learned from another node (it moved the generation); we only know that something failed
    remote: bool = False
    #: failures that happened together with this one and were folded into it
    folded: tuple[str, ...] = ()

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    @classmethod
    def from_json(cls, raw: str) -> "FailureInfo":
        return cls.model_validate_json(raw)

    def with_(self, **changes: Any) -> "FailureInfo":
        """A copy with `changes` applied (validated)."""
        return FailureInfo.model_validate({**self.model_dump(), **changes})


class RestartClaim(BaseModel):
    """Who owns the restart into a generation, and why: an agent that loses the race learns the winner's
    cause from it (and, when the budget is spent, ends the job with that cause, not its own symptom)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    owner: str
    reason: FailureInfo


class RestartBudget(BaseModel):
    """Process-level restarts spent, and the newest generation they were counted for: a generation is counted
    once whichever agent counts it, so every agent that asks for it reads the same verdict."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    used: int = 0
    counted: int = -1


class NodeLease(BaseModel):
    """One renewal of a node's lease: who holds the node rank and how often it has renewed."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    incarnation: str
    count: int


class Owner(BaseModel):
    """The agent elected to carry the host-only duties (watching every lease, declaring losses) when no agent
    hosts the store: its node rank and incarnation; it holds the duty while it holds the rank and renews."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    node: int
    incarnation: str


class NodeLoss(BaseModel):
    """A node declared lost: which incarnation, by whom, why, and the generation the survivors moved to
    (a replacement joins that generation)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    node: int
    incarnation: str
    generation: int
    by_node: int
    why: str
    wall_time: float


class Layout(BaseModel):
    """Which node ranks run the job from `generation` on, and how many workers each: global ranks are handed
    out node by node in node-rank order, so the world size and every node's first rank follow from it.
    `previous_world_size`: the world size before this layout (the workers' `caller` tells them it changed)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    generation: int
    nodes: dict[int, int]
    previous_world_size: Optional[int] = None

    @property
    def world_size(self) -> int:
        return sum(self.nodes.values())

    def offset(self, node: int) -> int:
        """The first global rank of node rank `node` (which must be in the layout)."""
        return sum(n for k, n in self.nodes.items() if k < node)

    def index(self, node: int) -> int:
        """Node rank `node`'s place among the layout's nodes (the workers' GROUP_RANK)."""
        return sorted(self.nodes).index(node)


class NodeJoin(BaseModel):
    """An elastic newcomer's request to be admitted: its incarnation, worker count and host."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    incarnation: str
    nproc: int
    host: str
