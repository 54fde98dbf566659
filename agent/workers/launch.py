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
from hyperpodrun.launch import settings
from hyperpodrun.agent.workers import prerun, warm_spawner
from hyperpodrun.agent.ports import Events, RendezvousInfo, SpawnRequest, WorkerSource
from hyperpodrun.agent.workers.sources import ColdSpawn, WarmFork
from hyperpodrun.agent.workers.standby import StandbyPool
from hyperpodrun.agent.workers.supervisor import Supervisor, WorkerProcess
from hyperpodrun.agent.workers.tee import Tee, worker_pipe
from hyperpodrun.launch.config import STD_ALL, STD_ERR, STD_OUT, LaunchConfig
from hyperpodrun.launch.flag_syntax import render_prefix
from hyperpodrun import auth
from hyperpodrun.env import (INPROCESS_NCCL_DEFAULTS, WorkerIdentity, hand_down_hook,
                             inprocess_env_overrides, keep_on_loopback, virtual_local_rank_env, worker_env)
from hyperpodrun.errors import ConfigError
from hyperpodrun.state.slots import shm_runs

log = logging.getLogger("hyperpodrun.agent")


def worker_argv(cfg: LaunchConfig) -> list[str]:
    """The command each worker runs (torchrun's rules: `python -u script`, `-m`, `--no-python`)."""
    if cfg.no_python and not cfg.run_path:
        return [cfg.entrypoint, *cfg.args]
    if cfg.module:
        return [sys.executable, "-u", "-m", cfg.entrypoint, *cfg.args]
    return [sys.executable, "-u", cfg.entrypoint, *cfg.args]


def standby_spawner(cfg: LaunchConfig, sup: Supervisor, subreaper: bool) -> Optional[warm_spawner.WarmSpawner]:
    """A warm spawner started while this agent waits as a hot spare or a replacement, so that its workers are
    forked with torch imported when it takes over a lost node (None where warm forks cannot be used). It gets
    no job secret: each forked worker gets its whole environment with the fork request."""
    if not (subreaper and warm_spawner.enabled() and not cfg.module and not cfg.no_python):
        return None
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and cfg.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    try:
        spawner = warm_spawner.WarmSpawner(env, worker_argv(cfg)[2], None)
    except OSError as exc:
        log.info("no warm start for a hot spare: the warm spawner did not start (%s)", exc)
        return None
    sup.track_extra(spawner.pid)
    sup.reaper.add(spawner.pid)
    log.info("hot spare: importing torch ahead (warm spawner pid %d)", spawner.pid)
    return spawner


def bind_process(pid: int, cpus: list[int]) -> None:
    """--numa-binding: every thread of worker `pid` onto `cpus` (torch.numa.binding's choice); the threads it
    starts later inherit it. Applied however the worker came (a cold spawn, a zygote fork, a standby)."""
    if not cpus:
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:   # a thread that just ended; a worker already gone is the supervisor's news
            pass


