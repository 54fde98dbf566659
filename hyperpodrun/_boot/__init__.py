"""The folder the agent puts first on its workers' PYTHONPATH: it holds only `sitecustomize`, which arranges
the roll call before the worker's script runs (runtime/group_hook.py)."""
