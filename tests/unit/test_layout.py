"""Elastic layouts (agent/coordination/layout.py) and what they build on: the pure helpers (shrunk, grown, free_ranks), the
Layout and NodeJoin records (agent/coordination/store_schema.py), the layout records over torch's in-memory HashStore
(first claim per generation wins, the newest only moves forward, the layout a round moves to, join
requests), the membership records of a shrink (MemberRecords.drop / take_unused, vacancy), counting
per-node marks over the job's node ranks now (SignedRecords.count, Coordinator(nodes=...)), and the
elastic flags (`--nnodes MIN:MAX`, `--rdzv-conf last_call_timeout`).
Nothing here starts a process or a thread, opens a socket or sleeps."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch.distributed as dist
from fakes import KEY, RUN

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.job_state import Coordinator, SignedRecords
from hyperpodrun.agent.coordination.layout import LayoutRecords, free_ranks, grown, shrunk
from hyperpodrun.agent.coordination.membership import MemberRecords, tombstone
from hyperpodrun.agent.ports import KVStore
from hyperpodrun.agent.coordination.store_schema import Layout, NodeJoin, NodeLoss
from hyperpodrun.cli import _env_sources, launch
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import ConfigError, FencedError
from hyperpodrun.launch.flags import build_config


# ------------------------------------------------------------------ helpers
def prefixed(raw: KVStore) -> KVStore:
    """A connection to the run's keys, as the agents see the store."""
    return dist.PrefixStore(K.run_prefix(RUN), raw)


def signed(raw: KVStore, forged: Optional[list[str]] = None) -> SignedRecords:
    """One agent's signed records over `raw` (each store connection has its own)."""
    sink = forged if forged is not None else []
    return SignedRecords(prefixed(raw), KEY, RUN, sink.append)


def layouts_on(raw: KVStore, forged: Optional[list[str]] = None) -> LayoutRecords:
    return LayoutRecords(signed(raw, forged))


def members_on(raw: KVStore) -> MemberRecords:
    return MemberRecords(signed(raw))


def coordinator(raw: KVStore, node_rank: int, incarnation: str = "", nnodes: int = 3, nodes=None,
                forged: Optional[list[str]] = None) -> Coordinator:
    sink = forged if forged is not None else []
    return Coordinator(prefixed(raw), nnodes, 3, key=KEY, run_id=RUN, node_rank=node_rank,
                       on_forged=sink.append, incarnation=incarnation, nodes=nodes)


def loss_of(node: int, incarnation: str, generation: int = 1) -> NodeLoss:
    return NodeLoss(node=node, incarnation=incarnation, generation=generation, by_node=0,
                    why="no lease renewal for 3.0s", wall_time=1.7e9)


def lay(generation: int, nodes: dict[int, int], previous: Optional[int] = None) -> Layout:
    return Layout(generation=generation, nodes=nodes, previous_world_size=previous)


# ------------------------------------------------------------------ pure helpers
def test_shrunk_leaves_out_the_lost_nodes_and_remembers_the_old_world_size():
    counts = {0: 2, 1: 2, 2: 2}
    out = shrunk(counts, [1], generation=4)
    assert out == Layout(generation=4, nodes={0: 2, 2: 2}, previous_world_size=6)
    assert out.world_size == 4
    assert counts == {0: 2, 1: 2, 2: 2}, "the caller's counts are not changed"


def test_shrunk_without_several_nodes_and_with_unknown_ones():
    out = shrunk({0: 1, 1: 2, 2: 3, 3: 4}, iter([3, 1, 7]), generation=2)   # any iterable; 7 is not in the job
    assert out.nodes == {0: 1, 2: 3} and out.previous_world_size == 10 and out.world_size == 4


def test_grown_adds_the_newcomer_with_its_worker_count():
    counts = {0: 2, 2: 2}
    out = grown(counts, node=1, nproc=3, generation=5)
    assert out == Layout(generation=5, nodes={0: 2, 1: 3, 2: 2}, previous_world_size=4)
    assert out.world_size == 7
    assert counts == {0: 2, 2: 2}, "the caller's counts are not changed"


def test_free_ranks_are_the_unused_ranks_below_max_lowest_first():
    assert free_ranks([2, 0], 4) == [1, 3]
    assert free_ranks(range(3), 3) == []
    assert free_ranks([], 2) == [0, 1]
    assert free_ranks([0, 5], 3) == [1, 2], "a rank at or above the maximum is never free"


