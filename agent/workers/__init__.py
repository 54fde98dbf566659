"""The agent's worker processes: spawning them (launch), supervising and reaping them, their output (tee),
the warm zygote and standbys that replace a dead rank (running the script ahead: prerun), and the kernels a
standby warms.

May import: hyperpodrun (env, errors, protocol, settings, safe_fs), hyperpodrun.agent.ports and .observe; what runs
in the zygote's processes (zygote, prerun's run_ahead in a standby) also the worker runtime, hyperpodrun.runtime.
"""
