"""Turning the launch config into worker processes: argv, environment, per-rank log files, tee.

Log layout: <log-dir>/<run-id>/attempt_<g>/rank_<r>/{stdout.log,stderr.log,error.json}, where g is the
restart generation the process was started in (a respawned rank starts a new attempt directory; ranks
that survived an in-process restart keep writing to theirs).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable, Optional

from hyperpodrun import safe_fs
from hyperpodrun.agent import warm_spawner
from hyperpodrun.agent.rendezvous import Rendezvous
from hyperpodrun.agent.supervisor import Supervisor, WorkerProcess
from hyperpodrun.agent.warm_spawner import AdoptedProcess
from hyperpodrun.agent.tee import Tee, worker_pipe
from hyperpodrun.config import STD_ALL, STD_ERR, STD_OUT, LaunchConfig
from hyperpodrun.env import WorkerIdentity, hand_down_key, inprocess_env_overrides, worker_env

log = logging.getLogger("hyperpodrun.agent")


def worker_argv(cfg: LaunchConfig) -> list[str]:
    """The command each worker runs (torchrun's rules: `python -u script`, `-m`, `--no-python`)."""
    if cfg.no_python and not cfg.run_path:
        return [cfg.entrypoint, *cfg.args]
    if cfg.module:
        return [sys.executable, "-u", "-m", cfg.entrypoint, *cfg.args]
    return [sys.executable, "-u", cfg.entrypoint, *cfg.args]


class WorkerLauncher:
    """Spawns this node's workers for a generation and wires their logs."""

    def __init__(self, cfg: LaunchConfig, rdzv: Rendezvous, run_dir: str, host: str, sup: Supervisor, tee: Tee,
                 events: Any, control: Optional[str] = None,
                 on_spawn: Optional[Callable[[int, int], None]] = None,
                 env_for: Optional[Callable[[int], dict[str, str]]] = None) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.run_dir = run_dir
        self.host = host
        self.sup = sup
        self.tee = tee
        self.events = events
        self.control = control
        self.on_spawn = on_spawn
        self.env_for = env_for      # per-rank additions (a rank moved to a spare GPU: CUDA_VISIBLE_DEVICES)
        self.argv = worker_argv(cfg)
        self.warm: Optional[warm_spawner.WarmSpawner] = None
        self._warm_noted = False
        self.base_env = self._base_env()
        self._paths: dict[int, tuple[Optional[str], Optional[str], str]] = {}  # pid -> (out, err, error file)
        self._streams: dict[int, list[int]] = {}   # pid -> its tee streams (pipes)

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env and self.cfg.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
            log.warning("setting OMP_NUM_THREADS=1 for each worker (torchrun's default with several workers "
                        "per node); set it yourself to tune")
        hand_down_key(env, self.rdzv.secret)
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(signal.Signals(s).name for s in self.cfg.signals_to_handle)
        if self.cfg.inprocess_restart:
            for name in inprocess_env_overrides(env):
                log.warning("%s=%s is set: under --inprocess-restart hyperpodrun would set %s so NCCL cleans up "
                            "instead of killing the surviving ranks; keeping your value", name, env[name], name)
        return env

    def identity(self, local_rank: int) -> WorkerIdentity:
        return WorkerIdentity(local_rank=local_rank, rank=self.rdzv.rank_offset + local_rank,
                              world_size=self.rdzv.world_size, local_world_size=self.cfg.nproc_per_node,
                              group_rank=self.rdzv.node_rank, group_world_size=self.rdzv.nnodes, role=self.cfg.role)

    def _modes(self, local_rank: int) -> tuple[int, int]:
        """(to file, to console with prefix) bit masks of STD_OUT/STD_ERR for a local rank."""
        cfg = self.cfg
        if not cfg.redirects and not cfg.tee:
            to_file, teed = STD_ALL, STD_ALL            # default: files + prefixed console
        else:
            red = cfg.redirects.get(local_rank, 0)
            tee = cfg.tee.get(local_rank, 0)
            to_file, teed = red | tee, tee
        if local_rank not in cfg.console_ranks():
            to_file, teed = STD_ALL, 0                  # filtered out of the console, still kept in files
        return to_file, teed

    def spawn(self, local_rank: int, generation: int, store_port: int, warm: bool = False) -> WorkerProcess:
        """Start local rank `local_rank` for `generation`; `warm`: fork it from the warm spawner when it can."""
        who = self.identity(local_rank)
        rank_dir = os.path.join(self.run_dir, f"attempt_{generation}", f"rank_{who.rank}")
        error_file = os.path.join(rank_dir, "error.json")
        to_file, teed = self._modes(local_rank)
        try:
            safe_fs.owned_tree(self.run_dir, f"attempt_{generation}", f"rank_{who.rank}")   # no symlinks, ours
            if os.path.exists(error_file):
                os.replace(error_file, error_file + ".prev")
        except OSError as exc:   # a full or broken log filesystem: the rank runs, its output is not kept in files
            self.tee.problem("file", f"cannot create {rank_dir}: {exc.strerror or exc}; worker output is not kept "
                             "in log files (the job goes on)")
            to_file = 0
        out = os.path.join(rank_dir, "stdout.log") if to_file & STD_OUT else None
        err = os.path.join(rank_dir, "stderr.log") if to_file & STD_ERR else None
        env = worker_env(self.base_env, who, master_addr=self.rdzv.master_addr, master_port=store_port,
                         generation=generation, max_restarts=self.cfg.max_restarts, run_id=self.rdzv.run_id,
                         error_file=error_file, run_dir=self.run_dir, host=self.host, control=self.control,
                         inprocess=self.cfg.inprocess_restart, heartbeat_interval=self.cfg.heartbeat_interval)
        if self.env_for is not None:
            env.update(self.env_for(local_rank))
        # each stream that is kept in a file or teed is a pipe the agent drains (agent/tee.py); one that is
        # neither goes straight to the agent's console (None: inherited)
        prefix = f"[{self.host}:{who.rank}]: "
        ends: list[Optional[int]] = []
        streams: list[int] = []
        try:
            for bit, path, console in ((STD_OUT, out, 1), (STD_ERR, err, 2)):
                if not (to_file | teed) & bit:
                    ends.append(None)
                    continue
                r, w = worker_pipe()
                ends.append(w)
                streams.append(self.tee.attach(r, path, console if teed & bit else None, prefix))
            proc = self._warm_spawn(local_rank, who.rank, generation, env, ends) if warm else None
            if proc is None:
                proc = self.sup.spawn(local_rank, who.rank, generation, self.argv, env, ends[0], ends[1])
        except BaseException:
            for key in streams:
                self.tee.release(key)
            raise
        finally:
            for w in ends:
                if w is not None:
                    os.close(w)
        self._paths[proc.pid] = (out, err, error_file)
        self._streams[proc.pid] = streams
        if self.on_spawn is not None:
            self.on_spawn(local_rank, proc.pid)
        warmed = isinstance(proc.popen, AdoptedProcess)
        self.events.emit("worker_start", f"rank {who.rank} started (pid {proc.pid}, generation {generation}"
                         f"{', forked warm' if warmed else ''})", rank=who.rank, pid=proc.pid, generation=generation,
                         warm=warmed, level=logging.DEBUG)
        return proc

    def start_warm_spawner(self) -> None:
        """Start the zygote that forks respawned workers (plain `python script` entry points only)."""
        if self.warm is not None or not warm_spawner.enabled() or self.cfg.module or self.cfg.no_python:
            return
        self.warm = warm_spawner.WarmSpawner(self.base_env, self.argv[2],
                                             os.path.join(self.run_dir, "warm_spawner.log"))
        self.sup.track_extra(self.warm.pid)
        self.sup.reaper.add(self.warm.pid)

    def poll_warm_spawner(self) -> None:
        """Note once in the event log when the warm spawner has done its imports (respawns are warm from then)."""
        w = self.warm
        if w is None or self._warm_noted or not w.check_ready():
            return
        self._warm_noted = True
        info = w.ready or {}
        failed = info.get("failed") or []
        self.events.emit("warm_ready", f"warm respawns ready: imports took {info.get('import_s')} s"
                         f"{'; not imported: ' + '; '.join(failed) if failed else ''}",
                         import_s=info.get("import_s"), pid=w.pid, level=logging.DEBUG)

    def stop_warm_spawner(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.sup.reaper.remove(self.warm.pid)
            self.warm = None

    def _warm_spawn(self, local_rank: int, rank: int, generation: int, env: dict[str, str],
                    ends: list[Optional[int]]) -> Optional[WorkerProcess]:
        if self.warm is None:
            return None
        fds = [fd if fd is not None else std for fd, std in zip(ends, (1, 2))]
        try:
            pid = self.warm.spawn(self.argv[2:], env, os.getcwd(), fds[0], fds[1])
        except warm_spawner.WarmSpawnError as exc:
            log.info("rank %d: starting it the normal way: %s", rank, exc)
            return None
        return self.sup.adopt(local_rank, rank, generation, AdoptedProcess(pid))

    def spawn_all(self, generation: int, store_port: int) -> None:
        for lr in range(self.cfg.nproc_per_node):
            self.spawn(lr, generation, store_port)
        self.events.emit("workers_started", f"generation {generation}: started {self.cfg.nproc_per_node} workers "
                         f"(store {self.rdzv.master_addr}:{store_port})", generation=generation)

    def error_file(self, proc: WorkerProcess) -> Optional[str]:
        paths = self._paths.get(proc.pid)
        return paths[2] if paths else None

    def stderr_log(self, proc: WorkerProcess) -> Optional[str]:
        """The worker's stderr log file; None when its stderr is not kept in a file."""
        paths = self._paths.get(proc.pid)
        return paths[1] if paths else None

    def on_exit(self, proc: WorkerProcess) -> None:
        """Take the rest of an exited worker's output from its pipes (its log files are complete after this)."""
        for key in self._streams.pop(proc.pid, []):
            self.tee.release(key)