class WorkerLauncher:
    """Spawns this node's workers for a generation and wires their logs (the Launcher port). The processes
    come from its worker sources: the fast ones first for a respawn (warm fork), else a cold spawn."""

    def __init__(self, cfg: LaunchConfig, rdzv: RendezvousInfo, run_dir: str, host: str, sup: Supervisor, tee: Tee,
                 events: Events, control: Optional[str] = None,
                 on_spawn: Optional[Callable[[int, int], None]] = None,
                 env_for: Optional[Callable[[int], dict[str, str]]] = None, subreaper: bool = False,
                 standby: Optional[warm_spawner.WarmSpawner] = None, shm_dir: Optional[str] = None) -> None:
        self.cfg = cfg
        self.shm_dir = shm_dir      # a private slot base for the workers (agent/security/slot_base.py); None: theirs
        self.rdzv = rdzv
        self.run_dir = run_dir
        self.host = host
        self.sup = sup
        self.tee = tee
        self.events = events
        self.control = control
        self.on_spawn = on_spawn
        self.env_for = env_for      # per-rank additions (a rank moved to a spare GPU: CUDA_VISIBLE_DEVICES)
        # where generation g's workers' store listens (another agent's address with a standalone coordinator)
        self.store_addr: Callable[[int], str] = lambda generation: self.rdzv.master_addr
        self.argv = worker_argv(cfg)
        self.base_env = self._base_env()
        self.cold = ColdSpawn(sup)
        self.warm = WarmFork(sup, events, self.base_env, self.argv, os.path.join(run_dir, "warm_spawner.log"),
                             usable=subreaper and warm_spawner.enabled() and not cfg.module and not cfg.no_python)
        if standby is not None:        # started while this agent waited as a hot spare: its imports are done
            self.warm.spawner = standby
        self.standbys = StandbyPool(sup, events, self.warm, cfg.standby_workers, cfg.nproc_per_node, self.base_env,
                                    self.slot_dir, cuda_for=self._standby_cuda if cfg.virtual_local_rank else None,
                                    prerun_for=self.prerun_spec if cfg.standby_prerun == "auto" else None)
        # tried first for a respawn, in this order
        self.fast: list[WorkerSource] = [self.standbys, self.warm] if cfg.standby_workers else [self.warm]
        self._say_standbys()
        self._paths: dict[int, tuple[Optional[str], Optional[str], str]] = {}  # pid -> (out, err, error file)
        self._streams: dict[int, list[int]] = {}   # pid -> its tee streams (pipes)

    def _say_standbys(self) -> None:
        """Under --inprocess-restart, say at start how many standbys this node keeps and why: the default
        `--standby-workers auto` decides by the host, so the line tells a user what they got and how to
        change it."""
        cfg = self.cfg
        if not cfg.inprocess_restart:
            return
        n = cfg.standby_workers
        why = cfg.standby_auto or f"--standby-workers {n}"
        if n and not self.warm.usable:   # a standby is forked by the warm spawner
            why += "; none will start: warm respawns are off here (HYPERPODRUN_WARM_RESPAWN, or no subreaper)"
        elif not n and cfg.standby_auto:
            why += "; --standby-workers N starts them anyway"
        elif n and cfg.standby_prerun == "auto":
            why += "; each runs the script ahead to its first HPWrapper call (--standby-prerun auto)"
        self.events.emit("standby_workers", f"standby workers: {f'{n} per local rank' if n else 'off'} ({why})",
                         per_local_rank=n, auto=cfg.standby_auto is not None)

    def slot_dir(self, local_rank: int) -> str:
        """Where a rank of this local rank keeps its snapshot slots (CheckpointManager's default place)."""
        return shm_runs.slot_dir(local_rank, run=self.rdzv.run_id, owner=os.getpid(), shm_dir=self.shm_dir)

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env and self.cfg.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
            log.warning("setting OMP_NUM_THREADS=1 for each worker (torchrun's default with several workers "
                        "per node); set it yourself to tune")
        auth.hand_down_key(env, self.rdzv.secret)
        if self.shm_dir is not None:   # the usual slot base is squatted: the agent's private one
            env[settings.variable("shm_dir")] = self.shm_dir
        if self.rdzv.single_node:   # every peer is on this host: the workers' listeners stay on loopback
            for name in keep_on_loopback(env):
                log.debug("%s=%s for each worker (one node: loopback only; set it yourself to choose)", name,
                          env[name])
        hand_down_hook(env)     # the roll call in every worker's init_process_group (runtime/group_hook.py)
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(signal.Signals(s).name for s in self.cfg.signals_to_handle)
        if self.cfg.inprocess_restart:
            for name in inprocess_env_overrides(env):
                log.warning("%s=%s is set: under --inprocess-restart hyperpodrun would set %s=%s (docs/flags.md, Worker "
                            "environment); keeping your value", name, env[name], name, INPROCESS_NCCL_DEFAULTS[name])
        return env

    def identity(self, local_rank: int) -> WorkerIdentity:
        return WorkerIdentity(local_rank=local_rank, rank=self.rdzv.rank_offset + local_rank,
                              world_size=self.rdzv.world_size, local_world_size=self.cfg.nproc_per_node,
                              group_rank=self.rdzv.group_rank, group_world_size=self.rdzv.nnodes, role=self.cfg.role)

    @staticmethod
    def _virtual(env: dict[str, str], local_rank: int) -> dict[str, str]:
        """--virtual-local-rank's LOCAL_RANK and CUDA_VISIBLE_DEVICES (hyperpodrun/env.py). The launch checked
        the user's CUDA_VISIBLE_DEVICES; a GPU map's list too short for this local rank lists its GPU first."""
        try:
            return virtual_local_rank_env(env, local_rank)
        except ConfigError:
            return virtual_local_rank_env(env, 0)

    def _standby_cuda(self, local_rank: int) -> str:
        """Under --virtual-local-rank, the CUDA_VISIBLE_DEVICES a standby of `local_rank` makes its context with."""
        return self._virtual(self.base_env, local_rank)["CUDA_VISIBLE_DEVICES"]

    def console_prefix(self, local_rank: int) -> str:
        """What goes before each console line of a local rank: --log-line-prefix-template rendered as torchrun
        does (hyperpodrun/launch/flag_syntax.py, render_prefix), else `[host:rank]: `."""
        who = self.identity(local_rank)
        if self.cfg.log_line_prefix_template:   # "" is torchrun's "not given" too
            return render_prefix(self.cfg.log_line_prefix_template, who.role, who.rank, local_rank, self.host)
        return f"[{self.host}:{who.rank}]: "

    def _duplicate(self, bit: int, generation: int) -> Optional[tuple[str, list[str]]]:
        """--duplicate-stdout/stderr-filters: (the generation's filtered_stdout.log / filtered_stderr.log,
        the filters) for a stream, or None. Every rank started in a generation appends its matching teed lines,
        prefixed, to that one file (torchrun's <log_dir>/<run_id>/attempt_<n>/filtered_*.log)."""
        needles = self.cfg.duplicate_stdout_filters if bit == STD_OUT else self.cfg.duplicate_stderr_filters
        if not needles:
            return None
        name = "filtered_stdout.log" if bit == STD_OUT else "filtered_stderr.log"
        return os.path.join(self.run_dir, f"attempt_{generation}", name), needles

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

    def worker_env(self, local_rank: int, generation: int, store_port: int, error_file: str) -> dict[str, str]:
        """The whole environment of local rank `local_rank`'s worker in `generation`."""
        env = worker_env(self.base_env, self.identity(local_rank), master_addr=self.store_addr(generation),
                         master_port=store_port, generation=generation, max_restarts=self.cfg.max_restarts,
                         run_id=self.rdzv.run_id, error_file=error_file, run_dir=self.run_dir, host=self.host,
                         control=self.control, inprocess=self.cfg.inprocess_restart,
                         heartbeat_interval=self.cfg.heartbeat_interval)
        if self.env_for is not None:
            env.update(self.env_for(local_rank))
        if self.cfg.virtual_local_rank:   # after the GPU map's: a rank moved to a spare GPU gets that one
            env.update(self._virtual(env, local_rank))
        return env

    def prerun_spec(self, local_rank: int) -> dict[str, Any]:
        """What a standby of `local_rank` runs the script ahead with (--standby-prerun, agent/workers/prerun.py):
        the worker's argv and directory, its environment without the variables that name a rank."""
        env = prerun.ahead_env(self.worker_env(local_rank, 0, 0, ""))
        return {"argv": self.argv[2:], "env": env, "cwd": os.getcwd()}

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
        env = self.worker_env(local_rank, generation, store_port, error_file)
        # each stream that is kept in a file or teed is a pipe the agent drains (agent/workers/tee.py); one that is
        # neither goes straight to the agent's console (None: inherited)
        prefix = self.console_prefix(local_rank)
        ends: list[Optional[int]] = []
        streams: list[int] = []
        try:
            for bit, path, console in ((STD_OUT, out, 1), (STD_ERR, err, 2)):
                if not (to_file | teed) & bit:
                    ends.append(None)
                    continue
                r, w = worker_pipe()
                ends.append(w)
                streams.append(self.tee.attach(r, path, console if teed & bit else None, prefix,
                                               self._duplicate(bit, generation)))
            req = SpawnRequest(local_rank=local_rank, rank=who.rank, generation=generation, argv=self.argv, env=env,
                               stdout=ends[0], stderr=ends[1])
            proc = next((p for p in (source.spawn(req) for source in self.fast) if p is not None), None) \
                if warm else None
            if proc is None:
                proc = self.cold.spawn(req)   # always serves (or raises WorkerSpawnError)
        except BaseException:
            for key in streams:
                self.tee.release(key)
            raise
        finally:
            for end in ends:
                if end is not None:
                    os.close(end)
        if self.cfg.numa_cpus:
            bind_process(proc.pid, self.cfg.numa_cpus.get(local_rank, []))
        self._paths[proc.pid] = (out, err, error_file)
        self._streams[proc.pid] = streams
        if self.on_spawn is not None:
            self.on_spawn(local_rank, proc.pid)
        warmed = proc.source != self.cold.name
        how = {self.warm.name: ", forked warm", self.standbys.name: ", from a standby"}.get(proc.source, "")
        self.events.emit("worker_start", f"rank {who.rank} started (pid {proc.pid}, generation {generation}{how})",
                         rank=who.rank, pid=proc.pid, generation=generation, warm=warmed, source=proc.source,
                         level=logging.DEBUG)
        return proc

    def start_warm_spawner(self) -> None:
        """Start the zygote that forks respawned workers (agent/workers/sources.py, WarmFork) and, once it is ready, the
        standbys it forks (agent/workers/standby.py)."""
        self.standbys.stopped = False
        self.warm.start()

    def poll_warm_spawner(self) -> None:
        self.warm.poll()
        self.standbys.poll()

    def end_warm_spawner(self) -> None:
        """The job completed: no respawn is coming, the standbys and the zygote go at once."""
        self.standbys.stop()
        self.warm.end()

    def stop_warm_spawner(self) -> None:
        self.standbys.stop()
        self.warm.stop()

    def spawn_all(self, generation: int, store_port: int, warm: bool = False) -> None:
        """Start every local rank for `generation`; `warm`: fork them from the warm spawner when it is ready (a
        hot spare's, which imported torch while it waited)."""
        for lr in range(self.cfg.nproc_per_node):
            self.spawn(lr, generation, store_port, warm=warm)
        self.events.emit("workers_started", f"generation {generation}: started {self.cfg.nproc_per_node} workers "
                         f"(store {self.store_addr(generation)}:{store_port})", generation=generation)

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
