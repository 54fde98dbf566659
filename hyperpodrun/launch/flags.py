"""Command-line flags -> LaunchConfig. The flags map onto LaunchConfig's fields by name; every check lives in
LaunchConfig's validators (hyperpodrun/launch/config.py), so this only adds the training script and its arguments.
"""
from __future__ import annotations

from typing import Any, Optional

from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.launch.flag_syntax import UNSUPPORTED

__all__ = ["UNSUPPORTED", "build_config"]


def build_config(opts: dict[str, Any], script: str, script_args: tuple[str, ...],
                 sources: Optional[dict[str, str]] = None) -> LaunchConfig:
    """click's option values (by option name) and the script -> a validated LaunchConfig; ConfigError with
    one line naming the flag (and `sources[field]`, the environment variable its value came from)."""
    return LaunchConfig.from_flags({**opts, "entrypoint": script, "args": list(script_args)}, sources)
