"""A standalone coordinator started again empty (agent/coordination/reconnect.py, agent/coordination/resupply.py):
connections wait for it with backoff and go on, each agent writes back what it holds once per coordinator
start, the agents agree on the generation and the restart budget whatever order they write back in, a
node declared lost stays fenced, nothing unsigned goes back, and the lease watch gives every node a fresh
timeout. On the fake clock, over in-memory stores (one real TCPStore pair for what torch itself does)."""
from __future__ import annotations

import json
from typing import Any, Callable, Optional, cast

import pytest
import torch.distributed as dist
from fakes import KEY, RUN, FakeClock

from hyperpodrun import auth
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.coordinator import EPOCH, MARKER, CoordinatorServer
from hyperpodrun.agent.coordination.job_state import Coordinator
from hyperpodrun.agent.coordination.membership import LeaseWatch
from hyperpodrun.agent.coordination.reconnect import CoordinatorLink, CoordinatorLost, Ledger, coordinator_link
from hyperpodrun.agent.coordination.resupply import Resupply, merged
from hyperpodrun.agent.coordination.signed_records import SignedRecords
from hyperpodrun.agent.coordination.store_schema import FailureInfo, NodeLease
from hyperpodrun.agent.ports import KVStore, Posted
from hyperpodrun.errors import RendezvousError

CAUSE = FailureInfo(host="h", rank=1, summary="rank 1 raised")


class DistNetworkError(RuntimeError):
    """Named as torch's: what a TCPStore client raises once its server is gone."""


class FakeCoordinator:
    """A coordinator that can be killed and started again empty, under a new epoch."""

    def __init__(self) -> None:
        self.starts = 0
        self.server: Optional[Any] = None
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.server = dist.HashStore()
        self.server.set(EPOCH, f"epoch{self.starts}")
        self.server.set(MARKER, "1")

    def kill(self) -> None:
        self.server = None

    def open(self, _timeout_s: float) -> KVStore:
        if self.server is None:
            raise RendezvousError("cannot reach the coordination store at h:1: connection refused")
        return cast(KVStore, _Client(self, self.server))


class _Client:
    """A client of one server: every call fails once that server is gone (as a TCPStore client's does)."""

    def __init__(self, coordinator: FakeCoordinator, server: Any) -> None:
        self._coordinator = coordinator
        self._server = server

    def __getattr__(self, name: str) -> Callable[..., Any]:
        attr = getattr(self._server, name)

        def call(*args: Any) -> Any:
            if self._coordinator.server is not self._server:
                raise DistNetworkError("Broken pipe")
            return attr(*args)
        return call


class Agent:
    """One agent's link to the fake coordinator, and its job records over one of the link's connections."""

    def __init__(self, fake: FakeCoordinator, clock: FakeClock, node: int, timeout_s: float = 60.0,
                 sleep: Optional[Callable[[float], None]] = None) -> None:
        self.posted: list[Posted] = []
        self.link = CoordinatorLink("h:1", fake.open, lambda raw: raw, timeout_s=timeout_s,
                                    epoch=f"epoch{fake.starts}", clock=clock, sleep=sleep or clock.advance)
        self.link.post = self.posted.append
        self.link.resupply = Resupply(KEY, RUN)
        self.coord = self.records_on(self.link.connect())

    def records_on(self, store: KVStore) -> Coordinator:
        return Coordinator(store, 2, 10, key=KEY, run_id=RUN, node_rank=0, on_forged=lambda name: None)

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.posted]


def back_after(fake: FakeCoordinator, clock: FakeClock, seconds: float) -> Callable[[float], None]:
    """A sleep that starts the coordinator again once `seconds` of fake time have passed."""
    at = clock.now + seconds

    def sleep(s: float) -> None:
        clock.advance(s)
        if fake.server is None and clock.now >= at:
            fake.start()
    return sleep


# ------------------------------------------------------------------ what torch does, what the adapter does
def test_a_torch_store_client_does_not_reconnect_by_itself_and_a_link_does() -> None:
    """On the pinned torch, a TCPStore client whose server was started again keeps failing; a connection of
    the link reconnects, and finds the records its agent wrote back."""
    first = CoordinatorServer("127.0.0.1", 0)
    port = first.start()
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    link = coordinator_link("127.0.0.1", port, RUN, raw, timeout_s=30)
    link.resupply = Resupply(KEY, RUN)
    coord = Coordinator(link.connect(), 2, 3, key=KEY, run_id=RUN, node_rank=0, on_forged=lambda name: None)
    assert coord.request_restart(0, CAUSE).generation == 1
    first.close()
    second = CoordinatorServer("127.0.0.1", port)
    assert second.start() == port
    try:
        with pytest.raises(RuntimeError):
            raw.check([MARKER])            # torch's own client: its connection is gone for good
        assert coord.generation() == 1 and coord.restarts_used() == 1
        assert link.reconnects == 1
    finally:
        second.close()


