"""Integrations of the checkpointless runtime with training frameworks that are optional dependencies.

Each module imports its framework when it is imported itself (never from `import hyperpodrun`):
`hyperpodrun.integrations.transformers` (Hugging Face `Trainer`: CheckpointlessTrainerCallback). The Lightning
callback lives in hyperpodrun/runtime/lightning_callback.py (`hyperpodrun.CheckpointlessCallback`).
"""
