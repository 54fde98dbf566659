"""What the agent tells the world: the event log and its sinks, the failure report, the Kubernetes reporter
(`--k8s-report`: k8s_api.py, the client's configuration and calls; k8s_report.py, the sink), and with
`--metrics-port` the Prometheus metrics (metrics.py), the status view (status_view.py) - both sinks on the event
log - and the HTTP server that serves them, the probes and the status API (http_api.py).

May import: hyperpodrun (errors, protocol, safe_fs, settings, auth); the optional `kubernetes` client (k8s_api.py
only) and `prometheus_client` (metrics.py and http_api.py, only once --metrics-port is given).
"""
