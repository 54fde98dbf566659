"""The safe metadata encoding: plain values, containers and tensor references, never pickle (reading it runs
no code).

May import: hyperpodrun.errors only.
"""