def test_a_call_waits_for_the_coordinator_and_goes_on_once_it_is_back() -> None:
    fake, clock = FakeCoordinator(), FakeClock()
    agent = Agent(fake, clock, 0, sleep=None)
    agent.coord.request_restart(0, CAUSE)
    fake.kill()
    agent.link._sleep = back_after(fake, clock, 3.0)
    start = clock.now
    assert agent.coord.generation() == 1 and agent.coord.restarts_used() == 1   # written back, then read
    assert clock.now - start >= 3.0
    assert agent.kinds() == ["coordinator_lost", "coordinator_back"]
    assert agent.link.reconnects == 1 and not agent.link.down


def test_a_coordinator_that_stays_away_ends_the_wait_after_the_timeout() -> None:
    fake, clock = FakeCoordinator(), FakeClock()
    agent = Agent(fake, clock, 0, timeout_s=5.0)
    agent.coord.generation()
    fake.kill()
    start = clock.now
    with pytest.raises(CoordinatorLost, match="unreachable for 5s.*coordinator_timeout 5s"):
        agent.coord.generation()
    assert 5.0 <= clock.now - start < 5.5
    assert agent.kinds() == ["coordinator_lost"]


def test_a_quick_restart_noticed_late_is_still_told_and_written_back() -> None:
    """Killed and started again between two calls: the next call reconnects at once, and the new epoch says
    the store is empty - the outage is told, and the records go back."""
    fake, clock = FakeCoordinator(), FakeClock()
    agent = Agent(fake, clock, 0)
    agent.coord.request_restart(0, CAUSE)
    fake.kill()
    fake.start()
    assert agent.coord.generation() == 1
    assert agent.kinds() == ["coordinator_lost", "coordinator_back"]


# ------------------------------------------------------------------ agreeing on the write-back
@pytest.mark.parametrize("first", ["behind", "ahead"])
def test_the_agents_agree_on_the_newest_generation_and_count_the_budget_once(first: str) -> None:
    """Agent `ahead` saw the job move to generation 2 (two restarts counted), agent `behind` only to 1. Whoever
    writes back first, the store holds generation 2 and 2 restarts spent; the next restart, asked for by
    both, is counted once."""
    fake, clock = FakeCoordinator(), FakeClock()
    ahead, behind = Agent(fake, clock, 0), Agent(fake, clock, 1)
    ahead.coord.request_restart(0, CAUSE)
    assert behind.coord.request_restart(0, CAUSE).generation == 1     # joins generation 1, reads the budget
    ahead.coord.request_restart(1, CAUSE)
    fake.kill()
    fake.start()
    agents = [behind, ahead] if first == "behind" else [ahead, behind]
    for agent in agents:
        agent.coord.restarts_used()       # the first call after the restart writes the agent's records back
    for agent in agents:
        assert agent.coord.generation() == 2 and agent.coord.restarts_used() == 2
    grants = [behind.coord.request_restart(2, CAUSE), ahead.coord.request_restart(2, CAUSE)]
    assert [g.generation for g in grants] == [3, 3] and [g.started for g in grants] == [True, False]
    assert ahead.coord.restarts_used() == 3


def test_a_record_an_agent_only_checked_goes_back_too() -> None:
    """The rendezvous' `ready` is written by the last agent to join; the others only check it. Once its writer
    is gone (its node lost and replaced), a coordinator started again must still learn from the agents left
    that the job was formed - else a replacement that comes next starts a new rendezvous as node 0 and the
    job waits for it until --replace-timeout (found by scripts/bench/soak.py)."""
    fake, clock = FakeCoordinator(), FakeClock()
    writer, checker = Agent(fake, clock, 0), Agent(fake, clock, 1)
    writer_store, checker_store = writer.link.connect(), checker.link.connect()
    writer_store.set(K.RDZV_READY, "1")
    assert checker_store.check([K.RDZV_READY]) and not checker_store.check([K.RDZV_SIZE])
    writer.link.ledger = Ledger()         # its node is gone: nothing of it is written back
    fake.kill()
    fake.start()
    assert not checker_store.check([K.RDZV_SIZE])      # the first call after the restart writes back
    assert fake.server is not None and fake.server.check([K.RDZV_READY])
    assert checker.link.ledger.knows(K.RDZV_READY) and not checker.link.ledger.knows(K.RDZV_SIZE)


def test_one_write_back_per_agent_whichever_connection_comes_first() -> None:
    """An agent's connections (the loop's, the watcher's) reconnect one after the other: its records go back
    once, so the counters beside the per-node marks are not counted twice."""
    fake, clock = FakeCoordinator(), FakeClock()
    a, b = Agent(fake, clock, 0), Agent(fake, clock, 1)
    b.coord = Coordinator(b.link.connect(), 2, 10, key=KEY, run_id=RUN, node_rank=1, on_forged=lambda n: None)
    watcher = a.coord.view(a.link.connect())
    a.coord.mark_done(0)
    b.coord.mark_done(0)
    assert watcher.done_count(0) == 2
    fake.kill()
    fake.start()
    assert watcher.done_count(0) == 2 and a.coord.done_count(0) == 2     # both of a's connections
    assert b.coord.done_count(0) == 2
    assert a.link.reconnects == 1 and b.link.reconnects == 1
    assert fake.server is not None and int(fake.server.add(K.done(0), 0)) == 2


