"""CheckpointlessMegatronStrategy: the product note's Tier 4 strategy, on stock PyTorch (Lightning's DDP).

    checkpoint_manager = CheckpointManager()

    @HPWrapper(checkpoint_manager=checkpoint_manager)
    def run_main(cfg, caller=None):
        trainer = Trainer(strategy=CheckpointlessMegatronStrategy(num_distributed_optimizer_instances=2),
                          callbacks=[CheckpointlessCallback(checkpoint_manager=checkpoint_manager)])
        trainer.wrapper = caller
        trainer.fit(model, data_module)

Why: a script written against NeMo's `MegatronStrategy` names its layout with NeMo's argument names; this class
takes them (same names, same defaults) so that such a script runs with only its imports changed. What it does
today: tensor = pipeline = context = expert parallel size 1 - data parallelism over every rank with PyTorch's
DistributedDataParallel (Lightning's DDPStrategy, gloo or NCCL), any LightningModule unchanged - and the
`num_distributed_optimizer_instances` = N as Megatron's partial distributed optimizer: the ranks are cut into N
contiguous instances, gradients all-reduced over every rank, the optimizer state sharded within each instance
(instance_shards.py), and the replica map handed to the CheckpointManager of the Trainer's CheckpointlessCallback:
a rank that lost its snapshots gets them from its peer in another instance (world / N ranks on, as Megatron
numbers them), which holds the same share. Larger tensor, pipeline, context or expert parallel sizes are refused
with one line (not supported yet; docs/tier4.md). NeMo's checkpoint-format arguments (ckpt_*, save_ckpt_format, ...) are
accepted and have no effect: the state lives in memory (CheckpointManager), not in a distributed checkpoint.

Lightning stays optional: the class derives from the DDPStrategy of the distribution (`lightning.pytorch` or
`pytorch_lightning`) that the code making the instance uses, when an instance is made.
"""
from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any, Optional

from hyperpodrun.errors import ApiValueError, MissingDependencyError
from hyperpodrun.integrations.instance_shards import InstanceShards, instance_groups
from hyperpodrun.state.restore.parallel_layout import DEFAULT_ORDER, ParallelLayout

log = logging.getLogger("hyperpodrun.runtime")

_DISTRIBUTIONS = ("lightning.pytorch", "pytorch_lightning")
#: Megatron's rank order under use_tp_pp_dp_mapping=True (data parallel the slowest)
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"
#: arguments of DDPStrategy passed on as given (the rest of **kwargs goes to NeMo-only options: ignored)
_DDP_STRATEGY_KWARGS = ("accelerator", "precision_plugin", "process_group_backend", "timeout", "start_method",
                        "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _distribution_used_by(namespace: dict) -> Optional[str]:
    """The Lightning distribution a module's globals use (its Trainer, or the module itself), if one."""
    for value in namespace.values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str):
            for dist in _DISTRIBUTIONS:
                if name == dist or name.startswith(dist + "."):
                    return dist
    return None


def _ddp_strategy_base(caller: Optional[dict] = None) -> type:
    """The DDPStrategy of the Lightning distribution the code making the strategy uses (`caller`: its globals),
    else of the one the process imported (lightning.pytorch first when both are), else of the one installed.
    Why the caller's: a Trainer accepts only a strategy of its own distribution, and both may be imported."""
    used = _distribution_used_by(caller) if caller is not None else None
    names = [used] if used else ([m for m in _DISTRIBUTIONS if m in sys.modules] or list(_DISTRIBUTIONS))
    for name in names:
        try:
            return importlib.import_module(f"{name}.strategies").DDPStrategy
        except (ImportError, AttributeError):
            continue
    raise MissingDependencyError("CheckpointlessMegatronStrategy needs Lightning: pip install lightning (or "
                                 "pytorch_lightning)")


def _refuse_unsupported(sizes: dict[str, Any]) -> None:
    """One line naming every layout option this backend does not support yet."""
    bad = [f"{k}={v!r}" for k, v in sizes.items() if v]
    if bad:
        raise ApiValueError(
            f"CheckpointlessMegatronStrategy({', '.join(bad)}): not supported yet - hyperpodrun's stock-PyTorch "
            "backend runs data parallelism only (tensor, pipeline, context and expert parallel sizes 1, no "
            "virtual pipeline or sequence parallelism); docs/tier4.md")


