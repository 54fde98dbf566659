"""The agent's worker processes: spawning them (launch), supervising and reaping them, their output (tee),
the warm zygote and standbys that replace a dead rank, and the kernels a standby warms.

May import: hyperpodrun (env, errors, protocol, settings, safe_fs), hyperpodrun.agent.ports and .observe.
"""
