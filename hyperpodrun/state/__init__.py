"""The checkpointless state tier: CheckpointManager, what a survivor keeps (live state, fingerprints), what a
rank saves of each object (state dicts, DDP layouts) and how often a GPU state is snapshotted (the budget).

Sub-packages: slots (snapshot slots in shared memory: format, copy, checksums, pinned reads, run
directories), codec (the safe metadata encoding - no pickle), restore (which step every rank restores and
where from: inventories, replicas, peer copies, their MACs).

May import: hyperpodrun (env, errors, protocol, safe_fs, settings), hyperpodrun.runtime (the in-process
protocol it serves). Never the agent.
"""
