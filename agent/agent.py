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

from hyperpodrun.agent import stores
from hyperpodrun.agent.coordination import Coordinator, Watcher
from hyperpodrun.agent.events import EventLog
from hyperpodrun.agent.control import ControlServer, is_symptom, split_batch, symptom_grace
from hyperpodrun import protocol as P
from hyperpodrun.agent.gpu_health import GpuHealth
from hyperpodrun.agent.hooks import run_hook
from hyperpodrun.agent.inprocess import InProcess
from hyperpodrun.agent.rendezvous import Rendezvous, RendezvousInterrupted, hostname, rendezvous
from hyperpodrun.agent.report import CauseWindow, exit_is_symptom, exit_text, failure_summary
from hyperpodrun.agent.supervisor import Reaper, Supervisor, WorkerProcess, become_subreaper, describe_exit, shell_code
from hyperpodrun.agent.tee import Tee
from hyperpodrun.agent.workers import WorkerLauncher
from hyperpodrun import auth, safe_fs, settings
from hyperpodrun.runtime import shm_runs
from hyperpodrun.config import LaunchConfig, private_log_base, temp_log_base
from hyperpodrun.errors import EXIT_AGENT_ERROR, EXIT_NO_USABLE_GPU, EXIT_RESTARTS_EXHAUSTED, HyperpodrunError

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
        self.control: Optional[ControlServer] = None
        self.inproc: Optional[InProcess] = None
        self.symptom_grace_s = symptom_grace()
        self.causes = CauseWindow(settings.current().exit_grace_s)   # process-level: which rank failed first
        self.subreaper = False
        self.gpu: Optional[GpuHealth] = None
        self._warned_unwrapped = False
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
        self.left_deadline: Optional[float] = None
        self.stopped_by_signal: Optional[int] = None

    # ----------------------------------------------------------------------------------------- entry
    def run(self) -> int:
        """Run the job on this node and return the process exit code."""
        try:
            return self._run()
        except HyperpodrunError as exc:
            self.events.emit("agent_error", f"hyperpodrun: {exc}", level=logging.ERROR)
            return EXIT_AGENT_ERROR
        except RuntimeError as exc:
            # torch's DistError family: a call on the coordination store failed because the agent that hosts it
            # (node 0, or the --rdzv-endpoint host) went away. One line, not a traceback.
            if not any(c.__name__ == "DistError" for c in type(exc).__mro__):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.events.emit("store_lost", f"lost the coordination store ({first}): the node that hosts it is gone "
                             "or unreachable; stopping this node", level=logging.ERROR)
            return EXIT_AGENT_ERROR
        finally:
            self._cleanup()

    def _run(self) -> int:
        cfg = self.cfg
        self.subreaper = become_subreaper() or os.getpid() == 1
        self.reaper = Reaper()
        self.sup = Supervisor(self.reaper)
        self._install_signals()
        try:
            self.rdzv = rendezvous(cfg, stop_requested=lambda: bool(self._signals))
        except RendezvousInterrupted:
            signum = self._signals[0]
            self.events.emit("signal", f"received {signal.Signals(signum).name} while waiting for the other nodes: "
                             "exiting", signal=signal.Signals(signum).name)
            return 128 + signum
        run_dir = self._make_run_dir(self.rdzv.run_id)
        self.events.open(os.path.join(run_dir, f"node{self.rdzv.node_rank}.events.jsonl"), self.rdzv.node_rank)
        self.events.emit("agent_start", f"hyperpodrun agent on {self.host}: node {self.rdzv.node_rank}/"
                         f"{self.rdzv.nnodes}, ranks {self.rdzv.rank_offset}..{self.rdzv.rank_offset + cfg.nproc_per_node - 1}"
                         f" of {self.rdzv.world_size}, run dir {run_dir}", run_id=self.rdzv.run_id, pid=os.getpid())
        if self.rdzv.secret_warning:
            self.events.emit("insecure", self.rdzv.secret_warning, level=logging.WARNING)
        self.coord = Coordinator(self.rdzv.store, self.rdzv.nnodes, cfg.max_restarts,
                                 key=auth.derive(self.rdzv.secret, "store"), run_id=self.rdzv.run_id,
                                 node_rank=self.rdzv.node_rank, on_forged=lambda msg: self.post(("forged", msg)))
        if self.rdzv.store_host:
            self.wstores = stores.WorkerStores(self.rdzv.bind_addr)   # loopback on one node (README, Security)
        self.tee = Tee(on_problem=lambda message: self.post(("output_dropped", message)))
        if cfg.health_check != "none":
            self.gpu = GpuHealth(self)    # NVML monitor thread (or one info line why not): agent/gpu_health.py
            if self.phase == "done":      # a GPU already unusable at start and no spare: exit 76 before any worker
                assert self.exit_code is not None
                return self.exit_code
        if cfg.inprocess_restart or self.gpu is not None:   # the control socket also takes injected GPU events
            self.control = ControlServer()
        if cfg.inprocess_restart:
            self.inproc = InProcess(self)
        if self.control is not None:
            self._write_agent_info(run_dir)
        self.launcher = WorkerLauncher(cfg, self.rdzv, run_dir, self.host, self.sup, self.tee, self.events,
                                       control=self.control.endpoint if self.inproc and self.control else None,
                                       on_spawn=self.inproc.on_spawn if self.inproc else None,
                                       env_for=self.gpu.env_for if self.gpu else None)

        if cfg.pre_train_script and not self._signals:
            code = run_hook("pre-train", cfg.pre_train_script, cfg.pre_train_args, self.events, self.sup,
                            shutdown_timeout=cfg.shutdown_timeout)
            if self._signals:
                return 128 + self._signals[0]
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
                self.post, cfg.monitor_interval, records=self.coord.records_for)
            self.watcher.start()
        self.generation = self.coord.generation()
        self._enter_generation(self.generation)
        code = self._loop()
        if cfg.post_train_script and self.stopped_by_signal is None:   # a container stop must not wait for it
            post = run_hook("post-train", cfg.post_train_script, cfg.post_train_args, self.events, self.sup,
                            shutdown_timeout=cfg.shutdown_timeout)
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

    def _write_agent_info(self, run_dir: str) -> None:
        """Where `hyperpodrun inject` finds this agent."""
        import json
        assert self.control is not None and self.rdzv is not None
        path = os.path.join(run_dir, f"node{self.rdzv.node_rank}.agent.json")
        with os.fdopen(safe_fs.open_private(path + ".tmp"), "w") as fh:
            json.dump({"control": self.control.endpoint, "pid": os.getpid(), "host": self.host,
                       "node_rank": self.rdzv.node_rank, "rank_offset": self.rdzv.rank_offset,
                       "nproc_per_node": self.cfg.nproc_per_node}, fh)
        os.replace(path + ".tmp", path)

    def _make_run_dir(self, run_id: str) -> str:
        """<log-dir>/<run-id>: ours alone under the default log dir; elsewhere a directory of ours that nobody
        else can write (never one another user created or a symlink: hyperpodrun/safe_fs.py)."""
        if self.cfg.log_dir == temp_log_base():
            return safe_fs.private_tree(private_log_base(), run_id)
        return safe_fs.owned_dir(os.path.join(self.cfg.log_dir, run_id))

    # ------------------------------------------------------------------------------------ the loop
    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control.sock, zmq.POLLIN)
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
            for deadline in (self.stop_deadline, self.finish_deadline, self.causes.deadline):
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            poller.poll(timeout * 1000)
            self._drain_wake()
            if self.control is not None:
                self._handle_batch(poller, list(self.control.receive()))
            self._tick()
        for fd in registered:
            poller.unregister(fd)
        assert self.exit_code is not None
        return self.exit_code

    def _handle_batch(self, poller: Any, batch: list) -> None:
        """Handle the control messages read together. A batch whose faults are all symptoms, outside a restart
        round, waits up to symptom_grace() for the real cause (a report or a worker's exit), so that the round
        is logged with the rank that failed rather than one that saw its connection close."""
        assert self.control is not None and self.sup is not None
        symptoms = [m for _, m in batch if isinstance(m, P.Fault)]
        waited = False
        if (symptoms and all(is_symptom(m) for m in symptoms) and self.inproc is not None
                and self.inproc.round is None):
            waited = True
            deadline = time.monotonic() + self.symptom_grace_s
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(left * 1000))
                batch += list(self.control.receive())
                exited = any(fd in ready for fd in self.sup.pidfds())
                if exited or any(isinstance(m, P.Fault) and not is_symptom(m) for _, m in batch):
                    break
        others, faults = split_batch(batch)
        for ident, msg in others:
            self._on_message(ident, msg)
        if waited:
            self._tick()   # worker exits are real causes: before the symptoms they produced
        for ident, msg in faults:
            self._on_message(ident, msg)

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
        if self.launcher is not None:
            self.launcher.poll_warm_spawner()
        now = time.monotonic()
        if self.causes.open:
            if self.phase != "running":
                self.causes.clear()      # stopping for another reason (a signal, another node's restart)
            elif (cause := self.causes.due(now)) is not None:
                self._act_on_cause(cause)
        if self.inproc is not None and self.phase in ("running", "restarting"):
            self.inproc.tick(now)
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
        self.stopped_by_signal = signum
        self._begin_stop(("exit", 128 + signum), signum)

    def _on_posted(self, event: tuple) -> None:
        kind = event[0]
        if kind == "output_dropped":     # the tee could not write a log file or the console (once per kind)
            self.events.emit("output_dropped", event[1], level=logging.WARNING)
        elif kind == "generation":
            self._on_remote_generation(int(event[1]))
        elif kind == "failed":
            self._on_remote_failure(event[1])
        elif kind == "forged":
            self.events.emit("forged_record", event[1], level=logging.WARNING)
        elif kind == "gpu" and self.gpu is not None:
            self.gpu.on_event(event[1])
        elif kind == "store_lost":
            if self.phase not in ("done",) and not (self.phase == "finishing" and not self.rdzv.store_host):
                if self.phase != "stopping":
                    self.events.emit("store_lost", f"lost the coordination store ({event[1]}): the node that "
                                     "hosts it is gone or unreachable; stopping this node", level=logging.ERROR)
                    self._begin_stop(("exit", EXIT_AGENT_ERROR), self.cfg.shutdown_signal)

    def _on_remote_generation(self, gen: int) -> None:
        if self.inproc is not None and self.inproc.ever_hello and self.phase in ("running", "restarting"):
            self.inproc.remote_generation(gen)
            return
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
        code = int(info.get("exit_code", 1))
        if code == EXIT_NO_USABLE_GPU:   # only the node without a usable GPU asks to be replaced
            code = EXIT_AGENT_ERROR
        self._begin_stop(("exit", code), self.cfg.shutdown_signal)

    def _on_exit(self, proc: WorkerProcess) -> None:
        assert self.sup is not None and self.tee is not None and self.launcher is not None
        code = proc.returncode
        assert code is not None
        self.launcher.on_exit(proc)
        self.events.emit("worker_exit", f"rank {proc.rank} (pid {proc.pid}) exited: {describe_exit(code)}",
                         rank=proc.rank, pid=proc.pid, exit_code=code, generation=proc.generation,
                         level=logging.INFO if code == 0 or proc.signalled else logging.WARNING)
        if self.inproc is not None and self.phase in ("running", "restarting"):
            if self.inproc.ever_hello:
                if self.inproc.exit_ok(proc.local_rank, code):   # 0, or SIGABRT in teardown after DONE
                    self.inproc.excuse_teardown_abort(proc.local_rank, code)
                    if all(p.returncode is not None and self.inproc.exit_ok(p.local_rank, p.returncode)
                           for p in self.sup.workers.values()):
                        self._on_local_success()
                    return
                self.inproc.on_exit(proc.local_rank, code, proc.signalled)
                return
            if code != 0 and not self._warned_unwrapped:
                self._warned_unwrapped = True
                self.events.emit("not_wrapped", "no worker has said HELLO (the script does not use HPWrapper?): "
                                 "falling back to a process-level restart", level=logging.WARNING)
        if self.phase != "running":
            return
        if code == 0:
            if all(p.returncode == 0 for p in self.sup.workers.values()):
                self._on_local_success()
            return
        if not self.causes.open:
            self.detect_t = time.monotonic()
        self._on_worker_failure(proc, code)

    def _on_worker_failure(self, proc: WorkerProcess, code: int) -> None:
        """A worker failed: act on it now, or, when it looks like a consequence of another rank's failure,
        wait a moment for that rank's exit, so that the restart names the rank that really failed."""
        assert self.coord is not None and self.launcher is not None
        error_file = self.launcher.error_file(proc)
        info = {"host": self.host, "rank": proc.rank, "local_rank": proc.local_rank, "pid": proc.pid,
                "exit_code": shell_code(code), "cause": describe_exit(code), "generation": self.generation,
                "error_file": error_file, "stderr_log": self.launcher.stderr_log(proc),
                "symptom": exit_is_symptom(code, exit_text(self.launcher.stderr_log(proc), error_file))}
        info["summary"] = failure_summary(info)
        cause = self.causes.add(info, time.monotonic())
        if cause is not None:
            self._act_on_cause(cause)

    def _act_on_cause(self, cause: dict[str, Any]) -> None:
        folded = cause.get("folded")
        also = f" (also failed, most likely as a consequence: {', '.join(folded)})" if folded else ""
        self._restart_or_fail(cause, f"rank {cause['rank']} failed: {cause['cause']}{also}")

    def _restart_or_fail(self, info: dict[str, Any], message: str) -> None:
        """Process-level: restart every worker of the job while the budget lasts, else end the job."""
        assert self.coord is not None
        self.events.emit("fault", message, rank=info.get("rank"), exit_code=info["exit_code"],
                         generation=self.generation, level=logging.ERROR)
        target, started, budget_ok = self.coord.request_restart(self.generation, info, count_budget=True)
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

    def rank_gpu_fault(self, local_rank: int, info: dict[str, Any]) -> None:
        """The rank's GPU failed (agent/gpu_health.py decided): the rank is faulty. In-process, only it is replaced;
        otherwise it is killed and every worker restarts (process level). Already stopping: nothing more to do,
        the respawn uses the new GPU assignment."""
        assert self.sup is not None
        if self.inproc is not None and self.inproc.ever_hello and self.phase in ("running", "restarting"):
            self.inproc.fault(info, failed=(local_rank,))
            return
        if self.phase != "running":
            return
        proc = self.sup.workers.get(local_rank)
        if proc is not None and proc.alive:
            self.sup.kill(proc)
        self.detect_t = time.monotonic()
        self._restart_or_fail(info, f"rank {info['rank']} failed: {info['cause']}")

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
            if self.left_deadline is None and self.coord.done_count(self.generation) >= self.rdzv.nnodes:
                self.coord.mark_left()
                self.left_deadline = now + 10
            if self.left_deadline is not None:
                # the store host keeps serving the store until every agent has read the result
                if not self.rdzv.store_host or self.coord.left_count() >= self.rdzv.nnodes \
                        or now > self.left_deadline:
                    self._finish(0)
                return
        except Exception as exc:  # the host finished and went away: our part is done
            self.events.emit("store_gone", f"coordination store closed after completion ({exc})")
            self._finish(0)
            return
        if self.finish_deadline is not None and now > self.finish_deadline:
            self.events.emit("exit_barrier_timeout", "other nodes did not finish in time", level=logging.ERROR)
            self._finish(EXIT_AGENT_ERROR)

    # ------------------------------------------------------------------------------------ in-process services
    def _on_message(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, P.InjectRequest):
            self._on_inject(ident, msg)
            return
        if self.gpu is not None and isinstance(msg, (P.Hello, P.Heartbeat)) and (msg.device_uuid or msg.pci_bus_id):
            self.gpu.on_report(msg.rank, msg.pid, msg.device_uuid, msg.pci_bus_id)
        if self.inproc is not None:
            self.inproc.on_message(ident, msg)

    def _on_inject(self, ident: bytes, req: Any) -> None:
        assert self.control is not None
        if req.kind in ("nvml-xid", "gpu-lost"):
            ok, detail = self.gpu.inject(req.rank, req.kind, req.xid) if self.gpu is not None else \
                (False, "GPU health checks are off (--health-check none)")
            if ok:
                self.events.emit("inject", f"fault injection: {detail}", rank=req.rank, kind=req.kind, xid=req.xid,
                                 level=logging.WARNING)
            self.control.send(ident, P.InjectReply(ok=ok, detail=detail))
            return
        if self.inproc is None:
            self.control.send(ident, P.InjectReply(ok=False, detail=f"--kind {req.kind} needs a job started with "
                                                   "--inprocess-restart"))
            return
        st = self.inproc.by_rank(req.rank)
        if st is None or st.pid is None:
            self.control.send(ident, P.InjectReply(ok=False, detail=f"rank {req.rank} is not on this node"))
            return
        if not (req.kind == "kill" and req.step is None) and not st.hello:
            self.control.send(ident, P.InjectReply(ok=False, detail=f"rank {req.rank} has not connected yet"))
            return
        self.events.emit("inject", f"fault injection: {req.kind} on rank {req.rank}"
                         + (f" at step {req.step}" if req.step is not None else " now"), rank=req.rank,
                         kind=req.kind, step=req.step, level=logging.WARNING)
        if req.kind == "kill" and req.step is None:
            proc = self.sup.workers.get(st.local_rank)
            if proc is not None and proc.alive:
                os.kill(proc.pid, signal.SIGKILL)
            self.control.send(ident, P.InjectReply(ok=True, detail=f"killed rank {req.rank} pid {st.pid}"))
            return
        self.control.send(st.ident, P.Inject(kind=req.kind, step=req.step, exit_code=req.exit_code, xid=req.xid))
        self.control.send(ident, P.InjectReply(ok=True, detail=f"armed {req.kind} on rank {req.rank} (pid {st.pid})"))

    def fail_job(self, info: dict[str, Any], code: int) -> None:
        """End the job: record the cause, tell the other nodes, stop every worker."""
        if self.stop_then and self.stop_then[0] == "exit":
            return
        info = dict(info, exit_code=code)
        self.first_failure = self.first_failure or info
        if self.coord is not None:
            self.coord.report_failure(info)
        self._begin_stop(("exit", code), self.cfg.shutdown_signal)

    def open_worker_store(self, gen: int) -> None:
        """On the store host: start generation `gen`'s worker store and publish its port."""
        assert self.rdzv is not None and self.coord is not None
        if self.rdzv.store_host:
            assert self.wstores is not None
            if self.wstores.get(gen) is None:
                self.coord.publish_worker_store(gen, self.wstores.open(gen))

    def spawn_worker(self, local_rank: int, gen: int, warm: bool = False) -> WorkerProcess:
        assert self.launcher is not None and self.coord is not None
        port = self.coord.worker_store_port(gen) or 0
        return self.launcher.spawn(local_rank, gen, port, warm=warm)

    def start_warm_spawner(self) -> None:
        """The zygote that forks respawned workers (agent/warm_spawner.py); never fatal."""
        if self.launcher is None or not self.subreaper:
            return
        try:
            self.launcher.start_warm_spawner()
        except OSError as exc:
            log.info("no warm respawns: the warm spawner did not start (%s)", exc)

    def end_warm_spawner(self) -> None:
        """The job completed: stop the zygote at once (no respawn is coming; its teardown of torch would only
        compete with the workers' exit). The workers it forked live in sessions of their own."""
        warm = getattr(self.launcher, "warm", None)
        if warm is not None and self.launcher is not None:
            try:
                warm.proc.kill()
            except OSError:
                pass
            self.launcher.stop_warm_spawner()

    def escalate(self, target: int, root: dict[str, Any]) -> None:
        """In-process restart did not finish in time: process-level restart of this node."""
        assert self.coord is not None
        nxt, _, budget_ok = self.coord.request_restart(target, root, count_budget=True)
        if not budget_ok:
            why = (f"in-process restart timed out and the restart budget (--max-restarts {self.cfg.max_restarts}) "
                   f"is spent; {root.get('summary')}")
            self.fail_job(dict(root, summary=why, cause=why), EXIT_RESTARTS_EXHAUSTED)
            return
        self.detect_t = time.monotonic()
        self.events.emit("restart_begin", f"process-level restart of this node's workers: generation {nxt} "
                         f"({signal.Signals(self.cfg.shutdown_signal).name}, SIGKILL after "
                         f"{self.cfg.shutdown_timeout:g}s)", generation=nxt)
        self._begin_stop(("restart", nxt), self.cfg.shutdown_signal)

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
        self.events.emit("workers_stopped", f"all workers stopped in {stopped_in:.3f}s", duration_s=stopped_in,
                         level=logging.INFO if then[0] == "restart" else logging.DEBUG)
        if then[0] == "restart":
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
        if self.inproc is not None and gen > 0 and self.inproc.ever_hello:
            self.inproc.reset_after_process_restart(gen)
        return True

    def _finish(self, code: int) -> None:
        self.exit_code = code
        self.phase = "done"
        if self.gpu is not None:
            self.gpu.report()
        if code != 0 and self.first_failure is not None:
            summary = failure_summary(self.first_failure, with_traceback=True)
            self.events.emit("job_failed", summary, level=logging.ERROR, exit_code=code)
        elif code == 0:
            self.events.emit("job_done", "job finished successfully", exit_code=0)
            if self.rdzv is not None:   # every local worker exited 0: their snapshots are not needed any more
                shm_runs.remove_finished(shm_runs.checkpoint_base(), self.rdzv.run_id, os.getpid())
        else:
            self.events.emit("agent_exit", f"agent exiting with code {code}", exit_code=code)

    def _cleanup(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.gpu is not None:
            self.gpu.stop()
        if self.sup is not None:
            live = self.sup.live()
            if live:
                self.sup.signal_all(signal.SIGKILL, live)
                end = time.monotonic() + 5
                while self.sup.live() and time.monotonic() < end:
                    self.sup.poll_exits()
                    time.sleep(0.01)
        if self.launcher is not None:
            self.launcher.stop_warm_spawner()
        if self.tee is not None:
            self.tee.close()
        if self.reaper is not None:
            self.reaper.close()
        if self.wstores is not None:
            self.wstores.close_all()
        if self.control is not None:
            self.control.close()
        self.events.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            sys.stdout.flush()
        except (AttributeError, OSError, ValueError):   # a closed or broken stdout must not fail the job
            pass
