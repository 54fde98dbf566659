"""The control plane's two bounds (issue 33, item 7): an exit code outside 0..255 is a malformed message (it
crashed the agent at exit: OverflowError), and each rank's process is bound to the identities of its HELLO -
a message in its name from any other identity is dropped with one `foreign_message` event."""
from __future__ import annotations

import signal

import pytest
import zmq
from fakes import Harness, config

from hyperpodrun import protocol as P
from hyperpodrun.agent.control.server import ControlServer
from hyperpodrun.agent.state import Phase
from hyperpodrun.errors import ProtocolError


def running() -> Harness:
    h = Harness(config(inprocess_restart=True, max_restarts=1)).start()
    h.hello_all()
    return h


def fault(h: Harness, local_rank: int, **kw: object) -> P.Fault:
    proc = h.proc(local_rank)
    return P.Fault(rank=proc.rank, pid=proc.pid, generation=0, exc_type="RuntimeError", summary="planted",
                   **kw)


# ------------------------------------------------------------------------------------------ exit codes
@pytest.mark.parametrize("model, fields", [
    (P.Fault, {"rank": 0, "pid": 1, "generation": 0, "exc_type": "E", "summary": "s"}),
    (P.Shutdown, {}),
    (P.Inject, {"kind": "exit"}),
    (P.InjectRequest, {"rank": 0, "kind": "exit"}),
])
@pytest.mark.parametrize("code", [2**70, 256, -1])
def test_an_exit_code_outside_0_255_is_a_malformed_message(model: type, fields: dict, code: int) -> None:
    frame = model.model_construct(**fields, exit_code=code).model_dump_json().encode()
    with pytest.raises(ProtocolError, match="malformed control message"):
        P.decode(frame)
    assert P.decode(model.model_construct(**fields, exit_code=255).model_dump_json().encode()).exit_code == 255


def test_the_control_server_drops_a_fault_with_a_huge_exit_code() -> None:
    server = ControlServer()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.endpoint)
        bad = b'{"type":"fault","rank":0,"pid":1,"generation":0,"exc_type":"E","summary":"s","retryable":false,' \
              b'"exit_code":%d}' % 2**70
        sock.send(bad)
        sock.send(P.encode(P.Done(rank=0, pid=1, generation=0)))   # the next message still arrives
        got: list[P._Msg] = []
        poller = zmq.Poller()
        poller.register(server.sock, zmq.POLLIN)
        while not got and poller.poll(5000):
            got += [m for _, m in server.receive()]
        assert [m.type for m in got] == ["done"]
    finally:
        sock.close()
        ctx.term()
        server.close()


# ------------------------------------------------------------------------------------------ the binding
def test_a_fault_in_a_ranks_name_from_another_identity_is_dropped_with_one_event() -> None:
    h = running()
    stranger = P.worker_identity(P.MONITOR_CHANNEL, 1, 4242)
    for _ in range(3):
        h.node.on_message(stranger, fault(h, 1))
    assert h.phase is Phase.RUNNING and not h.control.of(P.Restart)    # no round: nothing happened
    [event] = h.sink.named("foreign_message")
    assert event["rank"] == 1 and event["pid"] == h.proc(1).pid and event["kind"] == "fault"
    h.node.on_message(h.ident(1), fault(h, 1))                         # the rank itself: a round starts
    assert h.phase is Phase.RESTARTING and h.control.of(P.Restart)


def test_the_main_thread_socket_of_the_hello_speaks_for_the_rank() -> None:
    h = running()
    proc = h.proc(0)
    h.node.on_message(P.worker_identity(P.MAIN_CHANNEL, proc.rank, proc.pid), fault(h, 0))
    assert h.phase is Phase.RESTARTING and not h.sink.named("foreign_message")


def test_a_second_hello_from_another_identity_does_not_take_the_rank() -> None:
    h = running()
    proc = h.proc(0)
    other = P.worker_identity(P.MONITOR_CHANNEL, proc.rank + 7, proc.pid)   # its form, not its HELLO's
    h.node.on_message(other, P.Hello(rank=proc.rank, local_rank=0, pid=proc.pid, generation=0))
    assert h.sink.named("foreign_message")[0]["kind"] == "hello"
    h.fault(1, generation=0)
    assert [i for i, _ in h.control.of(P.Restart)] == [h.ident(0), h.ident(1)]   # commands go to the real one


def test_before_its_hello_a_rank_is_heard_only_from_its_own_sockets() -> None:
    h = Harness(config(inprocess_restart=True, max_restarts=1)).start()
    h.node.on_message(b"anything", fault(h, 0))
    assert h.phase is Phase.RUNNING and h.sink.named("foreign_message")[0]["identity"] == "anything"
    h.send(0, fault(h, 0))
    assert h.phase is Phase.RESTARTING


def test_a_respawned_rank_is_bound_to_its_new_process() -> None:
    h = running()
    old = h.ident(0)
    h.exit(0, -signal.SIGKILL)
    h.hello(0)                                   # the new process, from its own identity
    h.node.on_message(old, fault(h, 0))          # the old identity names the new pid: not its voice
    assert h.sink.named("foreign_message")


@pytest.mark.parametrize("carried, code", [(3, 3), (255, 255), (0, 1), (256, 1), (2**70, 1), (-1, 1), ("7", 1),
                                           (True, 1), (None, 1)])
def test_an_exceptions_exit_code_becomes_one_the_protocol_takes(carried: object, code: int) -> None:
    """The worker reports `exc.exit_code` of a fatal exception: a value the model refuses would fail the
    report itself, and 256 would end the process with 0 (success)."""
    assert P.exit_code_of(carried) == code
    P.Fault(rank=0, pid=1, generation=0, exc_type="E", summary="s", exit_code=P.exit_code_of(carried))
