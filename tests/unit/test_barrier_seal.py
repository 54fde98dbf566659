"""Barriers over per-node signed marks (agent/coordination/signed_records.py, job_state.Coordinator): the
agent whose mark completes the counter - or the lowest node - verifies the marks and seals them; the others
read the seal, so a barrier of N agents costs the store O(N) reads, not N*N. Over torch's HashStore; nothing
here starts a process or a thread, opens a socket or sleeps."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from fakes import KEY, RUN

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.job_state import Coordinator
from hyperpodrun.agent.ports import KVStore


class Counted:
    """A store connection that counts its operations."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.ops = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return attr(*args, **kwargs)
        return counted


def agents(n: int) -> tuple[list[Coordinator], list[Counted]]:
    raw = dist.HashStore()
    conns = [Counted(dist.PrefixStore(K.run_prefix(RUN), raw)) for _ in range(n)]
    return [Coordinator(c, n, 3, key=KEY, run_id=RUN, node_rank=i, on_forged=lambda name: None)   # type: ignore[arg-type]
            for i, c in enumerate(conns)], conns


def test_the_agent_that_completes_the_counter_seals_and_the_others_read_the_seal():
    coords, conns = agents(4)
    for c in coords[1:]:
        c.mark_ready(7)
    assert [c.ready_count(7) for c in coords] == [3, 3, 3, 3]
    coords[0].mark_ready(7)                        # the last mark: node 0's (also the lowest node)
    assert coords[2].ready_count(7) == 3, "not sealed yet: node 2 neither completed the counter nor is lowest"
    assert coords[0].ready_count(7) == 4           # it verifies the four marks and seals them
    before = [c.ops for c in conns]
    assert [c.ready_count(7) for c in coords[1:]] == [4, 4, 4]
    assert [c.ops - b for c, b in zip(conns[1:], before[1:])] == [2, 2, 2], "one signed record each"


def test_a_completer_that_is_not_the_lowest_node_seals_too():
    coords, _ = agents(3)
    coords[0].mark_ready(1)
    coords[1].mark_ready(1)
    coords[2].mark_ready(1)                        # node 2 completes the counter
    assert coords[1].ready_count(1) == 2
    assert coords[2].ready_count(1) == 3
    assert coords[1].ready_count(1) == 3


def test_a_mark_taken_back_breaks_the_seal():
    coords, _ = agents(3)
    for c in coords:
        c.mark_ready(2)
    assert coords[2].ready_count(2) == 3           # sealed
    coords[1].mark_ready(2, on=False)              # a rank of node 1 died after its node was ready
    assert [c.ready_count(2) for c in coords] == [2, 2, 2]
    coords[1].mark_ready(2)                        # ready again: node 1 completes the counter and seals anew
    assert coords[1].ready_count(2) == 3 and coords[2].ready_count(2) == 3


def test_a_forged_counter_is_no_barrier_and_no_seal():
    coords, conns = agents(3)
    coords[0].mark_ready(3)
    conns[0].inner.add(K.inprocess_ready(3), 2)     # the plain counter says 3; only node 0 signed a mark
    assert coords[0].ready_count(3) == 1
    assert not conns[0].inner.check([K.sealed(K.inprocess_ready(3))])


def test_a_barrier_of_n_agents_costs_the_store_o_n_operations():
    """Every agent marks, then every agent counts twice (two passes of its loop): about 9 operations per
    agent whatever N, where reading every mark would be 2N per agent."""
    for n in (8, 64):
        coords, conns = agents(n)
        for c in coords:
            c.mark_ready(5)
        start = sum(c.ops for c in conns)
        for _ in range(2):
            for c in reversed(coords):             # the completer (node n-1) counts first: it seals
                assert c.ready_count(5) == n
        per_agent = (sum(c.ops for c in conns) - start) / n
        assert per_agent < 10, (n, per_agent)


def test_the_left_count_is_read_in_full_by_whoever_asks():
    """Only the store host reads it (node.py), and it need not be the lowest node nor the last to leave."""
    coords, _ = agents(3)
    for c in coords:
        c.mark_left()
    assert coords[1].left_count() == 3
