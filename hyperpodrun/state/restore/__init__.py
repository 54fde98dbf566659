"""Restores across ranks: what each rank holds (inventories), which step every rank restores and where from,
replica peers and peer copies on other nodes, and the MACs on these protocols.

May import: hyperpodrun (auth, env, errors, safe_fs), hyperpodrun.state.slots and .codec.
"""
