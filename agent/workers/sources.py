"""Worker sources: where a worker process comes from (the WorkerSource port, agent/ports.py).

- ColdSpawn: a new interpreter in its own session (subprocess); always serves.
- WarmFork: the zygote (agent/workers/warm_spawner.py, agent/workers/zygote.py) that has imported torch forks the worker
  in milliseconds; it serves respawns once its imports are done, and declines (None) otherwise.
- StandbyPool (agent/workers/standby.py): processes forked ahead from the zygote, with their CUDA context made,
  that become a rank which died (--standby-workers). The launcher (agent/workers/launch.py) asks the fast sources first
for a respawn and falls back to a cold spawn (docs/ARCHITECTURE.md, "Worker sources").
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from hyperpodrun.agent.workers import warm_spawner
from hyperpodrun.agent.ports import Events, SpawnRequest
from hyperpodrun.agent.workers.supervisor import Supervisor, WorkerProcess
from hyperpodrun.agent.workers.warm_spawner import AdoptedProcess

log = logging.getLogger("hyperpodrun.agent")


class ColdSpawn:
    """A fresh `python script` (or the user's program) per worker."""

    name = "cold"

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    def spawn(self, req: SpawnRequest) -> WorkerProcess:
        return self.sup.spawn(req.local_rank, req.rank, req.generation, list(req.argv), dict(req.env), req.stdout,
                              req.stderr)


class WarmFork:
    """Respawned workers forked from the warm zygote. Used from the agent's loop thread only.

    `usable`: the entry point is a plain `python script` (not -m, not --no-python), warm respawns are on
    (HYPERPODRUN_WARM_RESPAWN), and the agent is a subreaper (it must become the forked worker's parent)."""

    name = "warm"

    def __init__(self, sup: Supervisor, events: Events, base_env: dict[str, str], argv: list[str],
                 log_path: str, usable: bool) -> None:
        self.sup = sup
        self.events = events
        self.base_env = base_env
        self.argv = argv
        self.log_path = log_path
        self.usable = usable
        self.spawner: Optional[warm_spawner.WarmSpawner] = None
        self._noted = False

    def start(self) -> None:
        """Start the zygote (once every first worker has started, so its imports do not compete); never fatal."""
        if self.spawner is not None or not self.usable:
            return
        try:
            self.spawner = warm_spawner.WarmSpawner(self.base_env, self.argv[2], self.log_path)
        except OSError as exc:
            log.info("no warm respawns: the warm spawner did not start (%s)", exc)
            return
        self.sup.track_extra(self.spawner.pid)
        self.sup.reaper.add(self.spawner.pid)

    def poll(self) -> None:
        """Note once in the event log when the zygote has done its imports (respawns are warm from then)."""
        w = self.spawner
        if w is None or self._noted or not w.check_ready():
            return
        self._noted = True
        info = w.ready or {}
        failed = info.get("failed") or []
        self.events.emit("warm_ready", f"warm respawns ready: imports took {info.get('import_s')} s"
                         f"{'; not imported: ' + '; '.join(failed) if failed else ''}",
                         import_s=info.get("import_s"), pid=w.pid, level=logging.DEBUG)

    def spawn(self, req: SpawnRequest) -> Optional[WorkerProcess]:
        if self.spawner is None:
            return None
        fds = [fd if fd is not None else std for fd, std in zip((req.stdout, req.stderr), (1, 2))]
        try:
            pid = self.spawner.spawn(list(req.argv[2:]), dict(req.env), os.getcwd(), fds[0], fds[1])
        except warm_spawner.WarmSpawnError as exc:
            log.info("rank %d: starting it the normal way: %s", req.rank, exc)
            return None
        return self.sup.adopt(req.local_rank, req.rank, req.generation, AdoptedProcess(pid), source=self.name)

    def end(self) -> None:
        """The job completed: stop the zygote at once (no respawn is coming; its teardown of torch would only
        compete with the workers' exit). The workers it forked live in sessions of their own."""
        if self.spawner is not None:
            try:
                self.spawner.proc.kill()
            except OSError:
                pass
        self.stop()

    def stop(self) -> None:
        if self.spawner is not None:
            self.spawner.close()
            self.sup.reaper.remove(self.spawner.pid)
            self.spawner = None
