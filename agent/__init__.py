"""The hyperpodrun node agent (installed as hyperpodrun.agent): one process per node that supervises the
workers, hosts the stores and runs the restart protocol. See docs/ARCHITECTURE.md."""
