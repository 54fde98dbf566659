"""Several hyperpodrun "nodes" on one machine: each agent in its own pid and mount namespaces with a private
/dev/shm, so that killing a node kills its agent, its workers and its shared memory at once - as a host crash
does. The agents share the machine's network namespace and meet on loopback.

A node is `unshare --pid --fork --mount-proc --mount` running a bash that mounts a fresh tmpfs on /dev/shm
and then runs hyperpodrun as its child; that bash is the namespace's init, so a SIGKILL to it takes every
process of the node with it (the kernel kills the rest of a pid namespace when its init dies) and the tmpfs
goes with the mount namespace. Needs root (CI runs as root); `unavailable()` says why not otherwise.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

from conftest import HYPERPODRUN, Launcher, Proc, wait_until
from inprocess_helpers import events_named

_INIT = 'mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm || exit 99; "$@"; exit $?'
_UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private"]


@functools.lru_cache(maxsize=1)
def unavailable() -> Optional[str]:
    """None when namespaced nodes can be made here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root for pid/mount namespaces (unshare); CI runs as root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run([*_UNSHARE, "bash", "-c", _INIT, "bash", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make pid/mount namespaces here: {probe.stderr.decode(errors='replace').strip()[:200]}"
    return None


class Node:
    """One agent started as a node (see the module docstring)."""

    def __init__(self, launcher: Launcher, args: list[str], log_dir: Path, env: Optional[dict[str, str]] = None):
        self.log_dir = Path(log_dir)
        cmd = [*_UNSHARE, "bash", "-c", _INIT, "bash", HYPERPODRUN, "--log-dir", str(self.log_dir)]
        self.proc: Proc = launcher.start(args, cmd=cmd, env=env)

    def _children(self, pid: int) -> list[int]:
        kids: list[int] = []
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as fh:
                    kids += [int(x) for x in fh.read().split()]
        except OSError:
            pass
        return kids

    def init_pid(self) -> int:
        """The node's init (the bash under unshare), as this machine's pid."""
        return wait_until(lambda: (self._children(self.proc.pid) or [0])[0], 10, message="the node's init")

    def agent_pid(self) -> int:
        init = self.init_pid()
        return wait_until(lambda: (self._children(init) or [0])[0], 10, message="the node's agent")

    def kill(self) -> None:
        """The node dies whole: agent, workers and /dev/shm."""
        os.kill(self.init_pid(), signal.SIGKILL)

    def signal_agent(self, sig: int) -> None:
        os.kill(self.agent_pid(), sig)

    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout).rc

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return events_named(self.log_dir, name, **match)

    def wait_event(self, name: str, timeout: float = 60, **match: Any) -> dict[str, Any]:
        def seen() -> Optional[dict[str, Any]]:
            found = self.events(name, **match)
            if not found and not self.alive():
                raise AssertionError(f"node ended (rc={self.proc.popen.returncode}) before event {name}\n"
                                     f"{self.describe()}")
            return found[0] if found else None
        return wait_until(seen, timeout, message=f"event {name} {match or ''} in {self.log_dir}")

    def describe(self) -> str:
        return f"--- {self.log_dir.name}: stderr ---\n{self.proc.err()[-6000:]}"