def test_the_holder_records_keep_a_loss_declared_and_a_replacement_in_its_rank() -> None:
    holder = K.node_holder(1)
    assert merged(holder, "inc1", "lost:inc1") is None            # a zombie cannot undo its loss
    assert merged(holder, "lost:inc1", "inc1") == "lost:inc1"     # the loss beats the incarnation it names
    assert merged(holder, "inc2", "lost:inc1") == "inc2"          # a replacement took the rank over since
    assert merged(holder, "lost:inc1", "inc2") is None
    assert merged(holder, "inc1", "inc2") is None                 # two live ones: the store's stays
    assert merged(holder, "inc1", None) == "inc1"
    assert merged(K.GENERATION, "3", "4") is None and merged(K.GENERATION, "5", "4") == "5"
    a = json.dumps([{"node": 1, "incarnation": "i1"}])
    b = json.dumps([{"node": 0, "incarnation": "i0"}])
    assert {x["incarnation"] for x in json.loads(merged(K.NODE_LOSSES, a, b) or "")} == {"i0", "i1"}
    assert merged(K.NODE_LOSSES, a, a) is None
    assert merged(K.restart_claim(2), "mine", "theirs") is None   # first claim wins, as before


def test_nothing_unsigned_is_written_back_and_what_goes_back_is_signed() -> None:
    """A value this agent read that does not verify under the job's key (something outside the job wrote it)
    is dropped; what goes back verifies; the plain rendezvous records go back as they were."""
    ledger = Ledger()
    ours = SignedRecords(dist.HashStore(), KEY, RUN, forged=lambda name: None)
    other = SignedRecords(dist.HashStore(), auth.derive(b"another secret", "store"), RUN, forged=lambda n: None)
    ours.write(K.FAILED, CAUSE.to_json())
    other.write(K.GENERATION, "99")
    ledger.saw(K.FAILED, bytes(ours.store.get(K.FAILED)))
    ledger.saw(K.GENERATION, bytes(other.store.get(K.GENERATION)))
    ledger.saw(K.root_cause(1), b"plain text")
    ledger.saw(K.AUTH, b"user:abc")
    ledger.counted(K.RDZV_COUNTER, 2)
    empty = dist.HashStore()
    Resupply(KEY, RUN)(empty, ledger)
    assert not empty.check([K.GENERATION]) and not empty.check([K.root_cause(1)])
    back = SignedRecords(empty, KEY, RUN, forged=lambda name: pytest.fail(f"{name} went back unsigned"))
    assert back.read(K.FAILED) == CAUSE.to_json()
    assert bytes(empty.get(K.AUTH)) == b"user:abc" and int(empty.add(K.RDZV_COUNTER, 0)) == 2


# ------------------------------------------------------------------ leases after a restart
def test_leases_get_a_whole_timeout_after_the_store_came_back() -> None:
    """Node 1 renewed until the coordinator went away; nobody could renew or watch for 10 s. After the grace,
    it is not lost at once - only if it does not renew within the timeout from then. A watch given no grace
    would declare it lost at once (the grace is what keeps it)."""
    def state(count: int) -> dict[int, tuple[Optional[str], Optional[NodeLease]]]:
        return {1: ("inc1", NodeLease(incarnation="inc1", count=count))}
    kept, plain = LeaseWatch(0, 2, 3.0), LeaseWatch(0, 2, 3.0)
    for watch in (kept, plain):
        watch.observe(0.0, state(1))
        watch.observe(1.0, state(2))
    kept.grace(11.0)
    assert kept.observe(11.5, state(2)) == []
    assert [kind for kind, _ in plain.observe(11.5, state(2))] == ["node_lost"]
    assert kept.observe(13.9, state(2)) == []
    assert [kind for kind, _ in kept.observe(14.1, state(2))] == ["node_lost"]


# ------------------------------------------------------------------ the setting
@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_bad_coordinator_timeout_is_a_one_line_error(value: str) -> None:
    from hyperpodrun.errors import ConfigError
    from hyperpodrun.launch.config import _conf_seconds
    assert _conf_seconds({"coordinator_timeout": "12.5"}, "coordinator_timeout", 300.0, zero_ok=False) == 12.5
    assert _conf_seconds({}, "coordinator_timeout", 300.0, zero_ok=False) == 300.0
    with pytest.raises(ConfigError) as err:
        _conf_seconds({"coordinator_timeout": value}, "coordinator_timeout", 300.0, zero_ok=False)
    assert f"coordinator_timeout={value}" in str(err.value) and "\n" not in str(err.value)
