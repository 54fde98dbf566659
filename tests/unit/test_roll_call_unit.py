"""The roll call's logic without processes: the proof and its check, the plain message, the TCP tables that
name an outsider, the agent's retry-once rule and its foreign_connection watch, the init_process_group wrap."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fakes import RecordingSink
from hyperpodrun import netwatch
from hyperpodrun.agent.security import intruders
from hyperpodrun.agent.observe.events import EventLog
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.errors import EXIT_INTRUDER, AuthError, HyperpodrunError, RollCallError
from hyperpodrun.runtime import group_hook, roll_call
from hyperpodrun.runtime.roll_call import PROOF_BYTES, Roll

KEY = roll_call.roll_key(b"k" * 32)
ROLL = Roll(run_id="run", generation=2, store="4000", world=3, rank=0)


def _gathered(roll: Roll, key: bytes = KEY) -> bytes:
    return b"".join(roll_call.proof(key, roll, r) for r in range(roll.world))


# ------------------------------------------------------------------------------------------ proof
def test_every_member_with_the_key_passes() -> None:
    assert roll_call.failed_ranks(KEY, ROLL, _gathered(ROLL)) == []


def test_a_wrong_proof_names_its_rank() -> None:
    data = bytearray(_gathered(ROLL))
    data[PROOF_BYTES:2 * PROOF_BYTES] = bytes(PROOF_BYTES)          # rank 1 answered junk
    assert roll_call.failed_ranks(KEY, ROLL, bytes(data)) == [1]
    other = roll_call.roll_key(b"x" * 32)
    data[2 * PROOF_BYTES:] = roll_call.proof(other, ROLL, 2)       # rank 2 has another key
    assert roll_call.failed_ranks(KEY, ROLL, bytes(data)) == [1, 2]


def test_a_gather_of_the_wrong_size_fails_everyone() -> None:
    assert roll_call.failed_ranks(KEY, ROLL, _gathered(ROLL)[:-1]) == [0, 1, 2]


@pytest.mark.parametrize("change", [dict(generation=3), dict(store="4001"), dict(run_id="other"),
                                    dict(world=4)])
def test_a_proof_holds_for_its_own_round_only(change: dict[str, Any]) -> None:
    """A proof from another generation, round (store port), job or group size is refused: no replay."""
    moved = Roll(**{**ROLL.__dict__, **change})
    assert roll_call.proof(KEY, moved, 1) != roll_call.proof(KEY, ROLL, 1)
    replayed = bytearray(_gathered(ROLL))
    replayed[PROOF_BYTES:2 * PROOF_BYTES] = roll_call.proof(KEY, moved, 1)
    assert roll_call.failed_ranks(KEY, ROLL, bytes(replayed)) == [1]


def test_a_proof_is_one_ranks_only() -> None:
    assert roll_call.proof(KEY, ROLL, 0) != roll_call.proof(KEY, ROLL, 1)


def test_the_message_is_plain() -> None:
    assert roll_call.describe([1], 0, [65534]) == \
        "a process outside the job took rank 1's place in generation 0 (uid 65534)"
    assert roll_call.describe([1, 3], 4, []) == \
        "processes outside the job took the places of ranks 1, 3 in generation 4 (uid unknown)"
    assert "(uid 7, 65534)" in roll_call.describe([], 1, [65534, 7, 7])


def test_the_error_is_in_the_one_hierarchy() -> None:
    exc = RollCallError("x", ranks=(1,), uids=(65534,))
    assert isinstance(exc, AuthError) and isinstance(exc, HyperpodrunError)
    assert exc.exit_code == EXIT_INTRUDER == 81 and exc.ranks == (1,) and exc.uids == (65534,)


def test_the_roll_comes_from_the_agents_environment() -> None:
    env = {"HYPERPODRUN_JOB_KEY": "ab" * 32, "TORCHELASTIC_RUN_ID": "r", "HYPERPODRUN_GENERATION": "5",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "123"}
    assert roll_call.current_roll(1, 2, env) == Roll(run_id="r", generation=5, store="123", world=2,
                                                     rank=1)
    assert roll_call.current_roll(1, 2, {k: v for k, v in env.items() if k != "HYPERPODRUN_JOB_KEY"}) is None


# ------------------------------------------------------------------------------------------ the TCP tables
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _row(local: str, remote: str, state: str, uid: int, inode: int) -> str:
    return f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000 {uid:>5} 0 {inode} 1 0 20 4 30 10 -1\n"


V4 = HEADER + (_row("0100007F:0FA0", "00000000:0000", "0A", 0, 10)          # our store listens on 127.0.0.1:4000
               + _row("0100007F:0FA0", "0100007F:C350", "01", 0, 11)        # its end of a connection from :50000
               + _row("0100007F:0FA0", "0100007F:C351", "01", 0, 12)        # and from :50001
               + _row("0100007F:C351", "0100007F:0FA0", "01", 0, 13)        # :50001 is ours (uid 0)
               + _row("0A000002:C352", "0A000009:0FA0", "01", 1000, 14))    # uid 1000 to port 4000 elsewhere
V6 = HEADER + (_row("0000000000000000FFFF00000100007F:C350", "0000000000000000FFFF00000100007F:0FA0", "01", 65534, 20)
               + _row("0000000000000000FFFF00000100007F:C353", "0000000000000000FFFF00000100007F:0FA0", "06", 0, 0))


def test_a_v6_client_of_a_v4_server_of_another_uid_is_found() -> None:
    rows = netwatch.parse(V4) + netwatch.parse(V6)
    assert netwatch.foreign_clients([4000], uid=0, rows=rows) == {(65534, 4000)}
    assert netwatch.foreign_clients([4001], uid=0, rows=rows) == set()
    assert netwatch.foreign_clients([4000], uid=65534, rows=rows) == {(0, 4000)}   # seen from the other side


def test_malformed_rows_are_skipped() -> None:
    rows = netwatch.parse(HEADER + "junk\n   1: zz:zz yy:yy 01 0 0 0 x 0 q\n" + _row("0100007F:0FA0", "00000000:0000",
                                                                                      "0A", 0, 1))
    assert [(r.local_port, r.state) for r in rows] == [(4000, netwatch.LISTEN)]
    assert netwatch.read_tables(["/nonexistent/tcp"]) == []


# ------------------------------------------------------------------------------------------ the agent
def _events() -> tuple[EventLog, RecordingSink]:
    sink = RecordingSink()
    log = EventLog(host="h")
    log.add_sink(sink)
    return log, sink


def _info(tmp_path: Path, text: str) -> FailureInfo:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": text}}}))
    return FailureInfo(rank=0, exit_code=EXIT_INTRUDER, generation=0, error_file=str(path))


def test_a_failed_roll_call_is_retried_once_then_ends_the_job(tmp_path: Path) -> None:
    events, sink = _events()
    failures = intruders.RollCallFailures(events)
    info = _info(tmp_path, "RollCallError: a process outside the job took rank 1's place in generation 0 (uid 65534)")
    assert intruders.is_roll_call_failure(info)
    assert failures.retry(info) is True
    assert failures.retry(info) is False
    final = failures.final(info)
    assert final.exit_code == EXIT_INTRUDER
    assert final.summary == "a process outside the job took rank 1's place in generation 0 (uid 65534)"
    msgs = [r["msg"] for r in sink.named("roll_call_failed")]
    assert "retrying" in msgs[0] and "ending the job" in msgs[1]


def test_the_agent_names_the_uid_the_rank_could_not(tmp_path: Path) -> None:
    events, sink = _events()
    failures = intruders.RollCallFailures(events)
    failures.known_uids = lambda: {65534}
    info = FailureInfo(rank=0, exc_type="RollCallError", generation=1,
                       cause="RollCallError: a process outside the job took rank 1's place in generation 1 "
                             "(uid unknown)")
    failures.retry(info)
    assert "took rank 1's place in generation 1 (uid 65534)" in sink.named("roll_call_failed")[0]["msg"]


def test_the_watch_reports_each_foreign_connection_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = netwatch.parse(V4) + netwatch.parse(V6)
    monkeypatch.setattr(netwatch, "read_tables", lambda paths=netwatch.TABLES: rows)
    monkeypatch.setattr(netwatch, "listening_ports", lambda pids, rows=None: set())
    events, sink = _events()
    watch = intruders.IntruderWatch(events, lambda: [4000], lambda: [], uid=0)
    assert watch.poll(0.0) == [(65534, 4000)]
    assert watch.poll(0.5) == [] and watch.uids() == {65534}
    (rec,) = sink.named("foreign_connection")
    assert rec["uid"] == 65534 and rec["port"] == 4000 and "workers' store" in rec["msg"]


# ------------------------------------------------------------------------------------------ the wrap
def test_the_wrap_holds_the_roll_call_and_is_applied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def init_process_group(backend: str = "gloo") -> str:
        calls.append(backend)
        return "formed"
    wrapped = group_hook.wrap(init_process_group)
    assert group_hook.wrap(wrapped) is wrapped
    monkeypatch.setattr(roll_call, "call", lambda: 0.0001)
    assert wrapped("gloo") == "formed" and calls == ["gloo"]

    def refused() -> None:
        raise RollCallError("a process outside the job took rank 1's place in generation 0 (uid 65534)")
    monkeypatch.setattr(roll_call, "call", refused)
    for name in ("HYPERPODRUN_RUN_DIR", "TORCHELASTIC_RUN_ID", "HYPERPODRUN_CONTROL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RollCallError):      # not launched by hyperpodrun: raised, not an exit
        wrapped()
    monkeypatch.setenv("HYPERPODRUN_ROLL_CALL", "0")
    assert wrapped() == "formed"            # opted out: no roll call


def test_a_one_member_group_has_nothing_to_prove(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    monkeypatch.setenv("HYPERPODRUN_JOB_KEY", "ab" * 32)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert roll_call.call() is None
    finally:
        dist.destroy_process_group()


def test_a_group_that_fails_to_form_with_an_outsider_at_the_store_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 2: junk in the rendezvous keys - the failure names the outsider, not the script."""
    env = {"HYPERPODRUN_JOB_KEY": "ab" * 32, "TORCHELASTIC_RUN_ID": "r", "HYPERPODRUN_GENERATION": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000", "RANK": "0", "WORLD_SIZE": "2"}
    seen: list[list[int]] = []
    monkeypatch.setattr(roll_call, "foreign_uids", lambda ports: seen.append(ports) or [65534])
    junk = RuntimeError("Invalid address: junk\nmore")
    exc = roll_call.outside_cause(junk, env)
    assert isinstance(exc, RollCallError) and exc.uids == (65534,) and seen == [[4000]]
    assert str(exc) == ("a process outside the job (uid 65534) is connected to the workers' store of generation 4 "
                        "and the group failed to form: Invalid address: junk")
    monkeypatch.setattr(roll_call, "foreign_uids", lambda ports: [])
    assert roll_call.outside_cause(junk, env) is None                      # nobody in sight: the error as it is
    assert roll_call.outside_cause(junk, {**env, "HYPERPODRUN_JOB_KEY": ""}) is None   # not the agent's worker


def test_the_wrap_turns_a_failed_rendezvous_with_an_outsider_into_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def init_process_group() -> None:
        raise RuntimeError("wait timeout after 15000ms, keys: /default_pg/0//cpu//0/1")
    wrapped = group_hook.wrap(init_process_group)
    for name in ("HYPERPODRUN_RUN_DIR", "TORCHELASTIC_RUN_ID", "HYPERPODRUN_CONTROL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(roll_call, "outside_cause", lambda exc: RollCallError(f"outsider: {exc}"))
    with pytest.raises(RollCallError, match="outsider: wait timeout"):
        wrapped()
    monkeypatch.setattr(roll_call, "outside_cause", lambda exc: None)
    with pytest.raises(RuntimeError, match="wait timeout"):
        wrapped()


@pytest.mark.parametrize("junk", [MemoryError("std::bad_alloc"), ValueError("basic_string::_M_create"),
                                  RuntimeError("[enforce fail at /w/third_party/gloo/gloo/transport/tcp/context.cc:391] "
                                               "pairIdChunkSz % sizeof(ssize_t) == 0. 4 vs 0")])
def test_a_group_that_fails_on_a_malformed_record_names_an_outsider_it_cannot_see(
        monkeypatch: pytest.MonkeyPatch, junk: BaseException) -> None:
    """Finding 2 when the outsider hung up before the rank looked: what gloo raises on a record it did not
    write is an outside cause, '(uid unknown)' until the agent names the uid it saw."""
    env = {"HYPERPODRUN_JOB_KEY": "ab" * 32, "TORCHELASTIC_RUN_ID": "r", "HYPERPODRUN_GENERATION": "4",
           "MASTER_PORT": "4000", "RANK": "0", "WORLD_SIZE": "2"}
    monkeypatch.setattr(roll_call, "foreign_uids", lambda ports: [])
    exc = roll_call.outside_cause(junk, env)
    assert isinstance(exc, RollCallError) and str(exc).startswith(
        "a process outside the job (uid unknown) wrote malformed rendezvous records into the workers' store of "
        "generation 4 and the group failed to form: ")
    for honest in (RuntimeError("Connection refused"), RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc:1] "
                                                                    "Connection reset by peer"), TimeoutError("x")):
        assert roll_call.outside_cause(honest, env) is None      # the script's own environment: as it is


