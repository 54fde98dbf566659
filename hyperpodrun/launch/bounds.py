"""The bounds of the launcher's numeric flags and their defaults (docs/flags.md), apart from LaunchConfig
(hyperpodrun/launch/config.py, which re-exports them) so that the config stays the size of one idea."""
from __future__ import annotations

# Bounds of the numeric flags (docs/flags.md). A value past them is a typo or an overflow, never a job: an
# agent asked for 10**20 workers would grow until the OOM killer ends it, a timeout of 1e400 s never fires.
#: workers per node (the largest machines have a few hundred CPU cores; a GPU node has 8-16 GPUs)
MAX_NPROC_PER_NODE = 1024
#: nodes in one job
MAX_NNODES = 65536
#: restart budgets and failure counts
MAX_COUNT = 1_000_000
#: every timeout: one week
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: every polling interval: at least 1 ms (a busy loop otherwise), at most one hour
MIN_INTERVAL_S = 0.001
MAX_INTERVAL_S = 3600.0
#: --rdzv-conf join_timeout when not given
DEFAULT_JOIN_TIMEOUT_S = 600.0
#: --rdzv-conf last_call_timeout when not given (torchrun's)
DEFAULT_LAST_CALL_S = 30.0
#: --rdzv-conf coordinator_timeout when not given: how long the agents wait for a standalone coordinator that
#: went away (a Kubernetes Deployment restarts one in well under that) before the job ends
DEFAULT_COORDINATOR_TIMEOUT_S = 300.0
#: --node-timeout: a node whose agent has not renewed its lease for this long is lost (agent/coordination/membership.py)
DEFAULT_NODE_TIMEOUT_S = 5.0
MIN_NODE_TIMEOUT_S = 0.5
#: --replace-timeout: how long the surviving nodes wait for a lost node's replacement
DEFAULT_REPLACE_TIMEOUT_S = 120.0
#: --metrics-host when not given: the metrics, probe and status server answers this host only (docs/security.md)
DEFAULT_METRICS_HOST = "127.0.0.1"
