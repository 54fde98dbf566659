"""The per-node agent: the process around the node's state machine (docs/ARCHITECTURE.md, "The agent").

It meets the other nodes, builds the parts (supervisor, launcher, coordination, control socket, the Node
state machine and its policies) and runs one event loop thread that owns all state. Sources the loop waits
on: worker exits (pidfds), a wake-up pipe (signals, helper-thread events), the control socket (in-process
restart, fault injection), and deadlines. Each event goes to a Node handler (agent/node.py); helper threads
(store watcher, log tee, NVML monitor) never touch the state, they post events.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import sys
import time
from typing import Any, Callable, Optional

import zmq

from hyperpodrun import auth, protocol as P, safe_fs
from hyperpodrun.launch import settings
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.security import slot_base
from hyperpodrun.agent.coordination import stores
from hyperpodrun.agent.control.agent_info import AgentInfo
from hyperpodrun.agent.control.server import ControlServer, is_symptom, split_batch, symptom_grace
from hyperpodrun.agent.coordination.job_state import Coordinator, Watcher
from hyperpodrun.agent.observe.events import EventLog
from hyperpodrun.agent.observe.http_api import LoopBeat, StatusServer
from hyperpodrun.agent.control.api_stop import StopRequest
from hyperpodrun.agent.health.gpu_health import GpuHealth
from hyperpodrun.agent.hooks import run_hook
from hyperpodrun.agent.control.inject import Injector
from hyperpodrun.agent.inprocess import InProcess
from hyperpodrun.agent.node import Node
from hyperpodrun.agent.ports import KVStore, Posted, RendezvousInfo, SystemClock
from hyperpodrun.agent.coordination.membership import Membership
from hyperpodrun.agent.coordination.owner import electing
from hyperpodrun.agent.coordination.rendezvous import JobOver, RendezvousInterrupted, hostname, rendezvous
from hyperpodrun.agent.state import IllegalTransition
from hyperpodrun.agent.workers.supervisor import Reaper, Supervisor, become_subreaper
from hyperpodrun.agent.workers.tee import Tee
from hyperpodrun.agent.workers.warm_spawner import WarmSpawner
from hyperpodrun.agent.workers.launch import WorkerLauncher, standby_spawner
from hyperpodrun.launch.config import LaunchConfig, private_log_base, temp_log_base
from hyperpodrun.errors import EXIT_AGENT_ERROR, EXIT_API_STOP, EXIT_FENCED, FencedError, HyperpodrunError
from hyperpodrun.state.slots import shm_runs

log = logging.getLogger("hyperpodrun.agent")


class Inbox:
    """The loop's inbox: helper threads and signal handlers post here (thread-safe) and wake the loop through
    a pipe it polls. The parts that post hold this, not the agent."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Posted]" = queue.Queue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self.wake_r, False)

    def post(self, event: Posted) -> None:
        """Queue an event for the loop and wake it."""
        self._queue.put(event)
        self.wake()

    def wake(self) -> None:
        """Wake the loop (async-signal-safe: one non-blocking write)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[Posted]:
        """Every event posted so far."""
        events = []
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                return events

    def close(self) -> None:
        for fd in (self.wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def remove_finished(run_id: str, shm_dir: Optional[str] = None) -> None:
    """Every local worker exited 0: their checkpointless snapshots are not needed any more (`shm_dir`: the
    private one the workers were given, agent/security/slot_base.py)."""
    shm_runs.remove_finished(shm_runs.checkpoint_base(shm_dir), run_id, os.getpid())


class Agent:
    """Runs this node's workers until the job succeeds, fails, or the agent is told to stop."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.host = hostname()
        self.clock = SystemClock()
        self.events = EventLog(self.host, self.clock)
        if cfg.k8s_report:   # the pod's annotations and Events (checked at launch: the CLI's preflight)
            from hyperpodrun.agent.observe.k8s_report import reporter_from_environment
            self.events.add_sink(reporter_from_environment(self.host))
        self.inbox = Inbox()
        self._signals: list[int] = []
        self.reaper: Optional[Reaper] = None
        self.sup: Optional[Supervisor] = None
        self.tee: Optional[Tee] = None
        self.rdzv: Optional[RendezvousInfo] = None
        self.coord: Optional[Coordinator] = None
        self.watcher: Optional[Watcher] = None
        self.membership: Optional[Membership] = None
        self.wstores: Optional[stores.WorkerStores] = None
        self.launcher: Optional[WorkerLauncher] = None
        self.control: Optional[ControlServer] = None
        self.node: Optional[Node] = None
        self.gpu: Optional[GpuHealth] = None
        self.symptom_grace_s = symptom_grace()
        self.subreaper = False
        self.standby: Optional[WarmSpawner] = None   # imports torch while this agent waits as a hot spare
        self.shm_dir: Optional[str] = None   # the workers' private slot base when the usual one is squatted
        self.beat = LoopBeat(cfg.monitor_interval)   # /healthz: the loop comes round (agent/observe/http_api.py)
        self.stop_request = StopRequest(self.inbox.wake)   # POST /stop of the status API
        self.status_api: Optional[StatusServer] = None
        self.metrics: Any = None

    # ----------------------------------------------------------------------------------------- entry
    def run(self) -> int:
        """Run the job on this node and return the process exit code."""
        try:
            return self._run()
        except FencedError as exc:   # raised by a store write of an agent that was declared lost and replaced
            self.events.emit("fenced", f"hyperpodrun: {exc} (exit code {EXIT_FENCED})", level=logging.ERROR,
                             exit_code=EXIT_FENCED)
            return EXIT_FENCED
        except HyperpodrunError as exc:
            if isinstance(exc, IllegalTransition):   # a bug in hyperpodrun: the report needs where it happened
                log.error("internal error in the node's state machine", exc_info=True)
            self.events.emit("agent_error", f"hyperpodrun: {exc}", level=logging.ERROR)
            return EXIT_AGENT_ERROR
        except RuntimeError as exc:
            # torch's DistError family: a call on the coordination store failed because the agent that hosts it
            # (node 0, or the --rdzv-endpoint host) went away. One line, not a traceback.
            if not any(c.__name__ == "DistError" for c in type(exc).__mro__):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.events.emit("store_lost", f"lost the coordination store ({first}): its host (a node, a standalone "
                             "coordinator, or etcd) is gone or unreachable; stopping this node", level=logging.ERROR)
            return EXIT_AGENT_ERROR
        finally:
            self._cleanup()

    def _run(self) -> int:
        cfg = self.cfg
        self.subreaper = become_subreaper() or os.getpid() == 1
        self.reaper = Reaper()
        self.sup = Supervisor(self.reaper)
        self.sup.watch_deaths(self.inbox.wake)
        self._install_signals()
        if cfg.metrics_port is not None:   # metrics, probes, status API: sinks on the event log, a server thread
            from hyperpodrun.agent.observe import http_api
            self.status_api, self.metrics = http_api.start(cfg.metrics_host, cfg.metrics_port, self.events, self.beat,
                                                           cfg.api_token_file, self.stop_request.request)
        try:
            self.rdzv = rdzv = rendezvous(cfg, on_standby=self._import_ahead,
                                          stop_requested=lambda: bool(self._signals) or self.stop_request.requested)
        except JobOver as exc:
            log.warning("hyperpodrun: %s", exc)
            return 0
        except RendezvousInterrupted:
            if not self._signals:   # POST /stop while waiting for the other nodes
                self.events.emit("api_stop", "stop requested through the status API while waiting for the other "
                                 "nodes: exiting", exit_code=EXIT_API_STOP)
                return EXIT_API_STOP
            signum = self._signals[0]
            self.events.emit("signal", f"received {signal.Signals(signum).name} while waiting for the other nodes: "
                             "exiting", signal=signal.Signals(signum).name)
            return 128 + signum
        run_dir = self._make_run_dir(rdzv.run_id)
        self.events.open(os.path.join(run_dir, f"node{rdzv.node_rank}.events.jsonl"), rdzv.node_rank)
        self.events.emit("agent_start", f"hyperpodrun agent on {self.host}: node {rdzv.node_rank}/{rdzv.nnodes}, "
                         f"ranks {rdzv.rank_offset}..{rdzv.rank_offset + cfg.nproc_per_node - 1} of "
                         f"{rdzv.world_size}, run dir {run_dir}", run_id=rdzv.run_id, pid=os.getpid())
        if rdzv.secret_warning:
            self.events.emit("insecure", rdzv.secret_warning, level=logging.WARNING)
        node = self._build(run_dir)
        self._start_membership()
        if node.done:   # a GPU already unusable at start and no spare: exit 76 before any worker
            assert node.state.exit_code is not None
            return node.state.exit_code

        if cfg.pre_train_script and not self._signals:
            code = run_hook("pre-train", cfg.pre_train_script, cfg.pre_train_args, self.events, self.sup,
                            shutdown_timeout=cfg.shutdown_timeout)
            if self._signals:
                return 128 + self._signals[0]
            if code != 0:
                return code
        if self._signals:
            return 128 + self._signals[0]
        self._start_watcher()
        node.start()
        code = self._loop(node)
        if cfg.post_train_script and node.state.stopped_by_signal is None:   # a container stop must not wait
            post = run_hook("post-train", cfg.post_train_script, cfg.post_train_args, self.events, self.sup,
                            shutdown_timeout=cfg.shutdown_timeout)
            if code == 0 and post != 0:
                code = post
        return code

    def _build(self, run_dir: str) -> Node:
        """The parts of this node, wired through their ports; GPU health has started (it may have ended the
        node already: no usable GPU)."""
        cfg, rdzv, sup, post = self.cfg, self.rdzv, self.sup, self.inbox.post
        assert rdzv is not None and sup is not None
        self.coord = coord = Coordinator(rdzv.store, rdzv.nnodes, cfg.max_restarts,
                                         key=auth.derive(rdzv.secret, "store"), run_id=rdzv.run_id,
                                         node_rank=rdzv.node_rank, on_forged=lambda msg: post(("forged", msg)),
                                         incarnation=rdzv.incarnation, nodes=lambda: rdzv.nodes)
        if rdzv.store_host or rdzv.coordinator:   # with a coordinator: the generations this agent claims
            self.wstores = stores.WorkerStores(rdzv.bind_addr)   # loopback on one node (docs/security.md)
        self.tee = Tee(on_problem=lambda message: post(("output_dropped", message)))
        if cfg.inprocess_restart or cfg.health_check != "none":   # the socket also takes injected GPU events
            self.control = ControlServer()
        endpoint = self.control.endpoint if cfg.inprocess_restart and self.control else None
        self.shm_dir = slot_base.private_shm_dir(self.events)
        self.launcher = WorkerLauncher(cfg, rdzv, run_dir, self.host, sup, self.tee, self.events, control=endpoint,
                                       subreaper=self.subreaper, standby=self.standby, shm_dir=self.shm_dir)
        self.standby = None   # the launcher owns it now
        self.launcher.store_addr = lambda generation: coord.worker_store_addr(generation) or rdzv.master_addr
        self.node = node = Node(cfg, rdzv, self.host, procs=sup, launcher=self.launcher, coord=coord,
                                wstores=self.wstores, events=self.events, clock=self.clock,
                                exit_grace_s=settings.current().exit_grace_s,
                                on_success=functools.partial(remove_finished, rdzv.run_id, self.shm_dir))
        inproc = None
        if cfg.inprocess_restart:
            assert self.control is not None
            inproc = InProcess(cfg, rdzv, self.host, node.state, node, coord, self.control, self.events, self.clock)
            self.launcher.on_spawn = inproc.on_spawn
            if self.metrics is not None:   # hyperpodrun_last_step: the ranks' reported steps, read when scraped
                self.metrics.read_steps(lambda: [st.step for st in list(inproc.ranks.values())])
        if cfg.health_check != "none":
            self.gpu = GpuHealth(cfg, self.host, rdzv.rank_offset, self.events, node, node.state, post)
            self.launcher.env_for = self.gpu.env_for
        node.attach(inproc=inproc, gpu=self.gpu,
                    injector=Injector(self.control, self.events, sup, self.gpu, inproc) if self.control else None)
        if self.gpu is not None:
            self.gpu.start()    # NVML monitor thread (or one info line why not): agent/health/gpu_health.py
        if self.control is not None and not node.done:
            AgentInfo(control=self.control.endpoint, pid=os.getpid(), host=self.host, node_rank=rdzv.node_rank,
                      rank_offset=rdzv.rank_offset, nproc_per_node=cfg.nproc_per_node).write(run_dir)
        return node

    def _helper_store(self) -> Callable[[], KVStore]:
        """How a helper thread opens its own connection to the coordination store (prefixed to the run)."""
        rdzv = self.rdzv
        assert rdzv is not None and rdzv.store_endpoint is not None
        if rdzv.link is not None:   # a standalone coordinator: connections that outlive its restart
            rdzv.link.post = self.inbox.post
            return rdzv.link.connect
        (host, port), prefix, timeout = rdzv.store_endpoint, K.run_prefix(rdzv.run_id), self.cfg.join_timeout

        def open_store() -> KVStore:
            return stores.prefixed(prefix, stores.open_tcp_store(host, port, server=False, timeout_s=timeout))
        return open_store

    def _start_watcher(self) -> None:
        """Several nodes: a helper thread with its own connection turns other nodes' changes into events."""
        assert self.rdzv is not None and self.coord is not None
        if self.rdzv.single_node:
            return
        self.watcher = Watcher(self._helper_store(), self.inbox.post, self.cfg.monitor_interval, view=self.coord.view)
        self.watcher.start()

    def _start_membership(self) -> None:
        """Several nodes: renew this node's lease and watch the others' (agent/coordination/membership.py), from the moment
        the node is built - before the pre-train script, which may take long. The store host watches every
        lease; without one (a coordinator, etcd) the agent elected owner does (agent/coordination/owner.py)."""
        rdzv, coord = self.rdzv, self.coord
        assert rdzv is not None and coord is not None
        if rdzv.single_node:
            return
        self.membership = Membership(self._helper_store(), lambda store: coord.view(store).records, self.inbox.post,
                                     node=rdzv.node_rank, nnodes=self.cfg.nnodes, incarnation=rdzv.incarnation,
                                     node_timeout=self.cfg.node_timeout,
                                     watch_all=rdzv.store_host, news=rdzv.coordinator,
                                     elect=electing(rdzv.node_rank, rdzv.incarnation, self.cfg.node_timeout)
                                     if rdzv.coordinator else None,
                                     nodes=lambda: rdzv.nodes, elastic=self.cfg.elastic,
                                     reconnects=(lambda: link.reconnects) if (link := rdzv.link) else None)
        self.membership.start()

    # ------------------------------------------------------------------------------------ plumbing
    def _install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self._signals.append(signum)
            self.inbox.wake()
        for sig in self.cfg.signals_to_handle:
            signal.signal(sig, handler)

    def _make_run_dir(self, run_id: str) -> str:
        """<log-dir>/<run-id>: ours alone under the default log dir; elsewhere a directory of ours that nobody
        else can write (never one another user created or a symlink: hyperpodrun/safe_fs.py)."""
        if self.cfg.log_dir == temp_log_base():
            return safe_fs.private_tree(private_log_base(), run_id)
        return safe_fs.owned_dir(os.path.join(self.cfg.log_dir, run_id))

    # ------------------------------------------------------------------------------------ the loop
    def _loop(self, node: Node) -> int:
        sup = self.sup
        assert sup is not None
        poller = zmq.Poller()
        poller.register(self.inbox.wake_r, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control.sock, zmq.POLLIN)
        registered: set[int] = set()
        while not node.done:
            self.beat.beat()
            fds = set(sup.pidfds())
            for fd in registered - fds:
                poller.unregister(fd)
            for fd in fds - registered:
                poller.register(fd, zmq.POLLIN)
            registered = fds
            now = time.monotonic()
            timeout = min([self.cfg.monitor_interval, *(max(0.0, t - now) for t in node.deadlines())])
            poller.poll(int(timeout * 1000))
            self.inbox.drain_wake()
            if self.control is not None:
                self._handle_batch(node, poller, list(self.control.receive()))
            self._tick(node)
        self.beat.leave()
        for fd in registered:
            poller.unregister(fd)
        assert node.state.exit_code is not None
        return node.state.exit_code

    def _handle_batch(self, node: Node, poller: zmq.Poller, batch: list[tuple[bytes, P._Msg]]) -> None:
        """Handle the control messages read together. A batch whose faults are all symptoms, outside a restart
        round, waits up to symptom_grace() for the real cause (a report or a worker's exit), so that the round
        is logged with the rank that failed rather than one that saw its connection close."""
        assert self.control is not None and self.sup is not None
        symptoms = [m for _, m in batch if isinstance(m, P.Fault)]
        waited = False
        if symptoms and all(is_symptom(m) for m in symptoms) and node.inproc is not None and node.inproc.round is None:
            waited = True
            deadline = time.monotonic() + self.symptom_grace_s
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(int(left * 1000) + 1))
                batch += list(self.control.receive())
                exited = any(fd in ready for fd in self.sup.pidfds())
                if exited or any(isinstance(m, P.Fault) and not is_symptom(m) for _, m in batch):
                    break
        others, faults = split_batch(batch)
        for ident, msg in others:
            node.on_message(ident, msg)
        if waited:
            self._tick(node)   # worker exits are real causes: before the symptoms they produced
        for ident, msg in faults:
            node.on_message(ident, msg)

    def _tick(self, node: Node) -> None:
        """Hand every event that has arrived to the node, then let time-driven progress happen."""
        assert self.sup is not None and self.launcher is not None
        while self._signals:
            node.on_signal(self._signals.pop(0))
        self.stop_request.carry_out(node, self.events, self.cfg.shutdown_signal)
        for event in self.inbox.take():
            node.on_posted(event)
        for proc in self.sup.poll_exits():
            node.on_exit(proc)
        self.sup.reap_orphans()
        self.launcher.poll_warm_spawner()
        node.tick()

    # ------------------------------------------------------------------------------------ the end
    def _import_ahead(self) -> None:
        """This agent waits for a place in a running job: import torch for its workers meanwhile, so that they
        start warm when it takes over (a hot spare whose imports are done)."""
        if self.cfg.inprocess_restart and self.standby is None and self.sup is not None:
            self.standby = standby_spawner(self.cfg, self.sup, self.subreaper)

    def _cleanup(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.membership is not None:
            self.membership.stop()
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
            self.sup.close()
        slot_base.remove(self.shm_dir)   # after the workers: nobody uses it now
        if self.launcher is not None:
            self.launcher.stop_warm_spawner()
        if self.standby is not None:   # a spare that never took a place
            self.standby.close()
        if self.tee is not None:
            self.tee.close()
        if self.reaper is not None:
            self.reaper.close()
        if self.wstores is not None:
            self.wstores.close_all()
        if self.control is not None:
            self.control.close()
        if self.status_api is not None:
            self.status_api.close()
        self.events.close()
        self.inbox.close()
        try:
            sys.stdout.flush()
        except (AttributeError, OSError, ValueError):   # a closed or broken stdout must not fail the job
            pass
