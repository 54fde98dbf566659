"""CheckpointlessMegatronStrategy: NeMo MegatronStrategy's argument names and defaults over Lightning's DDP; what
the stock-PyTorch backend does not support yet is refused with one line; its instance layout reaches the
CheckpointManager (the replica map and the snapshots' fingerprint)."""
from __future__ import annotations

import inspect

import pytest

pl = pytest.importorskip("pytorch_lightning")

from hyperpodrun import CheckpointManager, CheckpointlessMegatronStrategy   # noqa: E402
from hyperpodrun.errors import ApiValueError, ReplicaLayoutError   # noqa: E402
from hyperpodrun.state.restore.parallel_layout import ParallelLayout   # noqa: E402


def test_nemos_argument_names_and_defaults():
    params = inspect.signature(CheckpointlessMegatronStrategy.__init__).parameters
    for name, default in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                          ("virtual_pipeline_model_parallel_size", None), ("context_parallel_size", 1),
                          ("sequence_parallel", False), ("expert_model_parallel_size", 1),
                          ("num_distributed_optimizer_instances", 1), ("use_tp_pp_dp_mapping", False),
                          ("ddp", "megatron"), ("find_unused_parameters", False), ("ckpt_async_save", True)):
        assert params[name].default == default, name
    strategy = CheckpointlessMegatronStrategy(num_distributed_optimizer_instances=2, ckpt_async_save=False,
                                              some_future_nemo_option=3)
    assert isinstance(strategy, pl.strategies.DDPStrategy) and isinstance(strategy, CheckpointlessMegatronStrategy)
    assert strategy.layout == ParallelLayout(2)
    assert CheckpointlessMegatronStrategy(use_tp_pp_dp_mapping=True).layout.order == "tp-cp-ep-pp-dp"


@pytest.mark.parametrize("kwargs, named", [
    ({"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4},
     "tensor_model_parallel_size=8, pipeline_model_parallel_size=4"),
    ({"context_parallel_size": 2}, "context_parallel_size=2"),
    ({"expert_model_parallel_size": 4}, "expert_model_parallel_size=4"),
    ({"sequence_parallel": True}, "sequence_parallel=True"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size=2"),
])
def test_what_the_backend_does_not_support_yet_is_one_line(kwargs, named):
    with pytest.raises(ApiValueError) as err:
        CheckpointlessMegatronStrategy(**kwargs)
    text = str(err.value)
    assert "\n" not in text and named in text and "not supported yet" in text
    with pytest.raises(ApiValueError, match="an int >= 1"):
        CheckpointlessMegatronStrategy(num_distributed_optimizer_instances=0)


def test_the_strategys_layout_reaches_the_checkpoint_manager():
    cm = CheckpointManager()
    cm.use_layout(ParallelLayout(2))
    assert cm.num_instances == 2 and cm._groups({}, 4) == [[0, 2], [1, 3]]
    plain = CheckpointManager()
    plain.use_layout(ParallelLayout(1))      # one instance: replicas still derived from DDP
    assert plain.num_instances is None
    with pytest.raises(ApiValueError, match="give it once"):
        CheckpointManager(num_distributed_optimizer_instances=3).use_layout(ParallelLayout(2))
    with pytest.raises(ApiValueError, match="give one"):
        CheckpointManager(replica_groups=[[0, 1]]).use_layout(ParallelLayout(2))
    with pytest.raises(ReplicaLayoutError, match="does not divide"):
        ParallelLayout(3).data_parallel(4)


def test_the_parameters_are_split_in_contiguous_runs_of_about_equal_size():
    from hyperpodrun.integrations.instance_shards import owners
    assert owners([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert owners([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert len(owners([5], 4)) == 1 and 0 <= owners([5], 4)[0] < 4   # one parameter: one owner
    got = owners([7, 3, 9, 1, 4, 4, 8], 3)
    assert got == sorted(got) and set(got) == {0, 1, 2}


def test_the_strategy_is_of_the_callers_lightning_distribution():
    """With both distributions imported, a strategy made in code that uses lightning.pytorch is that one's
    (a Trainer accepts only a strategy of its own distribution); this module uses pytorch_lightning."""
    lp = pytest.importorskip("lightning.pytorch")
    namespace = {"Trainer": lp.Trainer, "CheckpointlessMegatronStrategy": CheckpointlessMegatronStrategy}
    made = eval("CheckpointlessMegatronStrategy()", namespace)
    assert isinstance(made, lp.strategies.DDPStrategy) and not isinstance(made, pl.strategies.DDPStrategy)
    assert isinstance(CheckpointlessMegatronStrategy(), pl.strategies.DDPStrategy)
