"""The agent's control plane: the control server its workers talk to, which identities may speak for a worker
(voices), fault drills (inject), the file that tells `hyperpodrun inject` where the agent is (agent_info), and
the stop an operator asks for through the status API (api_stop).

May import: hyperpodrun (protocol, safe_fs, settings, errors), hyperpodrun.agent.ports, .state and .observe.
"""