def test_the_agent_names_the_uid_inside_the_message(tmp_path: Path) -> None:
    events, sink = _events()
    failures = intruders.RollCallFailures(events)
    failures.known_uids = lambda: {65534}
    info = FailureInfo(rank=0, exc_type="RollCallError", generation=0,
                       cause="RollCallError: a process outside the job (uid unknown) wrote malformed rendezvous "
                             "records into the workers' store of generation 0 and the group failed to form: x")
    assert "a process outside the job (uid 65534) wrote" in failures.final(info).summary


class _PendingWork:
    """A collective that never completes (a member that says nothing); counts the waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


def test_missing_proofs_with_an_outsider_at_the_ports_fail_fast_and_without_one_wait_for_gloo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    monkeypatch.setattr(roll_call, "_LOOK_S", 0.01)
    work = _PendingWork()
    start = time.monotonic()
    with pytest.raises(roll_call._Silent):
        roll_call._wait(work, 60.0, lambda: True, silent_s=0.05)
    assert time.monotonic() - start < 5 and work.waits >= 2     # not gloo's 60 s
    looked: list[float] = []
    with pytest.raises(RuntimeError, match="timed out"):      # nobody else at the ports: gloo's own deadline
        roll_call._wait(_PendingWork(), 0.2, lambda: looked.append(1.0) or False, silent_s=0.05)
    assert looked
