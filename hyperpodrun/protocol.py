"""Control-plane messages between the agent and its workers: the one contract both sides share.

Worker -> agent: HELLO, HEARTBEAT, FAULT, READY, DONE. Agent -> worker: RESTART, GO, SHUTDOWN, INJECT.
Tool -> agent: INJECT_REQUEST (answered with INJECT_REPLY). Each message is a pydantic model with a
`type` tag and the protocol `version`, sent as one JSON frame over zmq (docs/ARCHITECTURE.md, "Contracts"). A frame
that does not parse, or comes from a newer protocol than this side speaks, is logged and dropped.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from hyperpodrun.errors import ProtocolError


#: the control protocol's version: raised when a message changes in a way an older receiver would misread
PROTOCOL_VERSION = 1

#: a process exit code as the agent may pass it on (sys.exit, the shell's $?): 0..255. A wider value would
#: fail only when the agent exits (OverflowError), so the model refuses it as a malformed message.
ExitCode = Annotated[int, Field(ge=0, le=255)]


def exit_code_of(value: object, default: int = 1) -> int:
    """An ExitCode from what an exception carries (`exc.exit_code`): a whole number in 1..255 as it is, anything
    else (0, 2**70, -1, a string) `default` - never one that wraps around to 0 (256) or fails the message."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 255:
        return value
    return default


class _Msg(BaseModel):
    """A control message; each kind fixes `type` to its tag."""

    model_config = {"extra": "ignore"}

    type: str
    version: int = PROTOCOL_VERSION


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    rank: int
    local_rank: int
    pid: int
    generation: int
    wrapped: bool = True
    device_uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    rank: int
    pid: int
    generation: int
    step: Optional[int] = None
    seq: Optional[int] = None          # collective sequence number of the default process group
    state: str = "running"             # running | recovering | waiting | done
    device_uuid: Optional[str] = None  # the rank's CUDA device, once CUDA is initialised (NVML monitor's map)
    pci_bus_id: Optional[str] = None
    stack: Optional[str] = None        # during a restart: where the main thread is (for a READY timeout report)


class Fault(_Msg):
    type: Literal["fault"] = "fault"
    rank: int
    pid: int
    generation: int
    exc_type: str
    summary: str
    step: Optional[int] = None
    secondary: bool = False            # a communication error most likely caused by another rank's fault
    retryable: bool = True
    exit_code: ExitCode = 1            # for a fault that ends the job (not retryable)
    traceback: str = ""


class Ready(_Msg):
    type: Literal["ready"] = "ready"
    rank: int
    pid: int
    generation: int
    abort_s: float = 0.0
    finalize_s: float = 0.0
    health_s: float = 0.0


class Restored(_Msg):
    type: Literal["restored"] = "restored"
    rank: int
    pid: int
    generation: int
    step: int
    lost_steps: int = 0
    source: str = "memory"
    #: where a restore from the durable tier read its checkpoint (its URL), else ""
    location: str = ""


class Checkpointed(_Msg):
    """What the durable tier did with a fallback checkpoint: written (complete, sent by the rank that completed
    it), skipped (the previous one still being written, or its snapshot rewritten first) or failed (the store)."""

    type: Literal["checkpointed"] = "checkpointed"
    rank: int
    pid: int
    step: int
    outcome: Literal["written", "skipped", "failed"]
    detail: str = ""


class Done(_Msg):
    type: Literal["done"] = "done"
    rank: int
    pid: int
    generation: int


class Restart(_Msg):
    type: Literal["restart"] = "restart"
    generation: int
    reason: str = ""


class Go(_Msg):
    """Every rank is READY: run `generation` with its store. An elastic job that shrank or grew gives each
    rank its new place (rank, world_size, group_rank, group_world_size) and the world size before."""

    type: Literal["go"] = "go"
    generation: int
    master_addr: str
    master_port: int
    rank: Optional[int] = None
    world_size: Optional[int] = None
    group_rank: Optional[int] = None
    group_world_size: Optional[int] = None
    previous_world_size: Optional[int] = None


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"
    reason: str = "complete"           # complete: every rank finished; stop: the job is ending
    exit_code: ExitCode = 0


InjectKind = Literal["kill", "segv", "exit", "raise", "hang", "hang-gil", "hang-c", "nvml-xid", "gpu-lost"]


class Inject(_Msg):
    type: Literal["inject"] = "inject"
    kind: InjectKind
    step: Optional[int] = None         # act when the rank reports progress >= step (None: now)
    generation: Optional[int] = None   # only in this generation (None: the current one)
    exit_code: ExitCode = 1
    xid: Optional[int] = None


class InjectRequest(_Msg):
    type: Literal["inject_request"] = "inject_request"
    rank: int
    kind: InjectKind
    step: Optional[int] = None
    exit_code: ExitCode = 1
    xid: Optional[int] = None


class InjectReply(_Msg):
    type: Literal["inject_reply"] = "inject_reply"
    ok: bool
    detail: str = ""


Message = Annotated[Union[Hello, Heartbeat, Fault, Ready, Restored, Checkpointed, Done, Restart, Go, Shutdown, Inject,
                          InjectRequest, InjectReply], Field(discriminator="type")]
_ADAPTER: TypeAdapter = TypeAdapter(Message)


#: the channels of a worker's control connection (hyperpodrun/runtime/control.py): its monitor thread's socket,
#: which says HELLO, heartbeats and takes commands, and its main thread's socket (FAULT, READY, DONE)
MONITOR_CHANNEL, MAIN_CHANNEL = "h", "m"


def worker_identity(channel: str, rank: int, pid: int) -> bytes:
    """The zmq identity of one of a worker's control sockets (`channel`: MONITOR_CHANNEL or MAIN_CHANNEL)."""
    return f"{channel}{rank}-{pid}".encode()


def sibling_identities(ident: bytes) -> frozenset[bytes]:
    """The identities of one worker's two control sockets, given one of them (the agent binds a rank to the
    pair its HELLO came from: agent/control/voices.py); an identity of another form stands for itself alone."""
    head, tail = ident[:1], ident[1:]
    if head == MONITOR_CHANNEL.encode():
        return frozenset((ident, MAIN_CHANNEL.encode() + tail))
    if head == MAIN_CHANNEL.encode():
        return frozenset((ident, MONITOR_CHANNEL.encode() + tail))
    return frozenset((ident,))


def encode(msg: _Msg) -> bytes:
    """One JSON frame (None fields left out)."""
    return msg.model_dump_json(exclude_none=True).encode()


def decode(frame: bytes) -> _Msg:
    """The message in `frame`; ProtocolError when it is malformed or of a newer protocol version."""
    try:
        msg: _Msg = _ADAPTER.validate_json(frame)
    except ValidationError as exc:
        raise ProtocolError(f"malformed control message ({len(frame)} bytes): {exc.errors()[0].get('msg')}") \
            from None
    if msg.version > PROTOCOL_VERSION:
        raise ProtocolError(f"{msg.type} message of protocol version {msg.version}; this side speaks version "
                            f"{PROTOCOL_VERSION} (the agent and the workers run different hyperpodrun versions?)")
    return msg
