"""The product note's module paths for peer-to-peer checkpointless training (Tier 4), kept so that a script
written against it runs with only its package prefix changed: `hyperpodrun.nemo_plugins.strategy`,
`.checkpoint_manager`, `.callbacks`. The implementations are hyperpodrun.state (CheckpointManager),
hyperpodrun.runtime.lightning_callback and hyperpodrun.integrations.megatron_strategy."""
