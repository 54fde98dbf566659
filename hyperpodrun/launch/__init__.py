"""Launch configuration: the CLI's flags parsed (flags, flag_syntax) into a validated LaunchConfig (config, bounds),
the facts of this machine a launch depends on (host_checks) and the HYPERPODRUN_* settings.

May import: hyperpodrun's contracts (env, errors, netaddr, auth) and, for the GPU checks of host_checks,
the NVML backend (hyperpodrun.agent.health.nvml_backend). Never the runtime or the state tier.
"""
