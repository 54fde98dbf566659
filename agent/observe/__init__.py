"""What the agent tells the world: the event log and its sinks, and the failure report. Where metrics and the
Kubernetes reporter go.

May import: hyperpodrun (errors, protocol, safe_fs, settings).
"""