# ------------------------------------------------------------------ the Layout and NodeJoin records
def test_global_ranks_are_handed_out_node_by_node_in_node_rank_order():
    layout = lay(3, {4: 1, 0: 2, 2: 3})      # not in rank order, uneven worker counts
    assert layout.world_size == 6
    assert (layout.offset(0), layout.offset(2), layout.offset(4)) == (0, 2, 5)
    assert (layout.index(0), layout.index(2), layout.index(4)) == (0, 1, 2)


def test_a_layout_survives_its_json_with_integer_node_ranks():
    layout = lay(7, {0: 2, 3: 1}, previous=5)
    back = Layout.model_validate_json(layout.model_dump_json())
    assert back == layout
    assert set(back.nodes) == {0, 3} and all(isinstance(n, int) for n in back.nodes)
    assert back.offset(3) == 2 and back.index(3) == 1


def test_a_newer_agents_fields_are_ignored():
    layout = Layout.model_validate_json('{"generation": 2, "nodes": {"1": 4}, "zone": "a"}')
    assert layout == lay(2, {1: 4}) and layout.previous_world_size is None
    join = NodeJoin.model_validate_json('{"incarnation": "i", "nproc": 8, "host": "h", "gpus": 8}')
    assert join == NodeJoin(incarnation="i", nproc=8, host="h")


# ------------------------------------------------------------------ LayoutRecords
def test_no_layout_change_yet():
    records = layouts_on(dist.HashStore())
    assert records.latest() is None and records.at(0) is None and records.for_round(5) is None


def test_a_second_change_in_the_same_generation_replaces_the_first_on_every_connection():
    raw = dist.HashStore()
    first, second = lay(2, {0: 2, 2: 2, 3: 2}, 8), lay(2, {0: 2, 3: 2}, 8)
    assert layouts_on(raw).claim(first) == first
    assert layouts_on(raw).claim(second) == second, "the store host shrank again in the same round"
    reader = layouts_on(raw)
    assert reader.at(2) == second and reader.latest() == second


def test_the_newest_layout_only_moves_forward():
    raw = dist.HashStore()
    records = layouts_on(raw)
    newer, older = lay(5, {0: 2}, 4), lay(3, {0: 2, 1: 2}, 6)
    records.claim(newer)
    assert records.claim(older) == older
    assert records.at(3) == older and records.at(5) == newer
    assert layouts_on(raw).latest() == newer, "an older generation's claim does not replace the newest"
    newest = lay(6, {0: 2, 1: 3}, 2)
    records.claim(newest)
    assert layouts_on(raw).latest() == newest


def test_the_layout_of_a_round_is_the_newest_unless_it_is_for_a_later_round():
    raw = dist.HashStore()
    records = layouts_on(raw)
    records.claim(lay(3, {0: 2, 2: 2}, 6))
    assert records.for_round(2) is None, "the change is for generation 3: the round into 2 keeps the old nodes"
    assert records.for_round(3) == lay(3, {0: 2, 2: 2}, 6)
    assert records.for_round(9) == lay(3, {0: 2, 2: 2}, 6), "no change since: the round into 9 runs on it too"
    records.claim(lay(5, {0: 2}, 4))
    assert records.for_round(4) is None, "the newest is for generation 5"
    assert records.for_round(5) == lay(5, {0: 2}, 4)


def test_a_layout_record_not_signed_with_the_jobs_key_is_ignored_and_reported():
    raw = dist.HashStore()
    prefixed(raw).set(K.LAYOUT, '{"generation": 1, "nodes": {"0": 1}}')   # something outside the job
    forged: list[str] = []
    assert layouts_on(raw, forged).latest() is None
    assert forged == [K.LAYOUT]


def test_a_join_request_is_read_back_for_its_node_only():
    raw = dist.HashStore()
    join = NodeJoin(incarnation="new3", nproc=4, host="h3")
    layouts_on(raw).ask_to_join(3, join)
    reader = layouts_on(raw)
    assert reader.join_request(3) == join
    assert reader.join_request(2) is None


# ------------------------------------------------------------------ membership: take_unused and drop
def test_an_unused_rank_never_held_is_taken():
    raw = dist.HashStore()
    assert members_on(raw).take_unused(2, "new2")
    assert members_on(raw).holder(2) == "new2"


