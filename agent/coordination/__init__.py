"""Coordination between nodes: rendezvous, node membership and leases, elastic layouts, the coordination
store and its schema, and the job-wide state kept there (job_state); the standalone coordinator, and the etcd
backend (etcd_store, etcd_rendezvous: its client library, etcd3gw, is imported only when it is used).

May import: hyperpodrun (auth, env, errors, netaddr, settings, launch), hyperpodrun.agent.ports and .observe.
"""
