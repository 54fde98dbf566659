"""The num_distributed_optimizer_instances replica map for tensor / pipeline / context / data parallel layouts
(Megatron's rank order), the placement check, and the layout fingerprint a snapshot carries."""
from __future__ import annotations

import pytest

from hyperpodrun.errors import ReplicaLayoutError
from hyperpodrun.state.restore.parallel_layout import ParallelLayout
from hyperpodrun.state.restore.replicas import instance_groups


def megatron_rank(tp: int, cp: int, dp: int, pp: int, TP: int, CP: int, DP: int) -> int:
    """Megatron's default order tp-cp-ep-dp-pp written out: tp the fastest, pp the slowest."""
    return tp + TP * (cp + CP * (dp + DP * pp))


def expected(world: int, n: int, TP: int = 1, PP: int = 1, CP: int = 1) -> list[list[int]]:
    """The replicas by definition: same tensor, pipeline position and shard (index in the data x context group,
    cp the faster, modulo the instance size), one per instance."""
    DP = world // (TP * PP * CP)
    size = DP * CP // n
    groups = []
    for pp in range(PP):
        for tp in range(TP):
            for shard in range(size):
                members = []
                for i in range(n):
                    j = shard + i * size
                    members.append(megatron_rank(tp, j % CP, j // CP, pp, TP, CP, DP))
                groups.append(members)
    return sorted(groups)


@pytest.mark.parametrize("world,n,tp,pp,cp", [
    (8, 2, 1, 1, 1), (6, 3, 1, 1, 1), (8, 2, 2, 1, 1), (8, 2, 1, 2, 1), (8, 2, 2, 2, 1), (16, 2, 2, 2, 1),
    (16, 4, 1, 4, 1), (8, 2, 1, 1, 2), (16, 2, 2, 2, 2), (64, 2, 8, 4, 1), (24, 3, 2, 2, 1)])
def test_replica_map_matches_megatrons_partial_distributed_optimizer(world, n, tp, pp, cp):
    groups = instance_groups(world, n, tp, pp, cp)
    assert groups == expected(world, n, tp, pp, cp)
    assert sorted(r for g in groups for r in g) == list(range(world)) and all(len(g) == n for g in groups)


def test_pipeline_parallel_replicas_are_world_over_pp_times_n_apart():
    """The case the map had wrong: TP 1, PP 2, DP 4, 2 instances - rank 0 (stage 0) was paired with rank 4
    (stage 1); its replica is rank 2, world/(PP*N) = 2 ranks on, in the same stage."""
    assert instance_groups(8, 2, pp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert instance_groups(8, 2, pp=2) != instance_groups(8, 2)
    # TP 2 x PP 2 x 2 instances (DP 2): one replica per tensor rank and stage
    assert instance_groups(8, 2, tp=2, pp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for world, n, tp, pp in ((16, 2, 2, 2), (64, 2, 8, 4), (32, 4, 1, 2)):
        for g in instance_groups(world, n, tp, pp):
            assert all(b - a == world // (pp * n) for a, b in zip(g, g[1:])), (world, n, tp, pp, g)


def test_data_parallel_outermost_order():
    """rank_order "tp-cp-pp-ep-dp" (data parallel the slowest): the replicas are world/N apart at any PP."""
    assert instance_groups(8, 2, pp=2, order="tp-cp-pp-ep-dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layouts_that_do_not_fit_are_refused():
    with pytest.raises(ReplicaLayoutError, match="does not divide"):
        instance_groups(6, 4)
    with pytest.raises(ReplicaLayoutError, match="does not divide"):
        instance_groups(8, 4, pp=4)           # DP 2 cannot hold 4 instances
    with pytest.raises(ReplicaLayoutError, match="not a multiple"):
        instance_groups(8, 2, tp=3)
    with pytest.raises(ReplicaLayoutError, match="rank_order"):
        ParallelLayout(2, order="tp-dp-pp")
    with pytest.raises(ReplicaLayoutError, match="tensor_model_parallel_size"):
        ParallelLayout(2, tp=0)
    assert issubclass(ReplicaLayoutError, ValueError)


def test_both_copies_on_one_node_are_refused_with_the_order_that_fixes_it():
    """TP 2 x PP 4 x DP 2 with 2 instances on 2 nodes of 8: in the default order the replicas are 2 ranks
    apart, on one node; data parallel outermost puts them 8 apart, on the other node."""
    bad = ParallelLayout(2, tp=2, pp=4)
    with pytest.raises(ReplicaLayoutError, match=r"one node \(ranks \[0, 2\]\).*'tp-cp-pp-ep-dp'"):
        bad.check_placement(16, 8)
    ParallelLayout(2, tp=2, pp=4, order="tp-cp-pp-ep-dp").check_placement(16, 8)
    ParallelLayout(2, tp=8, pp=4).check_placement(64, 8)     # the product note's layout: 8 apart, fine
    bad.check_placement(16, 16)           # one node: the copies guard against a process's loss only
    # 3 instances, 2 nodes: some node holds two copies of a shard (said, not refused); never all three
    ParallelLayout(3).check_placement(24, 12)          # replicas 8 apart: [0, 8, 16]
    with pytest.raises(ReplicaLayoutError, match=r"every copy .*\[0, 4, 8\]"):
        ParallelLayout(3, pp=2).check_placement(24, 12)   # replicas 4 apart: all three on node 0


def test_fingerprint_names_the_layout():
    a = ParallelLayout(2, tp=2, pp=2).fingerprint(8)
    assert a == "world=8 tp=2 pp=2 cp=1 instances=2 order=tp-cp-ep-dp-pp"
    assert ParallelLayout(2, tp=2, pp=2).fingerprint(16) != a
    assert ParallelLayout(2, tp=1, pp=4).fingerprint(8) != a
    assert ParallelLayout(None).fingerprint(4) == ParallelLayout(1).fingerprint(4)


def test_checkpoint_manager_refuses_a_placement_on_one_node_when_built(monkeypatch):
    from hyperpodrun import CheckpointManager
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ReplicaLayoutError, match="'tp-cp-pp-ep-dp'"):
        CheckpointManager(num_distributed_optimizer_instances=2, tensor_model_parallel_size=2,
                          pipeline_model_parallel_size=4)
    cm = CheckpointManager(num_distributed_optimizer_instances=2, tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=4, rank_order="tp-cp-pp-ep-dp")
    assert cm._groups({}, 16)[0] == [0, 8]
    with pytest.raises(ReplicaLayoutError, match="does not divide"):
        CheckpointManager(num_distributed_optimizer_instances=3, pipeline_model_parallel_size=2)


def test_a_snapshot_taken_under_another_layout_is_refused(tmp_path, monkeypatch):
    """Each snapshot carries its layout's fingerprint: restored under another layout it is refused with one
    error (a usage error: exit code 2, never retried), not loaded into the wrong part of the model."""
    import torch
    from hyperpodrun import CheckpointManager
    from hyperpodrun.errors import USAGE_ERRORS
    monkeypatch.setenv("RANK", "0")
    saved = CheckpointManager(shm_dir=str(tmp_path), num_distributed_optimizer_instances=1)
    saved.save(3, {"w": torch.arange(4.0)})
    saved.wait()
    other = CheckpointManager(shm_dir=str(tmp_path), num_distributed_optimizer_instances=1,
                              rank_order="tp-cp-pp-ep-dp")
    with pytest.raises(ReplicaLayoutError, match=r"another parallel layout \(world=1 .*order=tp-cp-ep-dp-pp\)"):
        other.restore({"w": None})
    assert isinstance(ReplicaLayoutError("x"), USAGE_ERRORS)
    same = CheckpointManager(shm_dir=str(tmp_path), num_distributed_optimizer_instances=1)
    state = {"w": None}
    assert same.restore(state) == 3 and torch.equal(state["w"], torch.arange(4.0))


def test_the_map_is_megatron_cores_own_where_it_is_installed():
    """Against megatron-core's RankGenerator (where it is installed; 0.16 on Python 3.11): its data x context
    parallel groups, cut into contiguous instances as its partial distributed optimizer cuts them, give the
    same replica groups for every layout and both rank orders."""
    import itertools
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for world, tp, pp, cp, n, order in itertools.product(
            (8, 16, 24, 32), (1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 3, 4), ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")):
        if world % (tp * pp * cp) or (world // (tp * pp * cp) * cp) % n:
            continue
        dp = world // (tp * pp * cp)
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        intra = dp * cp // n
        theirs = sorted([group[j + i * intra] for i in range(n)] for group in gen.get_ranks("dp-cp")
                        for j in range(intra))
        assert ParallelLayout(n, tp, pp, cp, order).groups(world) == theirs, (world, tp, pp, cp, n, order)
