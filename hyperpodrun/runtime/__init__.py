"""The in-process protocol, imported by workers: HPWrapper and the call it re-runs (wrapper), the process's
link to its agent (session, control), the restart interrupt that never splits an optimizer step (interrupt),
abort and finalize (abort), the health checks of a restart (health), armed faults (inject), what the runtime
does to torch's state (torch_state), the roll call (roll_call, group_hook), the Lightning callback, and where
a standby that runs the script ahead waits to become a rank (park).

May import: hyperpodrun's contracts (env, protocol, errors, auth, launch.settings, safe_fs, netwatch), the
state tier (hyperpodrun.state) and the MMAP data cache (hyperpodrun.data). Never the agent.
"""