def test_an_unused_rank_is_held_by_one_newcomer_only():
    raw = dist.HashStore()
    assert members_on(raw).take_unused(2, "a")
    assert not members_on(raw).take_unused(2, "b")
    assert members_on(raw).holder(2) == "a"


def test_a_live_holders_rank_is_not_unused():
    raw = dist.HashStore()
    assert members_on(raw).take_free(1, "inc1")
    assert not members_on(raw).take_unused(1, "new1")
    assert members_on(raw).holder(1) == "inc1"


def test_a_lost_rank_that_was_not_dropped_is_for_its_replacement_only():
    raw = dist.HashStore()
    members = members_on(raw)
    assert members.take_free(1, "inc1")
    members.declare_lost(loss_of(1, "inc1"))
    assert members.holder(1) == tombstone("inc1")
    assert not members_on(raw).take_unused(1, "new1")
    assert members_on(raw).holder(1) == tombstone("inc1")


def test_drop_turns_the_tombstone_into_dropped_and_frees_the_rank_for_a_newcomer():
    raw = dist.HashStore()
    members = members_on(raw)
    assert members.take_free(1, "inc1")
    members.declare_lost(loss_of(1, "inc1"))
    assert members.drop(1, "inc1")
    assert members_on(raw).holder(1) == K.node_dropped("inc1") == "dropped:inc1"
    assert members.drop(1, "inc1"), "dropping again is no change, and still a drop"
    assert members_on(raw).take_unused(1, "new1")
    assert members_on(raw).holder(1) == "new1"


def test_a_dropped_rank_is_not_taken_over_as_a_replacement():
    raw = dist.HashStore()
    members = members_on(raw)
    assert members.take_free(1, "inc1")
    members.declare_lost(loss_of(1, "inc1"))
    assert members.drop(1, "inc1")
    assert not members_on(raw).take_over(1, "inc1", "late")
    assert members_on(raw).holder(1) == "dropped:inc1"


def test_drop_loses_to_a_replacement_that_took_the_rank_first():
    raw = dist.HashStore()
    members = members_on(raw)
    assert members.take_free(1, "inc1")
    members.declare_lost(loss_of(1, "inc1"))
    assert members_on(raw).take_over(1, "inc1", "new1")
    assert not members.drop(1, "inc1")
    assert members_on(raw).holder(1) == "new1", "the replacement keeps its rank"


def test_drop_of_another_incarnation_changes_nothing():
    raw = dist.HashStore()
    members = members_on(raw)
    assert members.take_free(1, "inc1")
    members.declare_lost(loss_of(1, "inc1"))
    assert not members.drop(1, "other")
    assert members_on(raw).holder(1) == tombstone("inc1"), "inc1's rank is still for its replacement"
    raw2 = dist.HashStore()
    live = members_on(raw2)
    assert live.take_free(1, "inc1")
    assert not live.drop(1, "inc1"), "a live holder was never declared lost: nothing to drop"
    assert members_on(raw2).holder(1) == "inc1"


def test_a_dropped_rank_is_no_vacancy():
    raw = dist.HashStore()
    members = members_on(raw)
    for n in range(3):
        assert members.take_free(n, f"inc{n}")
    members.declare_lost(loss_of(1, "inc1"))
    members.declare_lost(loss_of(2, "inc2"))
    vacancy = members_on(raw).vacancy(3)
    assert vacancy is not None and vacancy[:2] == (1, "inc1")
    assert members.drop(1, "inc1")
    vacancy = members_on(raw).vacancy(3)
    assert vacancy is not None and vacancy[:2] == (2, "inc2"), "node 1 was dropped: node 2 is the vacancy"
    assert members.drop(2, "inc2")
    assert members_on(raw).vacancy(3) is None


# ------------------------------------------------------------------ counting marks over the job's nodes
def test_count_counts_only_the_given_nodes():
    raw = dist.HashStore()
    forged: list[str] = []
    records = signed(raw, forged)
    for n in (0, 1, 2):
        records.mark("m", n)
    assert signed(raw).count("m", [0, 2]) == 2
    assert signed(raw).count("m", [0, 1, 2]) == 3
    assert forged == []


def test_count_waits_for_every_given_node():
    raw = dist.HashStore()
    records = signed(raw)
    records.mark("m", 0)
    records.mark("m", 1)             # node 1 is outside the job now (dropped)
    forged: list[str] = []
    assert signed(raw, forged).count("m", [0, 2]) == 1, "node 2 has not marked: the barrier is not complete"
    assert forged == []


def test_marks_of_nodes_outside_the_job_are_no_forgery():
    raw = dist.HashStore()
    records = signed(raw)
    for n in (1, 2, 3):
        records.mark("m", n)         # nodes 1 and 2 dropped after they marked; node 0 has not marked yet
    forged: list[str] = []
    assert signed(raw, forged).count("m", [0, 3]) == 1
    assert forged == []


def test_marks_of_higher_ranked_nodes_outside_the_job_are_no_forgery():
    raw = dist.HashStore()
    records = signed(raw)
    for n in (1, 2, 3):
        records.mark("m", n)         # nodes 2 and 3 dropped after they marked; node 0 has not marked yet
    forged: list[str] = []
    assert signed(raw, forged).count("m", [0, 1]) == 1
    assert forged == []


def test_below_the_list_size_the_count_is_the_counter_an_upper_bound_that_never_completes_the_barrier():
    raw = dist.HashStore()
    records = signed(raw)
    records.mark("m", 0)
    records.mark("m", 3)             # node 3 is not in the list: counted by the plain counter, never by the marks
    assert signed(raw).count("m", [0, 1, 2]) == 2 < 3
    records.mark("m", 1)
    assert signed(raw).count("m", [0, 1, 2]) == 2   # three counted, two of the listed marked


def test_a_counter_moved_by_something_outside_the_job_is_reported_forged():
    raw = dist.HashStore()
    records = signed(raw)
    records.mark("m", 0)
    prefixed(raw).add("m", 2)        # the plain counter says 3; only node 0 signed a mark
    forged: list[str] = []
    assert signed(raw, forged).count("m", [0, 1]) == 1
    assert forged == ["m"]


def test_a_mark_taken_back_is_not_counted():
    raw = dist.HashStore()
    records = signed(raw)
    records.mark("m", 0)
    records.mark("m", 1)
    records.mark("m", 1, on=False)
    records.mark("m", 2)
    assert signed(raw).count("m", [0, 1, 2]) == 2


def test_the_coordinator_counts_over_the_nodes_of_the_job_now():
    raw = dist.HashStore()
    nodes = [0, 1, 2]
    coords = [coordinator(raw, n, nodes=lambda: list(nodes)) for n in range(3)]
    coords[0].mark_ready(4)
    coords[2].mark_ready(4)
    coords[0].mark_inprocess_done(4)
    coords[2].mark_inprocess_done(4)
    coords[0].mark_done(4)
    coords[2].mark_done(4)
    coords[0].mark_left()
    coords[2].mark_left()
    c = coords[0]
    assert (c.ready_count(4), c.inprocess_done_count(4), c.done_count(4), c.left_count()) == (2, 2, 2, 2)
    assert c.ready_count(4) < len(nodes)
    nodes.remove(1)                  # the job shrank without node 1
    assert (c.ready_count(4), c.inprocess_done_count(4), c.done_count(4), c.left_count()) == (2, 2, 2, 2)
    assert c.ready_count(4) >= len(nodes)
    assert c.ready_count(4, [0, 1]) == 1, "an explicit list wins over the job's nodes"
    assert c.ready_count(5) == 0


def test_a_coordinator_without_nodes_counts_every_node_rank():
    raw = dist.HashStore()
    a, b = coordinator(raw, 0, nnodes=2), coordinator(raw, 1, nnodes=2)
    a.mark_ready(1)
    assert a.ready_count(1) == 1
    b.mark_ready(1)
    assert a.ready_count(1) == 2


# ------------------------------------------------------------------ the Coordinator's layout calls
def test_the_coordinator_drops_a_lost_node_and_sets_the_layout():
    raw = dist.HashStore()
    for n in range(3):
        assert members_on(raw).take_free(n, f"inc{n}")
    host = coordinator(raw, 0, "inc0")
    host.declare_lost(loss_of(1, "inc1"))
    assert host.drop_lost(1, "inc1")
    assert members_on(raw).holder(1) == "dropped:inc1"
    layout = lay(2, {0: 2, 2: 2}, 6)
    assert host.set_layout(layout) == layout
    other = coordinator(raw, 2, "inc2")
    assert other.layout_for_round(2) == layout and other.layout_for_round(1) is None
    join = NodeJoin(incarnation="new1", nproc=2, host="h1")
    layouts_on(raw).ask_to_join(1, join)
    assert other.join_request(1) == join