class CheckpointlessMegatronStrategy:
    """NeMo MegatronStrategy's arguments over Lightning's DDP, with the optimizer-instance replica map (see the
    module doc). num_distributed_optimizer_instances: ranks are cut into that many contiguous instances; rank p
    of every instance is the replica of rank p of the others (2 or more for redundancy)."""

    _subclasses: dict[tuple[type, type], type] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "CheckpointlessMegatronStrategy":
        base = _ddp_strategy_base(sys._getframe(1).f_globals)
        if not issubclass(cls, base):
            key = (cls, base)
            sub = CheckpointlessMegatronStrategy._subclasses.get(key)
            if sub is None:
                sub = type(cls.__name__, key, {"__module__": cls.__module__, "__doc__": cls.__doc__})
                CheckpointlessMegatronStrategy._subclasses[key] = sub
            cls = sub
        return object.__new__(cls)

    def __init__(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: Optional[int] = None,
                 microbatch_group_size_per_vp_stage: Optional[int] = None, context_parallel_size: int = 1,
                 sequence_parallel: bool = False, expert_model_parallel_size: int = 1, moe_extended_tp: bool = False,
                 expert_tensor_parallel_size: Optional[int] = None,
                 encoder_tensor_model_parallel_size: Optional[int] = 0,
                 encoder_pipeline_model_parallel_size: Optional[int] = 0, data_sampler: Any = None,
                 parallel_devices: Optional[list] = None, cluster_environment: Any = None, checkpoint_io: Any = None,
                 find_unused_parameters: bool = False, ckpt_load_optimizer: bool = True,
                 ckpt_save_optimizer: bool = True, ddp: Any = "megatron", fsdp: Optional[str] = None,
                 lazy_init: bool = False, pipeline_dtype: Any = None, use_te_rng_tracker: bool = False,
                 save_ckpt_format: str = "torch_dist", ckpt_async_save: bool = True,
                 ckpt_torch_dist_multiproc: Optional[int] = None, ckpt_assume_constant_structure: bool = False,
                 ckpt_parallel_save: bool = True, ckpt_parallel_save_within_dp: bool = False,
                 ckpt_parallel_load: bool = True, ckpt_parallel_save_optim: bool = True,
                 ckpt_load_directly_on_device: bool = True, ckpt_load_strictness: Any = None,
                 setup_optimizers: bool = True, init_model_parallel: bool = True, replace_progress_bar: bool = True,
                 progress_interval: int = 1, restore_config: Any = None, megatron_log_level: int = 0,
                 use_tp_pp_dp_mapping: bool = False, num_distributed_optimizer_instances: int = 1,
                 nccl_communicator_config_path: Optional[str] = None, use_sharp: bool = False,
                 use_gloo_process_groups: bool = True, **kwargs: Any) -> None:
        for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                            ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                            ("context_parallel_size", context_parallel_size),
                            ("expert_model_parallel_size", expert_model_parallel_size),
                            ("num_distributed_optimizer_instances", num_distributed_optimizer_instances)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiValueError(f"CheckpointlessMegatronStrategy({name}={value!r}): an int >= 1")
        _refuse_unsupported({
            "tensor_model_parallel_size": tensor_model_parallel_size if tensor_model_parallel_size > 1 else 0,
            "pipeline_model_parallel_size": pipeline_model_parallel_size if pipeline_model_parallel_size > 1 else 0,
            "context_parallel_size": context_parallel_size if context_parallel_size > 1 else 0,
            "expert_model_parallel_size": expert_model_parallel_size if expert_model_parallel_size > 1 else 0,
            "expert_tensor_parallel_size": expert_tensor_parallel_size if (expert_tensor_parallel_size or 1) > 1
            else 0,
            "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
            "sequence_parallel": sequence_parallel, "fsdp": fsdp,
            "encoder_tensor_model_parallel_size": encoder_tensor_model_parallel_size,
            "encoder_pipeline_model_parallel_size": encoder_pipeline_model_parallel_size})
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.context_parallel_size = context_parallel_size
        self.sequence_parallel = sequence_parallel
        self.expert_model_parallel_size = expert_model_parallel_size
        self.num_distributed_optimizer_instances = num_distributed_optimizer_instances
        self.use_tp_pp_dp_mapping = use_tp_pp_dp_mapping
        self.data_sampler = data_sampler
        #: the layout the replica map and every snapshot's fingerprint follow
        self.layout = ParallelLayout(num_distributed_optimizer_instances, tensor_model_parallel_size,
                                     pipeline_model_parallel_size, context_parallel_size,
                                     TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER)
        passed = {k: kwargs.pop(k) for k in _DDP_STRATEGY_KWARGS if k in kwargs}
        if kwargs:
            log.debug("CheckpointlessMegatronStrategy: NeMo options without effect here: %s", sorted(kwargs))
        super().__init__(parallel_devices=parallel_devices, cluster_environment=cluster_environment,   # type: ignore[call-arg]
                         checkpoint_io=checkpoint_io, find_unused_parameters=find_unused_parameters, **passed)

    def setup(self, trainer: Any) -> None:
        """The process group is up: check the layout against the world and give it to the CheckpointManager of
        the Trainer's CheckpointlessCallback (its restore, at fit start, follows this replica map)."""
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.layout.data_parallel(world)     # ReplicaLayoutError (one line, exit 2) when N does not divide it
        from hyperpodrun.runtime.lightning_callback import CheckpointlessCallback
        managers = {id(cb.checkpoint_manager): cb.checkpoint_manager for cb in getattr(trainer, "callbacks", [])
                    if isinstance(cb, CheckpointlessCallback)}
        for manager in managers.values():
            manager.use_layout(self.layout)
        if not managers and self.num_distributed_optimizer_instances > 1:
            log.warning("CheckpointlessMegatronStrategy(num_distributed_optimizer_instances=%d): the Trainer has no "
                        "CheckpointlessCallback, so no state is kept in memory", self.num_distributed_optimizer_instances)
        super().setup(trainer)   # type: ignore[misc]  # wraps the module in DDP, builds the optimizers
        self._shards: dict[int, InstanceShards] = {}
        instances = self.num_distributed_optimizer_instances
        optimizers = getattr(self, "optimizers", None) or []
        if world // instances > 1 and optimizers:
            group, position, size, members = instance_groups(world, instances)
            self._shards = {id(opt): InstanceShards(opt, group, position, size, members) for opt in optimizers}

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer steps its instance share only, then the shares are broadcast within the instance
        (instance_shards.py); the optimizer object stays the user's, so LR schedulers and Lightning see no
        difference."""
        shards = getattr(self, "_shards", {}).get(id(optimizer))
        if shards is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)   # type: ignore[misc]
        own = vars(optimizer).get("step")      # an LR scheduler's counting wrapper, if any
        original = optimizer.step

        def sharded_step(closure: Any = None, **kw: Any) -> Any:
            return shards.step(original, closure, **kw)
        optimizer.step = sharded_step
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)   # type: ignore[misc]
        finally:
            if own is None:
                vars(optimizer).pop("step", None)
            else:
                optimizer.step = own


__all__ = ["CheckpointlessMegatronStrategy"]
