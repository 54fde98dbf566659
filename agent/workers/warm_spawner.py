"""Warm respawns: a process that has imported torch forks the worker that replaces a dead rank.

Why: after a SIGKILL or a crash, the respawned rank is on the critical path of an in-process restart - the
surviving ranks wait at the barrier while it starts Python and imports torch (about 1 s on a CPU machine,
3-4 s on a GPU host), and that is most of the recovery time. The zygote (agent/workers/zygote.py) has done those
imports once, after the workers started, and forks a respawned worker in milliseconds.

The forked worker is re-parented to the agent (a subreaper), so the Supervisor adopts it by pid: pidfd,
session, reaper and exit status work as for any worker. Whenever the zygote cannot serve (not ready yet,
gone, an error, a module entry point), the agent starts the worker the normal way. HYPERPODRUN_WARM_RESPAWN=0
turns this off; HYPERPODRUN_WARM_IMPORTS names the modules to import ahead (comma-separated).
"""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
from typing import Any, Optional

from hyperpodrun import safe_fs
from hyperpodrun.errors import HyperpodrunError

log = logging.getLogger("hyperpodrun.agent")

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")


class WarmSpawnError(HyperpodrunError, RuntimeError):
    """The zygote could not fork the worker; the caller starts it the normal way."""


def enabled() -> bool:
    """HYPERPODRUN_WARM_RESPAWN (hyperpodrun/launch/settings.py: checked at start-up, anything but on/off is refused)."""
    from hyperpodrun.launch import settings
    return settings.current().warm_respawn


class WarmSpawner:
    """The agent's handle on its zygote process. Used from the agent's loop thread only."""

    def __init__(self, env: dict[str, str], script: str, log_path: Optional[str]) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err = safe_fs.append_file(log_path) if log_path else None
        try:
            self.proc = subprocess.Popen([sys.executable, "-u", ZYGOTE, str(theirs.fileno()), script], env=env,
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, start_new_session=True,
                                         stderr=err if err is not None else subprocess.DEVNULL)
        finally:
            theirs.close()
            if err is not None:
                err.close()
        self.ready: Optional[dict[str, Any]] = None
        self.broken = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_ready(self) -> bool:
        """True once the zygote has reported its imports done (non-blocking)."""
        if self.ready is None and not self.broken:
            r, _, _ = select.select([self._sock], [], [], 0)
            if r:
                msg = self._sock.recv(1 << 16)
                if not msg:
                    self.broken = True
                    return False
                info = json.loads(msg)
                if not info.get("ready"):
                    self.broken = True
                    log.info("no warm respawns: %s", info.get("why"))
                    return False
                self.ready = info
                log.debug("warm spawner ready: %s", self.ready)
        return self.ready is not None and not self.broken

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Optional[str], out_fd: int, err_fd: int,
              timeout: float = 5.0) -> int:
        """Fork a worker running `argv` ([script, args...]); returns its pid. Raises WarmSpawnError."""
        if not self.check_ready():
            raise WarmSpawnError("the warm spawner is not ready (still importing, or gone)")
        try:
            socket.send_fds(self._sock, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()],
                            [out_fd, err_fd])
            r, _, _ = select.select([self._sock], [], [], timeout)
            msg = self._sock.recv(1 << 16) if r else b""
        except OSError as exc:
            self.broken = True
            raise WarmSpawnError(f"the warm spawner is gone ({exc})") from exc
        if not msg:
            self.broken = True
            raise WarmSpawnError("the warm spawner did not answer" if not r else "the warm spawner exited")
        reply = json.loads(msg)
        if "pid" not in reply:
            raise WarmSpawnError(f"the warm spawner failed: {reply.get('error')}")
        return int(reply["pid"])

    def fork_standby(self, local_rank: int, timeout: float = 5.0, slot_dir: Optional[str] = None,
                     cuda_visible: Optional[str] = None,
                     prerun: Optional[dict[str, Any]] = None) -> tuple[int, socket.socket]:
        """Fork a standby for `local_rank` (agent/workers/standby.py): (its pid, the agent's end of its socket, on which
        it reports ready and receives the rank it becomes); `slot_dir`: where that rank's snapshot slots will
        be, for the standby to map and pin ahead; `cuda_visible`: the CUDA_VISIBLE_DEVICES its rank will have, where
        not the zygote's (--virtual-local-rank); `prerun`: {argv, env, cwd} to run the script ahead with, up to its
        first HPWrapper call (--standby-prerun, agent/workers/prerun.py). Raises WarmSpawnError."""
        if not self.check_ready():
            raise WarmSpawnError("the warm spawner is not ready (still importing, or gone)")
        from hyperpodrun.launch import settings
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self._sock, [json.dumps({"standby": True, "local_rank": local_rank,
                                                   "slot_dir": slot_dir, "cuda_visible": cuda_visible,
                                                   "kernel_warm": settings.current().standby_kernel_warm,
                                                   **({"prerun": prerun} if prerun else {})}).encode()],
                            [theirs.fileno()])
            r, _, _ = select.select([self._sock], [], [], timeout)
            msg = self._sock.recv(1 << 16) if r else b""
        except OSError as exc:
            ours.close()
            self.broken = True
            raise WarmSpawnError(f"the warm spawner is gone ({exc})") from exc
        finally:
            theirs.close()
        if not msg:
            ours.close()
            self.broken = True
            raise WarmSpawnError("the warm spawner did not answer" if not r else "the warm spawner exited")
        reply = json.loads(msg)
        if "pid" not in reply:
            ours.close()
            raise WarmSpawnError(f"the warm spawner failed: {reply.get('error')}")
        return int(reply["pid"]), ours

    def close(self) -> None:
        """Stop the zygote (EOF on its socket), killing it if it does not exit at once (it may be importing;
        the workers it forked are in sessions of their own and not affected)."""
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class AdoptedProcess:
    """A Popen stand-in for a worker the zygote forked: this agent became its parent when the zygote's middle
    process exited (a subreaper), so its exit status is collected with waitpid like any child's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # for a moment still the middle process's child; or gone without us (then it is not in /proc)
            if os.path.exists(f"/proc/{self.pid}"):
                return None
            log.warning("lost the exit status of worker pid %d", self.pid)
            self.returncode = 1
            return self.returncode
        if pid == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode
