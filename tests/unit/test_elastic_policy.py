"""The elastic part of the in-process round (agent/coordination/elastic.py, Elastic) on real Coordinators over torch's
in-memory HashStore: the store host shrinks the job when a lost node was not replaced in time and MIN nodes
remain (and only then), another node waits one --inprocess-timeout for that decision and follows the
host's layout, every node moves to the new layout at GO (new rank offsets, world size, group rank), and the
store host admits a newcomer at the next generation. A fixed-size job never changes layout.
Nothing here starts a process or a thread, opens a socket or sleeps."""
from __future__ import annotations

import logging
from typing import Any, Optional

import pytest
import torch.distributed as dist
from fakes import KEY, RUN, FakeClock, config

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.job_state import Coordinator, SignedRecords
from hyperpodrun.agent.coordination.elastic import Elastic
from hyperpodrun.agent.coordination.layout import LayoutRecords
from hyperpodrun.agent.coordination.membership import MemberRecords, tombstone
from hyperpodrun.agent.ports import KVStore, RendezvousInfo
from hyperpodrun.agent.rankstate import Round
from hyperpodrun.agent.coordination.store_schema import FailureInfo, Layout, NodeJoin, NodeLoss
from hyperpodrun.launch.config import LaunchConfig

NPROC = 2
INPROCESS_TIMEOUT = 60.0
REPLACE_TIMEOUT = 120.0
NOW = 5000.0


# ------------------------------------------------------------------ helpers
class Recorder:
    """The Events port: keeps every event."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, event: str, message: str = "", *, level: int = logging.INFO, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "message": message, "level": level, **fields}
        self.records.append(record)
        return record

    def named(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


def prefixed(raw: KVStore) -> KVStore:
    return dist.PrefixStore(K.run_prefix(RUN), raw)


def members_on(raw: KVStore) -> MemberRecords:
    return MemberRecords(SignedRecords(prefixed(raw), KEY, RUN, lambda name: None))


def layouts_on(raw: KVStore) -> LayoutRecords:
    return LayoutRecords(SignedRecords(prefixed(raw), KEY, RUN, lambda name: None))


def elastic_cfg(nnodes: int = 3, min_nodes: Optional[int] = 2, **overrides: Any) -> LaunchConfig:
    """`--nnodes MIN:MAX` (min_nodes None: a fixed size)."""
    return config(nnodes=nnodes, min_nodes=min_nodes, nproc_per_node=NPROC, inprocess_restart=True,
                  inprocess_timeout=INPROCESS_TIMEOUT, replace_timeout=REPLACE_TIMEOUT, node_rank=None,
                  **overrides)


class Agent:
    """One node's elastic policy over the shared store: its rendezvous info, Coordinator, events and clock."""

    def __init__(self, cfg: LaunchConfig, raw: KVStore, node: int, counts: dict[int, int], *,
                 incarnation: Optional[str] = None, admitted: Optional[Layout] = None,
                 layout_generation: int = -1) -> None:
        store = prefixed(raw)
        inc = incarnation if incarnation is not None else f"inc{node}"
        self.rdzv = RendezvousInfo(node_rank=node, nnodes=len(counts), rank_offset=sum(c for n, c in counts.items()
                                                                                      if n < node),
                                   world_size=sum(counts.values()), run_id=RUN, master_addr="127.0.0.1",
                                   store=store, store_host=node == 0, store_endpoint=("127.0.0.1", 1),
                                   single_node=cfg.single_node, incarnation=inc, counts=dict(counts),
                                   admitted=admitted, layout_generation=layout_generation)
        self.coord = Coordinator(store, cfg.nnodes, cfg.max_restarts, key=KEY, run_id=RUN, node_rank=node,
                                 on_forged=lambda name: None, incarnation=inc, nodes=lambda: self.rdzv.nodes)
        self.events = Recorder()
        self.clock = FakeClock(NOW)
        self.elastic = Elastic(cfg, self.rdzv, self.coord, self.events, self.clock)


def job(cfg: LaunchConfig, nodes: int = 3) -> tuple[list[Agent], KVStore]:
    """`nodes` agents of one job, each holding its node rank as incarnation "inc<n>"."""
    raw = dist.HashStore()
    counts = {n: NPROC for n in range(nodes)}
    agents = [Agent(cfg, raw, n, counts) for n in range(nodes)]
    for a in agents:
        assert members_on(raw).take_free(a.rdzv.node_rank, a.rdzv.incarnation)
    return agents, raw


def lose(raw: KVStore, *nodes: int, generation: int = 1) -> None:
    """The store host declared `nodes` lost (their holder records become tombstones)."""
    for n in nodes:
        members_on(raw).declare_lost(NodeLoss(node=n, incarnation=f"inc{n}", generation=generation, by_node=0,
                                              why="no lease renewal for 3.0s", wall_time=1.7e9))


def round_into(target: int, *awaiting: int) -> Round:
    """The round into `target`, waiting for the replacements of the lost nodes `awaiting`."""
    return Round(target=target, t_detect=NOW - REPLACE_TIMEOUT, root=FailureInfo(host="node 1", cause="node lost"),
                 deadline=NOW, grace_at=NOW, awaiting={n: f"inc{n}" for n in awaiting})


# ------------------------------------------------------------------ shrink (the store host)
def test_the_store_host_shrinks_while_min_nodes_remain():
    (host, _, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    r = round_into(1, 1)
    assert host.elastic.shrink(r, NOW)
    want = Layout(generation=1, nodes={0: NPROC, 2: NPROC}, previous_world_size=3 * NPROC)
    assert r.layout == want
    assert r.awaiting == {}, "the dropped node is no longer awaited"
    assert r.deadline == NOW + INPROCESS_TIMEOUT
    assert layouts_on(raw).at(1) == want and layouts_on(raw).latest() == want
    assert members_on(raw).holder(1) == "dropped:inc1"
    [event] = host.events.named("job_shrunk")
    assert (event["generation"], event["nodes"], event["world_size"], event["previous_world_size"]) == \
        (1, [0, 2], 2 * NPROC, 3 * NPROC)
    assert event["level"] == logging.WARNING and "node(s) 1 not replaced" in event["message"]


def test_the_store_host_refuses_to_shrink_below_min_nodes():
    (host, _, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1, 2)
    r = round_into(1, 1, 2)
    assert not host.elastic.shrink(r, NOW)
    assert r.layout is None and r.awaiting == {1: "inc1", 2: "inc2"} and r.deadline == NOW
    assert members_on(raw).holder(1) == tombstone("inc1") and members_on(raw).holder(2) == tombstone("inc2")
    assert layouts_on(raw).latest() is None
    assert host.events.records == []


def test_min_nodes_is_counted_against_the_nodes_the_job_runs_on_not_max():
    """A job of --nnodes 3:4 that formed with 3 nodes cannot lose one."""
    cfg = elastic_cfg(4, 3)
    (host, _, _), raw = job(cfg, nodes=3)
    lose(raw, 2)
    r = round_into(1, 2)
    assert not host.elastic.shrink(r, NOW)
    assert r.layout is None and members_on(raw).holder(2) == tombstone("inc2")


def test_the_store_host_shrinks_by_several_nodes_down_to_min():
    cfg = elastic_cfg(4, 2)
    (host, *_), raw = job(cfg, nodes=4)
    lose(raw, 1, 3)
    r = round_into(2, 1, 3)
    assert host.elastic.shrink(r, NOW)
    assert r.layout == Layout(generation=2, nodes={0: NPROC, 2: NPROC}, previous_world_size=4 * NPROC)
    assert r.awaiting == {}
    assert [members_on(raw).holder(n) for n in (1, 3)] == ["dropped:inc1", "dropped:inc3"]


def test_a_node_taken_over_before_the_shrink_is_not_dropped():
    (host, _, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    assert members_on(raw).take_over(1, "inc1", "new1")   # the replacement arrives as the timeout ends
    r = round_into(1, 1)
    assert host.elastic.shrink(r, NOW - 1.0), "the round goes on: it waits for the replacement's ranks"
    assert r.layout is None and r.awaiting == {1: "inc1"}
    assert r.deadline == NOW - 1.0 + INPROCESS_TIMEOUT
    assert members_on(raw).holder(1) == "new1"
    assert layouts_on(raw).latest() is None and host.events.named("job_shrunk") == []


def test_only_the_nodes_not_taken_over_are_dropped():
    cfg = elastic_cfg(4, 2)
    (host, *_), raw = job(cfg, nodes=4)
    lose(raw, 1, 2)
    assert members_on(raw).take_over(1, "inc1", "new1")
    r = round_into(1, 1, 2)
    assert host.elastic.shrink(r, NOW)
    assert r.layout is not None and r.layout.nodes == {0: NPROC, 1: NPROC, 3: NPROC}
    assert r.awaiting == {1: "inc1"}, "the replacement of node 1 is still awaited"
    assert members_on(raw).holder(1) == "new1" and members_on(raw).holder(2) == "dropped:inc2"


def test_a_second_shrink_in_the_same_round_leaves_out_the_second_node_too():
    cfg = elastic_cfg(4, 1)
    (host, *_), raw = job(cfg, nodes=4)
    lose(raw, 1)
    r = round_into(1, 1)
    assert host.elastic.shrink(r, NOW)
    assert r.layout is not None and sorted(r.layout.nodes) == [0, 2, 3]
    lose(raw, 2)                         # node 2 is lost too before GO, and not replaced in time either
    r.awaiting[2] = "inc2"
    assert host.elastic.shrink(r, NOW + REPLACE_TIMEOUT)
    assert members_on(raw).holder(2) == "dropped:inc2"
    assert sorted(r.layout.nodes) == [0, 3], "node 2 was dropped: the round must not wait for its READY"


# ------------------------------------------------------------------ shrink (any other node)
def test_another_node_waits_one_inprocess_timeout_for_the_store_host():
    (_, other, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    r = round_into(1, 1)
    assert other.elastic.shrink(r, NOW)
    assert r.shrink_wait and r.deadline == NOW + INPROCESS_TIMEOUT
    assert r.layout is None and r.awaiting == {1: "inc1"}
    assert members_on(raw).holder(1) == tombstone("inc1"), "only the store host drops a node"
    assert layouts_on(raw).latest() is None
    assert not other.elastic.shrink(r, NOW + INPROCESS_TIMEOUT), "the store host did not decide in time"


# ------------------------------------------------------------------ follow, excluded, nodes
def test_another_node_follows_the_store_hosts_layout():
    (host, _, other), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    mine = round_into(1, 1)
    other.elastic.follow(mine)
    assert mine.layout is None and mine.awaiting == {1: "inc1"}, "no decision yet"
    assert other.elastic.nodes(mine) == [0, 1, 2]
    assert host.elastic.shrink(round_into(1, 1), NOW)
    other.elastic.follow(mine)
    assert mine.layout == Layout(generation=1, nodes={0: NPROC, 2: NPROC}, previous_world_size=3 * NPROC)
    assert mine.awaiting == {}, "the dropped node is no longer awaited"
    assert other.elastic.nodes(mine) == [0, 2]
    assert not other.elastic.excluded(mine)


def test_a_layout_for_a_later_round_is_not_followed():
    (host, _, other), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    assert host.elastic.shrink(round_into(3, 1), NOW)
    mine = round_into(2, 1)
    other.elastic.follow(mine)
    assert mine.layout is None and mine.awaiting == {1: "inc1"}


def test_follow_takes_a_second_change_in_the_same_round():
    cfg = elastic_cfg(4, 1)
    (host, _, _, other), raw = job(cfg, nodes=4)
    lose(raw, 1)
    r_host, mine = round_into(1, 1), round_into(1, 1)
    assert host.elastic.shrink(r_host, NOW)
    other.elastic.follow(mine)
    assert sorted(mine.layout.nodes) == [0, 2, 3] and mine.awaiting == {}
    lose(raw, 2)
    r_host.awaiting[2] = "inc2"
    assert host.elastic.shrink(r_host, NOW + REPLACE_TIMEOUT)
    other.elastic.follow(mine)
    assert sorted(mine.layout.nodes) == [0, 3], "node 2 was dropped too: node 3 must not wait for it"


def test_the_node_left_out_is_excluded():
    (host, late, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    assert host.elastic.shrink(round_into(1, 1), NOW)
    mine = round_into(1)
    assert not late.elastic.excluded(mine)
    late.elastic.follow(mine)
    assert late.elastic.excluded(mine), "node 1 came back too late: the job went on without it"
    assert not host.elastic.excluded(mine)


def test_adopt_renumbers_the_remaining_nodes():
    (host, _, other), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    r0 = round_into(1, 1)
    assert host.elastic.shrink(r0, NOW)
    r2 = round_into(1, 1)
    other.elastic.follow(r2)
    assert other.elastic.adopt(r2) == r2.layout
    rdzv = other.rdzv
    assert (rdzv.rank_offset, rdzv.world_size, rdzv.group_rank, rdzv.nnodes) == (2, 4, 1, 2)
    assert rdzv.nodes == (0, 2) and rdzv.counts == {0: NPROC, 2: NPROC} and rdzv.previous_world_size == 6
    host.coord.mark_ready(2)
    other.coord.mark_ready(2)
    assert other.coord.ready_count(2) == 2 == len(rdzv.nodes), "the barrier now counts nodes 0 and 2 only"
    assert host.elastic.adopt(r0) == r0.layout
    assert (host.rdzv.rank_offset, host.rdzv.world_size, host.rdzv.group_rank) == (0, 4, 0)


def test_an_adopted_layout_is_not_followed_again():
    (host, _, other), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    assert host.elastic.shrink(round_into(1, 1), NOW)
    r = round_into(1, 1)
    other.elastic.follow(r)
    other.elastic.adopt(r)
    later = round_into(2)
    other.elastic.follow(later)
    assert later.layout is None, "generation 1's layout is the one this node runs on already"
    assert other.elastic.adopt(later) is None
    assert other.rdzv.world_size == 4


def test_a_replacement_that_started_on_the_layout_does_not_follow_it_again():
    (host, _, _), raw = job(elastic_cfg(3, 2))
    lose(raw, 1)
    assert host.elastic.shrink(round_into(1, 1), NOW)
    counts = {0: NPROC, 2: NPROC}
    late = Agent(elastic_cfg(3, 2), raw, 2, counts, incarnation="new2", layout_generation=1)
    r = round_into(2)
    late.elastic.follow(r)
    assert r.layout is None


def test_a_newcomer_follows_the_layout_it_was_admitted_with():
    (host, _), raw = job(elastic_cfg(3, 2), nodes=2)
    host.elastic.want_join(2, NodeJoin(incarnation="new2", nproc=NPROC, host="h2"))
    assert host.elastic.admission(0) is not None
    admitted = layouts_on(raw).at(1)
    assert admitted is not None
    newcomer = Agent(elastic_cfg(3, 2), raw, 2, dict(admitted.nodes), incarnation="new2", admitted=admitted,
                     layout_generation=1)
    r = round_into(1)
    newcomer.elastic.follow(r)
    assert r.layout == admitted, "its workers have yet to be told their place"


def test_adopt_without_a_layout_change_changes_nothing():
    (_, other, _), _ = job(elastic_cfg(3, 2))
    r = round_into(1)
    assert other.elastic.adopt(r) is None
    assert (other.rdzv.rank_offset, other.rdzv.world_size, other.rdzv.nodes) == (2, 6, (0, 1, 2))


# ------------------------------------------------------------------ grow (admission)
def test_the_store_host_admits_a_newcomer_at_the_next_generation():
    (host, _), raw = job(elastic_cfg(3, 1), nodes=2)
    join = NodeJoin(incarnation="new2", nproc=3, host="h2")
    host.elastic.want_join(2, join)
    info = host.elastic.admission(0)
    assert info is not None
    assert (info.cause, info.node, info.host, info.remote, info.generation) == ("node joins", 2, "h2", True, 0)
    assert "4 -> 7 ranks" in info.summary
    want = Layout(generation=1, nodes={0: NPROC, 1: NPROC, 2: 3}, previous_world_size=2 * NPROC)
    assert layouts_on(raw).at(1) == want and layouts_on(raw).latest() == want
    [event] = host.events.named("node_admitted")
    assert (event["node"], event["generation"], event["world_size"], event["previous_world_size"]) == (2, 1, 7, 4)
    assert host.elastic.joining == {}
    assert host.elastic.admission(0) is None, "admitted once"
    assert host.rdzv.counts == {0: NPROC, 1: NPROC}, "the host moves to the layout at GO, not before"


def test_a_newcomer_is_admitted_at_the_generation_after_the_current_one():
    (host, other), raw = job(elastic_cfg(3, 1), nodes=2)
    other.coord.request_restart(0, FailureInfo(host="h1", cause="boom"), count_budget=False)
    assert host.coord.generation() == 1
    host.elastic.want_join(2, NodeJoin(incarnation="new2", nproc=NPROC, host="h2"))
    info = host.elastic.admission(1)
    assert info is not None and info.generation == 1
    assert layouts_on(raw).at(2) is not None and layouts_on(raw).at(1) is None


def test_a_node_already_in_the_job_is_not_admitted_again():
    (host, _), raw = job(elastic_cfg(3, 1), nodes=2)
    host.elastic.want_join(1, NodeJoin(incarnation="x", nproc=NPROC, host="h1"))
    assert host.elastic.admission(0) is None
    assert host.elastic.joining == {} and layouts_on(raw).latest() is None
    assert host.events.named("node_admitted") == []


def test_a_job_at_max_nodes_admits_nobody():
    (host, _, _), raw = job(elastic_cfg(3, 1), nodes=3)
    host.elastic.want_join(3, NodeJoin(incarnation="x", nproc=NPROC, host="h3"))
    assert host.elastic.admission(0) is None
    assert host.elastic.joining == {} and layouts_on(raw).latest() is None


def test_a_request_turned_down_does_not_hold_up_the_next_one():
    (host, _), raw = job(elastic_cfg(3, 1), nodes=2)
    host.elastic.want_join(1, NodeJoin(incarnation="x", nproc=NPROC, host="h1"))
    host.elastic.want_join(2, NodeJoin(incarnation="new2", nproc=NPROC, host="h2"))
    info = host.elastic.admission(0)
    assert info is not None and info.node == 2
    assert layouts_on(raw).at(1) == Layout(generation=1, nodes={0: NPROC, 1: NPROC, 2: NPROC},
                                           previous_world_size=2 * NPROC)


def test_admission_waits_while_a_round_starts_elsewhere():
    (host, other), raw = job(elastic_cfg(3, 1), nodes=2)
    join = NodeJoin(incarnation="new2", nproc=NPROC, host="h2")
    host.elastic.want_join(2, join)
    other.coord.request_restart(0, FailureInfo(host="h1", cause="boom"), count_budget=False)
    assert host.elastic.admission(0) is None, "the store's generation moved: admit after that round"
    assert host.elastic.joining == {2: join}, "the request is kept"
    assert layouts_on(raw).latest() is None
    info = host.elastic.admission(1)
    assert info is not None and layouts_on(raw).at(2) is not None


def test_only_the_store_host_takes_join_requests():
    (_, other), _ = job(elastic_cfg(3, 1), nodes=2)
    other.elastic.want_join(2, NodeJoin(incarnation="new2", nproc=NPROC, host="h2"))
    assert other.elastic.joining == {} and other.elastic.admission(0) is None


# ------------------------------------------------------------------ fixed-size jobs
@pytest.mark.parametrize("store_host", [True, False])
def test_a_fixed_size_job_never_changes_layout(store_host: bool):
    cfg = elastic_cfg(3, None)
    assert not cfg.elastic
    agents, raw = job(cfg)
    a = agents[0 if store_host else 2]
    assert not a.elastic.on
    lose(raw, 1)
    LayoutRecords(a.coord.records).claim(Layout(generation=1, nodes={0: NPROC, 2: NPROC}, previous_world_size=6))
    r = round_into(1, 1)
    a.elastic.follow(r)
    assert r.layout is None and r.awaiting == {1: "inc1"}
    assert not a.elastic.excluded(r) and a.elastic.adopt(r) is None
    assert not a.elastic.shrink(r, NOW)
    assert r.deadline == NOW and not r.shrink_wait and members_on(raw).holder(1) == tombstone("inc1")
    a.elastic.want_join(3, NodeJoin(incarnation="x", nproc=NPROC, host="h3"))
    assert a.elastic.joining == {} and a.elastic.admission(0) is None
    assert a.events.records == [] and a.rdzv.world_size == 6


def test_a_single_node_elastic_config_is_no_elastic_job():
    cfg = elastic_cfg(3, 1, single_node=True)
    raw = dist.HashStore()
    a = Agent(cfg, raw, 0, {0: NPROC})
    assert not a.elastic.on
    r = round_into(1, 1)
    assert not a.elastic.shrink(r, NOW)
