#!/usr/bin/env python3
# training_script.py - Checkpointless Training Complete Example
#
# The product note's complete example (its section 6) as written, with two changes only: the package prefix of
# the imports (hyperpod_checkpointless_training -> hyperpodrun) and the Trainer on CPU (accelerator="cpu").
# Its comments are translated to English. tests/test_note_example.py runs it under hyperpodrun.

import os
from omegaconf import OmegaConf
from pytorch_lightning import Trainer

# Tier 2: MMAP Data Loading
from hyperpodrun.dataloader.mmap_data_module import MMAPDataModule
from hyperpodrun.dataloader.config import CacheResumeMMAPConfig

# Tier 3: In-Process Recovery
from hyperpodrun.inprocess.wrap import HPWrapper
from hyperpodrun.inprocess.health_check import CudaHealthCheck
from hyperpodrun.inprocess.train_utils import wait_rank, HPAgentK8sAPIFactory
from hyperpodrun.inprocess.abort import (
    CheckpointlessAbortManager,
    CheckpointlessFinalizeCleanup
)

# Tier 4: P2P State Replication
from hyperpodrun.nemo_plugins.strategy import CheckpointlessMegatronStrategy
from hyperpodrun.nemo_plugins.checkpoint_manager import CheckpointManager
from hyperpodrun.nemo_plugins.callbacks import CheckpointlessCallback

# Your model and data modules
from my_project import MyModel, MyDataModule


def create_data_module(cfg):
    """Tier 2: create the MMAP DataLoader"""
    base_data_module = MyDataModule(
        data_path=cfg.data.path,
        batch_size=cfg.data.batch_size,
    )

    mmap_config = CacheResumeMMAPConfig(
        cache_dir="/dev/shm/pdl_cache",
        prefetch_length=cfg.data.prefetch_length,
        lookback_length=cfg.data.lookback_length,
    )

    return MMAPDataModule(
        data_module=base_data_module,
        mmap_config=mmap_config,
    )


def create_trainer(cfg, checkpoint_manager):
    """Tier 4: create the checkpointless Trainer"""
    strategy = CheckpointlessMegatronStrategy(
        num_distributed_optimizer_instances=cfg.model.num_optimizer_instances,
        tensor_model_parallel_size=cfg.model.tp_size,
        pipeline_model_parallel_size=cfg.model.pp_size,
        context_parallel_size=cfg.model.cp_size,
    )

    callbacks = [
        CheckpointlessCallback(checkpoint_manager=checkpoint_manager),
    ]

    return Trainer(
        strategy=strategy,
        callbacks=callbacks,
        max_steps=cfg.training.max_steps,
        accelerator="cpu",
        devices=cfg.training.devices,
        num_nodes=cfg.training.num_nodes,
    )


# Tier 4: CheckpointManager setup
checkpoint_manager = CheckpointManager(
    enable_checksum=False,
    enable_offload=False,
)


# Tier 3: In-Process Recovery Wrapper
@HPWrapper(
    health_check=CudaHealthCheck(timeout=30),
    hp_api_factory=HPAgentK8sAPIFactory(),
    abort_timeout=60.0,
    checkpoint_manager=checkpoint_manager,
    abort=CheckpointlessAbortManager.get_default_checkpointless_abort(),
    finalize=CheckpointlessFinalizeCleanup(),
)
def run_main(cfg, caller=None):
    """The main training function - a Re-executable Code Block (RCB)"""

    # build the model
    model = MyModel(cfg.model)

    # Tier 2: MMAP DataLoader
    data_module = create_data_module(cfg)

    # Tier 4: Checkpointless Trainer
    trainer = create_trainer(cfg, checkpoint_manager)
    trainer.wrapper = caller  # connecting HPWrapper is required

    # run the training
    trainer.fit(model, data_module)


if __name__ == "__main__":
    # Tier 3: wait for the rank information from the Training Operator
    wait_rank()

    # load the configuration
    cfg = OmegaConf.load("config.yaml")

    # run the training
    run_main(cfg)