def test_a_fenced_agent_neither_drops_nor_sets_a_layout():
    raw = dist.HashStore()
    assert members_on(raw).take_free(0, "inc0")
    assert members_on(raw).take_free(1, "inc1")
    host = coordinator(raw, 0, "inc0")
    host.declare_lost(loss_of(0, "inc0"))           # this agent was declared lost ...
    assert members_on(raw).take_over(0, "inc0", "new0")   # ... and replaced
    members_on(raw).declare_lost(loss_of(1, "inc1"))
    with pytest.raises(FencedError):
        host.drop_lost(1, "inc1")
    with pytest.raises(FencedError):
        host.set_layout(lay(2, {0: 2}, 4))
    assert members_on(raw).holder(1) == tombstone("inc1") and layouts_on(raw).latest() is None


# ------------------------------------------------------------------ the elastic flags
def _config(argv: list[str]) -> LaunchConfig:
    """What `hyperpodrun ARGV` would hand to the agent (as tests/unit/test_config.py builds it)."""
    with launch.make_context("hyperpodrun", list(argv)) as ctx:
        opts = dict(ctx.params)
        script, args = opts.pop("training_script"), opts.pop("training_script_args")
        return build_config(opts, script, args, _env_sources(ctx))


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for key in ("PET_NPROC_PER_NODE", "PET_NNODES", "PET_MAX_RESTARTS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "HYPERPODRUN_LOG_DIR", "HYPERPODRUN_INPROCESS_TIMEOUT", "HYPERPODRUN_JOB_SECRET", "PET_LOG_DIR",
                "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_CONF"):
        monkeypatch.delenv(key, raising=False)
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


C10D = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400"]


def test_an_elastic_range_with_c10d(script: str, tmp_path: Path):
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "1:3", *C10D, script])
    assert (cfg.nnodes, cfg.min_nnodes, cfg.elastic) == (3, 1, True)
    assert cfg.last_call_timeout == 30.0 and not cfg.single_node


def test_a_fixed_range_is_not_elastic(script: str, tmp_path: Path):
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "2:2", *C10D, script])
    assert (cfg.nnodes, cfg.min_nnodes, cfg.elastic) == (2, 2, False)
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "2", *C10D, script])
    assert (cfg.nnodes, cfg.min_nnodes, cfg.elastic) == (2, 2, False)


def test_last_call_timeout_is_read_from_rdzv_conf(script: str, tmp_path: Path):
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "1:3", *C10D, "--rdzv-conf", "last_call_timeout=5",
                   script])
    assert cfg.last_call_timeout == 5.0
    cfg = _config(["--log-dir", str(tmp_path), "--nnodes", "1:3", *C10D, "--rdzv-conf",
                   "join_timeout=90,last_call_timeout=0", script])
    assert (cfg.last_call_timeout, cfg.join_timeout) == (0.0, 90.0)


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_last_call_timeout_is_a_one_line_error(script: str, tmp_path: Path, value: str):
    with pytest.raises(ConfigError) as err:
        _config(["--log-dir", str(tmp_path), "--nnodes", "1:3", *C10D, "--rdzv-conf",
                 f"last_call_timeout={value}", script])
    assert f"last_call_timeout={value}" in str(err.value) and "\n" not in str(err.value)


def test_an_elastic_range_needs_c10d(script: str, tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        _config(["--log-dir", str(tmp_path), "--nnodes", "1:2", script])
    assert "--nnodes 1:2" in str(err.value) and "c10d" in str(err.value)
    with pytest.raises(ConfigError, match="c10d"):
        _config(["--log-dir", str(tmp_path), "--nnodes", "1:2", "--rdzv-backend", "static", script])


def test_built_configs_min_nodes():
    assert LaunchConfig(entrypoint="x.py", nnodes=3).min_nnodes == 3
    assert not LaunchConfig(entrypoint="x.py", nnodes=3).elastic
    assert LaunchConfig(entrypoint="x.py", nnodes=4, min_nodes=2).elastic
    assert LaunchConfig(entrypoint="x.py", nnodes=4, min_nodes=2).min_nnodes == 2
    over = LaunchConfig(entrypoint="x.py", nnodes=2, min_nodes=5)
    assert (over.min_nnodes, over.elastic) == (2, False), "MIN is never above MAX"
