"""The agent's defences against other users of the node: processes outside the job (the roll call's agent side)
and a slot base another user squatted.

May import: hyperpodrun (netwatch, safe_fs, settings), hyperpodrun.agent.observe.
"""
