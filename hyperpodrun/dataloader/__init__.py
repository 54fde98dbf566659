"""The product note's module paths for the MMAP data cache (Tier 2), kept so that a script written against it
runs with only its package prefix changed: `hyperpodrun.dataloader.mmap_data_module` and
`hyperpodrun.dataloader.config`. The implementation is hyperpodrun.data (docs/mmap-data.md)."""
