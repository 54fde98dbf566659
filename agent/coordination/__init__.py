"""Coordination between nodes: rendezvous, node membership and leases, elastic layouts, the coordination
store and its schema, and the job-wide state kept there (job_state). Where a standalone coordinator and an
etcd backend go.

May import: hyperpodrun (auth, env, errors, netaddr, settings), hyperpodrun.agent.ports and .observe.
"""
