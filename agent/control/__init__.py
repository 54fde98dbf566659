"""The agent's control plane: the control server its workers talk to, which identities may speak for a worker
(voices), fault drills (inject) and the file that tells `hyperpodrun inject` where the agent is (agent_info).

May import: hyperpodrun (protocol, safe_fs, settings), hyperpodrun.agent.ports and .observe.
"""
