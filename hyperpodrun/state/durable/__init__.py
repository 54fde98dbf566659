"""The durable tier: CheckpointManager's fallback checkpoints on a shared filesystem (local disk, FSx/Lustre) or
in object storage (S3), in torch.distributed.checkpoint (DCP) format, written behind the training and found
again by a new job when every node's memory is gone.

Owns: where a fallback_dir points and what the store can do (stores.py: a path or s3://bucket/prefix, checked
at start), the objects of one checkpoint and how a rank's snapshot is rebuilt from them (dcp_layout.py), the
writer thread, the final manifest, retention and the listing a restore plans with (tier.py).

May import: hyperpodrun (errors, safe_fs, launch.settings), hyperpodrun.state.slots (the slot format it reads
and rebuilds). Never the agent, never the rest of hyperpodrun.state (the manager imports this, not the other
way round). boto3 only inside stores.py, only for an s3:// URL (the optional extra hyperpodrun[s3]).
"""
