"""Taking a script's place in a process the zygote forked: a respawned worker (zygote.py) and a standby that
runs the script ahead (prerun.py) enter it the same way."""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping


def enter_script(req: Mapping[str, Any]) -> str:
    """Take the place of `python script args...` as the agent would start it - its directory, environment,
    sys.argv and sys.path[0] - for a forked worker and a standby that runs the script ahead alike; returns the
    script path."""
    if req.get("cwd"):
        os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    return script
