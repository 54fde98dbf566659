"""The hyperpodrun node agent (installed as hyperpodrun.agent): one process per node that supervises the
workers, hosts the stores and runs the restart protocol. See docs/ARCHITECTURE.md.

This package owns the node's state machine and its loop: the process (agent), the one owner of node state
(state), what each event does to it (node), the ports the core talks through (ports), the in-process round
(inprocess, round, rankstate), process-level restarts (restart_policy) and the pre/post-train hooks. Each
capability is a sub-package behind a port: workers (processes), coordination (between nodes), health (GPUs),
control (the control plane), observe (events, reports), security (other users of the node).

May import: hyperpodrun's contracts and launch configuration (env, protocol, errors, auth, launch, safe_fs,
netaddr, netwatch) and, for the slot files its workers and standbys share, hyperpodrun.state.slots. The
worker runtime (hyperpodrun.runtime) only in workers/zygote.py, the process respawned workers fork from.
"""
