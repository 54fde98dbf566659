"""A job on a standalone coordinator (agent/coordination/coordinator.py): no agent hosts the coordination store,
so each generation's workers' store is hosted by the first live agent that needs it and published with its
address; and an agent that both watches every lease and follows the declared losses hears of each loss once."""
from __future__ import annotations

from typing import Any

import pytest

from fakes import Harness, config, shared_store
from hyperpodrun.agent.coordination.coordinator import MARKER, is_coordinator
from hyperpodrun.agent.coordination.membership import once_each
from hyperpodrun.agent.coordination.rendezvous import Seat, _StoreRendezvous
from hyperpodrun.agent.ports import KVStore
from hyperpodrun.errors import RendezvousError
from hyperpodrun.launch.config import LaunchConfig


def two_nodes() -> tuple[Harness, Harness]:
    cfg = config(nnodes=2, inprocess_restart=True)
    store = shared_store()
    return (Harness(cfg, node_rank=0, store=store, coordinator=True),
            Harness(cfg, node_rank=1, store=store, coordinator=True))


def test_the_first_agent_to_need_a_generations_store_hosts_it_and_publishes_its_address() -> None:
    n0, n1 = two_nodes()
    assert not n0.rdzv.store_host and not n1.rdzv.store_host
    n1.node.open_worker_store(1)          # node 1 begins the round first: it hosts generation 1's store
    n0.node.open_worker_store(1)          # node 0 finds it claimed: it opens none
    assert n1.wstores is not None and n0.wstores is not None
    assert 1 in n1.wstores.opened and 1 not in n0.wstores.opened
    for h in (n0, n1):                    # both read the same place: node 1's address and port
        assert h.coord.worker_store_port(1) == 30001
        assert h.coord.worker_store_addr(1) == n1.rdzv.bind_addr
    n0.node.open_worker_store(2)          # another generation, another claim: node 0 now
    assert 2 in n0.wstores.opened and 2 not in n1.wstores.opened


def test_a_node_hosted_store_publishes_the_port_alone() -> None:
    h = Harness(config(nnodes=2, inprocess_restart=True), node_rank=0)
    h.node.open_worker_store(1)
    assert h.coord.worker_store_port(1) == 30001 and h.coord.worker_store_addr(1) is None


def test_each_loss_and_replacement_is_told_once_whoever_saw_it_first() -> None:
    told: set[tuple[object, ...]] = set()
    watched = [("node_lost", (0, "inc0", "no lease renewal for 3.0s"))]
    assert once_each(watched, told) == watched
    declared = [("node_lost", (0, "inc0", "no lease renewal for 3.1s (by node 2)")), ("spare", ("s", "h"))]
    assert once_each(declared, told) == [("spare", ("s", "h"))]
    joined = [("node_joined", (0, "inc9"))]
    assert once_each(joined, told) == joined and once_each(joined, told) == []
    assert once_each([("node_lost", (0, "inc9", "again"))], told)   # the replacement lost in turn: news again


class _OnCoordinator(_StoreRendezvous):
    """The rendezvous over an in-memory store that a coordinator marked (no sockets: the test is the decision)."""

    def __init__(self, raw: KVStore) -> None:
        super().__init__()
        self.raw = raw

    def open_store(self, cfg: LaunchConfig) -> tuple[KVStore, bool, str, str, int]:
        return self.raw, False, "", "127.0.0.1", 29400

    def node_rank(self, *args: Any) -> Seat:
        raise AssertionError("an elastic job on a coordinator is refused before it takes a node rank")


def test_an_elastic_job_on_a_coordinator_is_refused_with_one_line() -> None:
    raw = shared_store()
    raw.set(MARKER, "1")
    assert is_coordinator(raw) and not is_coordinator(shared_store())
    cfg = config(nnodes=3, min_nodes=2, rdzv_backend="c10d")
    with pytest.raises(RendezvousError, match="standalone coordinator.*elastic.*--nnodes N"):
        _OnCoordinator(raw).join(cfg, lambda: False)
