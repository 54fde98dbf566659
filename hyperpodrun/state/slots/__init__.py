"""Snapshot slots: state laid out raw in files in shared memory - their format, the copy into them (side
streams, device staging), their checksums, reading them back at DMA speed, and the run directories they
live in.

May import: hyperpodrun (errors, safe_fs, settings), hyperpodrun.state.codec.
"""
