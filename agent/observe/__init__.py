"""What the agent tells the world: the event log and its sinks, the failure report, and the Kubernetes reporter
(`--k8s-report`: k8s_api.py, the client's configuration and calls; k8s_report.py, the sink). Where metrics go.

May import: hyperpodrun (errors, protocol, safe_fs, settings); the optional `kubernetes` client (k8s_api.py only).
"""
