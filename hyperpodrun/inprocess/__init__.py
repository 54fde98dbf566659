"""The product note's module paths for in-process recovery (Tier 3), kept so that a script written against it
runs with only its package prefix changed: `hyperpodrun.inprocess.wrap`, `.health_check`, `.train_utils`,
`.abort`. The implementation is hyperpodrun.runtime."""
