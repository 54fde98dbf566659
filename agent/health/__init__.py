"""GPU health on a node: the GPU map, the NVML monitor and its thin backend, the XID policy, and what the agent
does about a GPU event.

May import: hyperpodrun (errors, settings), hyperpodrun.agent.ports and .observe.
"""
