"""The per-node agent: one event loop thread owns all state (DESIGN §6).

Sources the loop waits on: worker exits (pidfds), a wake-up pipe (signals, helper-thread events), the
control socket (in-process restart), and deadlines. Helper threads (store watcher, log tee) never touch
the state; they post events.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import time
from typing import Any, Optional

import zmq

from agent import stores
from agent.coordination import Coordinator, Watcher
from agent.events import EventLog
from agent.hooks import run_hook
from agent.rendezvous import Rendezvous, hostname, rendezvous
from agent.report import failure_summary
from agent.supervisor import Reaper, Supervisor, WorkerProcess, become_subreaper, describe_exit, shell_code
from agent.tee import Tee
from agent.workers import WorkerLauncher
from hyperpodrun.config import LaunchConfig
from hyperpodrun.errors import EXIT_AGENT_ERROR, EXIT_RESTARTS_EXHAUSTED, HyperpodrunError

log = logging.getLogger("hyperpodrun.agent")


class Agent:
    """Runs this node's workers until the job succeeds, fails, or the agent is told to stop."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.host = hostname()
        self.events = EventLog(self.host)
        self._posted: "queue.Queue[tuple]" = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._signals: list[int] = []
        self.reaper: Optional[Reaper] = None
        self.sup: Optional[Supervisor] = None
        self.tee: Optional[Tee] = None
        self.rdzv: Optional[Rendezvous] = None
        self.coord: Optional[Coordinator] = None
        self.watcher: Optional[Watcher] = None
        self.wstores: Optional[stores.WorkerStores] = None
        self.launcher: Optional[WorkerLauncher] = None
        self.generation = 0
        self.exit_code: Optional[int] = None
        # process-level state machine
        self.phase = "starting"            # starting | running | stopping | awaiting_store | finishing | done
        self.stop_then: Optional[tuple] = None  # ("restart", g) | ("exit", code)
        self.stop_deadline: Optional[float] = None
        self.stop_started = 0.0
        self.killed_all = False
        self.first_failure: Optional[dict[str, Any]] = None
        self.pending_generation: Optional[int] = None
        self.detect_t: Optional[float] = None
        self.finish_deadline: Optional[float] = None

    # ----------------------------------------------------------------------------------------- entry
    def run(self) -> int:
        """Run the job on this node and return the process exit code."""
        try:
            return self._run()
        except HyperpodrunError as exc:
            self.events.emit("agent_error", f"hyperpodrun: {exc}", level=logging.ERROR)
            return EXIT_AGENT_ERROR
        finally:
            self._cleanup()

    def _run(self) -> int:
        cfg = self.cfg
        become_subreaper()
        self.reaper = Reaper()
        self.sup = Supervisor(self.reaper)
        self._install_signals()
        self.rdzv = rendezvous(cfg)
        run_dir = self._make_run_dir(self.rdzv.run_id)
        self.events.open(os.path.join(run_dir, f"node{self.rdzv.node_rank}.events.jsonl"), self.rdzv.node_rank)
        self.events.emit("agent_start", f"hyperpodrun agent on {self.host}: node {self.rdzv.node_rank}/"
                         f"{self.rdzv.nnodes}, ranks {self.rdzv.rank_offset}..{self.rdzv.rank_offset + cfg.nproc_per_node - 1}"
                         f" of {self.rdzv.world_size}, run dir {run_dir}", run_id=self.rdzv.run_id, pid=os.getpid())
        self.coord = Coordinator(self.rdzv.store, self.rdzv.nnodes, cfg.max_restarts)
        if self.rdzv.store_host:
            self.wstores = stores.WorkerStores("0.0.0.0" if not self.rdzv.single_node else "127.0.0.1")
        self.tee = Tee()
        self.launcher = WorkerLauncher(cfg, self.rdzv, run_dir, self.host, self.sup, self.tee, self.events)

        if cfg.pre_train_script:
            code = run_hook("pre-train", cfg.pre_train_script, cfg.pre_train_args, self.events, self.sup)
            if code != 0:
                return code
        if self._signals:
            return 128 + self._signals[0]
        if not self.rdzv.single_node:
            endpoint = self.rdzv.store_endpoint
            assert endpoint is not None
            run_id = self.rdzv.run_id
            self.watcher = Watcher(
                lambda: stores.prefixed(f"hyperpodrun/{run_id}/", stores.open_tcp_store(
                    endpoint[0], endpoint[1], server=False, timeout_s=cfg.join_timeout)),
                self.post, cfg.monitor_interval)
            self.watcher.start()
        self.generation = self.coord.generation()
        self._enter_generation(self.generation)
        code = self._loop()
        if cfg.post_train_script:
            post = run_hook("post-train", cfg.post_train_script, cfg.post_train_args, self.events, self.sup)
            if code == 0 and post != 0:
                code = post
        return code

    # ------------------------------------------------------------------------------------ plumbing
    def post(self, event: tuple) -> None:
        """Thread-safe: queue an event for the loop and wake it."""
        self._posted.put(event)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self._signals.append(signum)
            try:
                os.write(self._wake_w, b"s")
            except BlockingIOError:
                pass
        for sig in self.cfg.signals_to_handle:
            signal.signal(sig, handler)

    def _make_run_dir(self, run_id: str) -> str:
        path = os.path.join(self.cfg.log_dir, run_id)
        os.makedirs(path, exist_ok=True)
        return path

    # ------------------------------------------------------------------------------------ the loop
    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: set[int] = set()
        assert self.sup is not None
        while self.phase != "done":
            fds = set(self.sup.pidfds())
            for fd in registered - fds:
                poller.unregister(fd)
            for fd in fds - registered:
                poller.register(fd, zmq.POLLIN)
            registered = fds
            timeout = self.cfg.monitor_interval
            for deadline in (self.stop_deadline, self.finish_deadline):
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            poller.poll(timeout * 1000)
            self._drain_wake()
            self._tick()
        for fd in registered:
            poller.unregister(fd)
        assert self.exit_code is not None
        return self.exit_code

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _tick(self) -> None:
        assert self.sup is not None
        while self._signals:
            self._on_signal(self._signals.pop(0))
        while True:
            try:
                event = self._posted.get_nowait()
            except queue.Empty:
                break
            self._on_posted(event)
        for proc in self.sup.poll_exits():
            self._on_exit(proc)
        self.sup.reap_orphans()
        now = time.monotonic()
        if self.phase == "stopping":
            self._advance_stop(now)
        if self.phase == "awaiting_store":
            self._try_spawn_pending()
        if self.phase == "finishing":
            self._advance_finish(now)

    # ------------------------------------------------------------------------------------ handlers
    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        assert self.sup is not None
        self.events.emit("signal", f"received {name}: forwarding it to every worker, SIGKILL after "
                         f"{self.cfg.shutdown_timeout:g}s", signal=name)
        if self.stop_then and self.stop_then[0] == "exit" and self.phase == "stopping":
            self.sup.signal_all(signum)   # a second signal: forward it too, keep the first deadline
            return
        self._begin_stop(("exit", 128 + signum), signum)

    def _on_posted(self, event: tuple) -> None:
        kind = event[0]
        if kind == "generation":
            self._on_remote_generation(int(event[1]))
        elif kind == "failed":
            self._on_remote_failure(event[1])
        elif kind == "store_lost":
            if self.phase not in ("done",) and not (self.phase == "finishing" and not self.rdzv.store_host):
                if self.phase != "stopping":
                    self.events.emit("store_lost", f"lost the coordination store ({event[1]}); stopping this node",
                                     level=logging.ERROR)
                    self._begin_stop(("exit", EXIT_AGENT_ERROR), self.cfg.shutdown_signal)

    def _on_remote_generation(self, gen: int) -> None:
        if gen <= self.generation or (self.stop_then and self.stop_then[0] == "restart" and self.stop_then[1] >= gen):
            return
        if self.phase in ("done",) or (self.stop_then and self.stop_then[0] == "exit"):
            return
        self.detect_t = time.monotonic()
        self.events.emit("restart_remote", f"another node started generation {gen}: restarting this node's workers",
                         generation=gen)
        self._begin_stop(("restart", gen), self.cfg.shutdown_signal)

    def _on_remote_failure(self, info: dict[str, Any]) -> None:
        if self.phase == "done" or (self.stop_then and self.stop_then[0] == "exit"):
            return
        self.first_failure = self.first_failure or info
        self.events.emit("job_failed_remote", f"job failed on {info.get('host')}: {info.get('summary', '')}",
                         level=logging.ERROR)
        self._begin_stop(("exit", int(info.get("exit_code", 1))), self.cfg.shutdown_signal)

    def _on_exit(self, proc: WorkerProcess) -> None:
        assert self.sup is not None and self.tee is not None and self.launcher is not None
        code = proc.returncode
        assert code is not None
        self.launcher.on_exit(proc)
        self.events.emit("worker_exit", f"rank {proc.rank} (pid {proc.pid}) exited: {describe_exit(code)}",
                         rank=proc.rank, pid=proc.pid, exit_code=code, generation=proc.generation,
                         level=logging.INFO if code == 0 or proc.signalled else logging.WARNING)
        if self.phase != "running":
            return
        if code == 0:
            if all(p.returncode == 0 for p in self.sup.workers.values()):
                self._on_local_success()
            return
        self.detect_t = time.monotonic()
        self._on_worker_failure(proc, code)

    def _on_worker_failure(self, proc: WorkerProcess, code: int) -> None:
        assert self.coord is not None and self.launcher is not None
        info = {"host": self.host, "rank": proc.rank, "local_rank": proc.local_rank, "pid": proc.pid,
                "exit_code": shell_code(code), "cause": describe_exit(code), "generation": self.generation,
                "error_file": self.launcher.error_file(proc)}
        info["summary"] = failure_summary(info)
        self.events.emit("fault", f"rank {proc.rank} failed: {describe_exit(code)}", rank=proc.rank,
                         exit_code=shell_code(code), generation=self.generation, level=logging.ERROR)
        target, started, budget_ok = self.coord.request_restart(self.generation, info)
        if budget_ok:
            used = self.coord.restarts_used()
            self.events.emit("restart_begin", f"process-level restart {min(used, self.cfg.max_restarts)}/"
                             f"{self.cfg.max_restarts}: generation {self.generation} -> {target}",
                             generation=target, root_cause=info["summary"])
            self._begin_stop(("restart", target), self.cfg.shutdown_signal)
            return
        self.first_failure = info
        self.coord.report_failure(info)
        self._begin_stop(("exit", info["exit_code"]), self.cfg.shutdown_signal)

    def _on_local_success(self) -> None:
        assert self.coord is not None and self.rdzv is not None
        self.events.emit("workers_done", f"all {self.cfg.nproc_per_node} local workers finished successfully",
                         generation=self.generation)
        if self.rdzv.single_node:
            self._finish(0)
            return
        self.coord.mark_done(self.generation)
        self.phase = "finishing"
        self.finish_deadline = time.monotonic() + max(300.0, self.cfg.join_timeout)

    def _advance_finish(self, now: float) -> None:
        assert self.coord is not None and self.rdzv is not None
        try:
            if self.coord.done_count(self.generation) >= self.rdzv.nnodes:
                left = self.coord.mark_left()
                if self.rdzv.store_host:   # keep serving the store until every agent has read the result
                    end = time.monotonic() + 10
                    while left < self.rdzv.nnodes and time.monotonic() < end:
                        time.sleep(0.05)
                        left = self.coord.left_count()
                self._finish(0)
                return
        except Exception as exc:  # the host finished and went away: our part is done
            self.events.emit("store_gone", f"coordination store closed after completion ({exc})")
            self._finish(0)
            return
        if self.finish_deadline is not None and now > self.finish_deadline:
            self.events.emit("exit_barrier_timeout", "other nodes did not finish in time", level=logging.ERROR)
            self._finish(EXIT_AGENT_ERROR)

    # ------------------------------------------------------------------------------------ stopping
    def _begin_stop(self, then: tuple, sig: int) -> None:
        """Signal every live worker's process group; SIGKILL after --shutdown-timeout."""
        assert self.sup is not None
        self.stop_then = then
        self.phase = "stopping"
        self.stop_started = time.monotonic()
        self.stop_deadline = self.stop_started + self.cfg.shutdown_timeout
        self.killed_all = False
        live = self.sup.live()
        if live:
            self.sup.signal_all(sig, live)
        self._advance_stop(time.monotonic())

    def _advance_stop(self, now: float) -> None:
        assert self.sup is not None
        live = self.sup.live()
        if live and self.stop_deadline is not None and now >= self.stop_deadline and not self.killed_all:
            self.events.emit("shutdown_timeout", f"{len(live)} worker(s) still alive after "
                             f"{self.cfg.shutdown_timeout:g}s: SIGKILL", level=logging.WARNING)
            self.sup.signal_all(signal.SIGKILL, live)
            self.killed_all = True
        if live:
            return
        self.stop_deadline = None
        stopped_in = now - self.stop_started
        then = self.stop_then
        self.stop_then = None
        assert then is not None
        if then[0] == "restart":
            self.events.emit("workers_stopped", f"all workers stopped in {stopped_in:.3f}s", duration_s=stopped_in)
            self.pending_generation = int(then[1])
            self.phase = "awaiting_store"
            self._try_spawn_pending()
        else:
            self._finish(int(then[1]))

    def _try_spawn_pending(self) -> None:
        assert self.pending_generation is not None
        gen = self.pending_generation
        if self._enter_generation(gen):
            self.pending_generation = None
            if self.detect_t is not None:
                took = time.monotonic() - self.detect_t
                self.events.emit("restart_done", f"generation {gen}: all {self.cfg.nproc_per_node} workers "
                                 f"respawned {took:.3f}s after the fault", generation=gen, downtime_s=took)
                self.detect_t = None

    def _enter_generation(self, gen: int) -> bool:
        """Spawn every local worker for generation `gen` once its store is known; False: not yet."""
        assert self.coord is not None and self.launcher is not None and self.rdzv is not None
        if self.rdzv.store_host:
            assert self.wstores is not None
            if self.wstores.get(gen) is None:
                port = self.wstores.open(gen)
                self.coord.publish_worker_store(gen, port)
        port_or_none = self.coord.worker_store_port(gen)
        if port_or_none is None:
            self.phase = "awaiting_store"
            self.pending_generation = gen
            return False
        self.generation = gen
        self.launcher.spawn_all(gen, port_or_none)
        self.phase = "running"
        return True

    def _finish(self, code: int) -> None:
        self.exit_code = code
        self.phase = "done"
        if code != 0 and self.first_failure is not None:
            summary = failure_summary(self.first_failure, with_traceback=True)
            self.events.emit("job_failed", summary, level=logging.ERROR, exit_code=code)
        elif code == 0:
            self.events.emit("job_done", "job finished successfully", exit_code=0)
        else:
            self.events.emit("agent_exit", f"agent exiting with code {code}", exit_code=code)

    def _cleanup(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.sup is not None:
            live = self.sup.live()
            if live:
                self.sup.signal_all(signal.SIGKILL, live)
                end = time.monotonic() + 5
                while self.sup.live() and time.monotonic() < end:
                    self.sup.poll_exits()
                    time.sleep(0.01)
        if self.tee is not None:
            self.tee.close()
        if self.reaper is not None:
            self.reaper.close()
        if self.wstores is not None:
            self.wstores.close_all()
        self.events.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        sys.stdout.flush()
