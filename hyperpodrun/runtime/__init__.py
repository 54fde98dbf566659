"""The runtime embedded in workers: HPWrapper, health checks, abort/finalize, state and data helpers."""
