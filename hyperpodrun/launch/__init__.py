"""Launch configuration: the CLI's flags parsed (flags, flag_syntax) into a validated LaunchConfig (config),
the facts of this machine a launch depends on (host_checks) and the HYPERPODRUN_* settings.

May import: hyperpodrun (env, errors, netaddr, auth). Never the agent or the runtime.
"""
