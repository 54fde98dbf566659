"""HPWrapper: run a training function again, in the same process, after a fault anywhere in the job.

    @HPWrapper(health_check=CudaHealthCheck())
    def main(cfg, caller=None):
        dist.init_process_group("nccl")       # a plain env:// init works on every re-entry
        ...
        for step in ...:
            caller.progress(step)

Outside hyperpodrun --inprocess-restart (plain python, torchrun) the function is called once. Under it,
each call is one generation: on a fault the rank aborts its process groups, finalizes, checks its
health, reports READY and waits for GO with the next generation's store, then calls the function again
with `caller.iteration` = the new generation (the same on every rank).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hyperpodrun import env as E
from hyperpodrun import protocol as P
from hyperpodrun.errors import (EXIT_USAGE, EXIT_WORKER_UNHEALTHY, USAGE_ERRORS, ApiTypeError, ApiValueError,
                                HealthCheckError, RankEnvironmentTimeout, StateLostError, UnsafePathError)
from hyperpodrun.usage_exit import one_line
from hyperpodrun.runtime.abort import (CheckpointlessAbortManager, CheckpointlessFinalizeCleanup,
                                       mark_generation_start, release_parked)
from hyperpodrun.runtime import group_hook, park
from hyperpodrun.runtime.health import CudaHealthCheck
from hyperpodrun.runtime.interrupt import RestartInterrupt
from hyperpodrun.runtime.session import Session
from hyperpodrun.state.state_dicts import rng_state, set_rng_state
from hyperpodrun.runtime.torch_state import (_device_ids, _drop_frames, _exit_without_last_collection,
                                             _preload_torch_modules, _reset_torch_group_counter, _warn_existing_group,
                                             freeze_before_training)
from hyperpodrun.symptoms import SECONDARY_MARKERS as _SECONDARY_MARKERS   # shared with the agent

log = logging.getLogger("hyperpodrun.runtime")

#: deterministic programming errors: retrying them only burns time (override with fatal_exceptions=)
DEFAULT_FATAL = (TypeError, NameError, AttributeError, SyntaxError, ImportError, NotImplementedError, UnsafePathError,
                 *USAGE_ERRORS)


def inprocess_enabled() -> bool:
    """True when this process runs under `hyperpodrun --inprocess-restart`."""
    return E.worker_context().under_inprocess_restart


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def wait_rank(timeout: float = 600.0) -> RankInfo:
    """Return once this process's rank environment is final.

    Under hyperpodrun (and torchrun) it is final at spawn. In a plain `python train.py` a single-process
    environment is filled in (rank 0 of 1, a free local port) so `init_process_group()` works unchanged.
    """
    deadline = time.monotonic() + timeout
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    launched = E.worker_context().launched
    while launched and not all(k in os.environ for k in needed):
        if time.monotonic() > deadline:
            raise RankEnvironmentTimeout(f"rank environment incomplete after {timeout:g}s: missing "
                                         f"{[k for k in needed if k not in os.environ]}")
        time.sleep(0.05)
    if not launched:
        import socket
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


class CallWrapper:
    """The `caller` argument of a wrapped function: where this call sits in the job's restart history."""

    def __init__(self, iteration: int, restart_reason: str = "", session: Optional[Session] = None,
                 previous_world_size: Optional[int] = None) -> None:
        self.iteration = iteration
        self.restart_reason = restart_reason
        #: the world size of the call before this one (None on the first): an elastic job shrank or grew
        #: when it differs from `world_size` - re-shard the data (CheckpointManager restores DDP state as is)
        self.previous_world_size = previous_world_size
        self.step: Optional[int] = None
        self._session = session
        self._store: Any = None

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def world_size_changed(self) -> bool:
        """True when this call runs at another world size than the one before it (an elastic job shrank or
        grew, `hyperpodrun --nnodes MIN:MAX`): ranks and the data each rank reads must be re-derived."""
        return self.previous_world_size is not None and self.previous_world_size != self.world_size

    def progress(self, step: int) -> None:
        """Mark progress (e.g. the index of the step about to run); heartbeats carry it to the agent."""
        self.step = int(step)
        if self._session is not None:
            self._session.step = self.step
            if not self._session.device:
                self._session.device = _device_ids()   # main thread: its current device is the rank's GPU
            self._session.injector.fire_due(self.step, self.iteration)

    @property
    def store(self) -> Any:
        """A client of this generation's store (keys do not leak into the next generation)."""
        if self._store is None:
            import torch.distributed as dist
            from datetime import timedelta
            raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timedelta(seconds=300))
            self._store = dist.PrefixStore(f"hyperpodrun/user/{self.iteration}/", raw)
        return self._store


def _release_data_cache() -> None:
    """The job completed: the MMAP cache's finished streams go now (MMAPDataModule keeps them until here, as
    a peer's fault could still bring this rank back into fit)."""
    loader = sys.modules.get("hyperpodrun.data.loader")
    if loader is not None:
        loader.shutdown()


def _secondary(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(m in text for m in _SECONDARY_MARKERS)


class HPWrapper:
    """Decorator that makes a function a re-executable block under `hyperpodrun --inprocess-restart`.

    health_check, abort, finalize: callables run at every restart (defaults: CudaHealthCheck(), which passes
    without CUDA; abort the process groups; end child processes and collect garbage). abort_timeout: seconds
    abort may take before this process gives up and is replaced. checkpoint_manager: restores state on
    re-entry (see CheckpointManager). fatal_exceptions: exception classes that end the job instead of
    restarting it. hp_api_factory: builds this process's channel to its node agent (default
    HPAgentK8sAPIFactory(), hyperpodrun/runtime/agent_channel.py), used when the function first runs under
    --inprocess-restart.
    """

    def __init__(self, *, health_check: Optional[Callable[[], Any]] = None,
                 abort: Optional[Callable[[], Any]] = None, finalize: Optional[Callable[[], Any]] = None,
                 abort_timeout: float = 60.0, checkpoint_manager: Any = None, hp_api_factory: Any = None,
                 fatal_exceptions: tuple[type[BaseException], ...] = DEFAULT_FATAL) -> None:
        if abort_timeout <= 0:
            raise ApiValueError(f"HPWrapper(abort_timeout={abort_timeout}): must be positive seconds")
        self.health_check = health_check if health_check is not None else CudaHealthCheck()
        self.abort = abort if abort is not None else CheckpointlessAbortManager.get_default_checkpointless_abort()
        self.finalize = finalize if finalize is not None else CheckpointlessFinalizeCleanup()
        self.abort_timeout = abort_timeout
        self.checkpoint_manager = checkpoint_manager
        if hp_api_factory is not None and not callable(hp_api_factory):
            raise ApiTypeError(f"HPWrapper(hp_api_factory={hp_api_factory!r}): a factory of the channel to the agent, "
                               "e.g. HPAgentK8sAPIFactory(), not an instance of another kind")
        self.hp_api_factory = hp_api_factory
        self.fatal_exceptions = tuple(fatal_exceptions)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("caller", None)
            if park.prerunning():   # a standby running the script ahead: here it waits to become a rank
                park.park(getattr(fn, "__qualname__", repr(fn)))
            if not inprocess_enabled():
                caller = CallWrapper(E.worker_context().restart_count)
                return fn(*args, caller=caller, **kwargs)
            return self._run(fn, args, kwargs)
        return wrapped

    # ------------------------------------------------------------------------------------------------
    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        group_hook.install()   # the roll call in every generation's init_process_group (started by any means)
        _preload_torch_modules()
        _warn_existing_group()
        sess = Session.get(self.hp_api_factory)
        gen = sess.generation
        need_go = gen > 0
        world: Optional[int] = None       # the world size of the previous call in this process
        freeze_before_training()
        entry_rng = rng_state()            # every call starts from it: a survivor's re-entry draws what a new
        while True:                        # process would (datasets drawn at setup, an unseeded init)
            previous = world
            if need_go:
                gen = self._ready_and_go(sess, gen)
                set_rng_state(entry_rng)
                go = sess.go.get(gen)
                if go is not None and go.previous_world_size is not None:
                    previous = go.previous_world_size   # the job's nodes changed in this round (elastic)
            need_go = True
            world = int(os.environ.get("WORLD_SIZE", 1))
            caller = CallWrapper(gen, sess.reason, sess, previous_world_size=previous)
            sess.state = "running"
            release_parked()            # the previous generation's groups: every rank has aborted them by now
            _reset_torch_group_counter()
            mark_generation_start()
            t_fault: Optional[float] = None
            try:
                # inside: attaching reaches the generation's store (peer copies), which a node lost meanwhile
                # closes - a failure of this generation like any other, recovered in the next
                if self.checkpoint_manager is not None and callable(getattr(self.checkpoint_manager, "attach", None)):
                    self.checkpoint_manager.attach(caller, sess)
                sess.interrupter.enter_fn(gen)
                try:
                    result = fn(*args, caller=caller, **kwargs)
                finally:
                    sess.interrupter.leave_fn()
            except RestartInterrupt as exc:
                t_fault = time.monotonic()
                sess.state = "recovering"
                _drop_frames(exc)
                del exc
                target = sess.interrupter.target
            except (SystemExit, KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:
                t_fault = time.monotonic()
                sess.state = "recovering"
                retryable = not isinstance(exc, self.fatal_exceptions) and not isinstance(exc, StateLostError)
                secondary = sess.interrupter.target > gen or _secondary(exc)
                tb_text = "".join(traceback.format_exception(exc))[-4000:]
                # report first (a non-blocking send), then tear our groups down so that peers blocked in a
                # collective with us fail fast - their "connection closed" then arrives after our root cause
                usage = isinstance(exc, USAGE_ERRORS) and not retryable   # the API used wrongly: one line, exit 2
                if usage:   # said first: the agent ends the job as soon as it reads the fault
                    sys.stderr.write(one_line(exc) + "\n")
                    sys.stderr.flush()
                exit_code = (EXIT_USAGE if usage else P.exit_code_of(getattr(exc, "exit_code", 1))) if not retryable \
                    else 1
                sess.send(P.Fault(rank=sess.rank, pid=os.getpid(), generation=gen, exc_type=type(exc).__name__,
                                  summary=str(exc)[:500], step=sess.step, secondary=secondary, retryable=retryable,
                                  exit_code=exit_code, traceback=tb_text))
                if retryable:
                    _drop_frames(exc)   # the failed frames hold the model/DDP, which hold the process group
                sess.first_abort_s = self._abort(sess)
                if not retryable:
                    if not usage:
                        log.error("rank %d: %s is not retried; ending the job", sess.rank, type(exc).__name__)
                    if exit_code != 1:
                        if not usage:
                            sys.stderr.write(tb_text)
                            sys.stderr.flush()
                        sess.client.close()
                        os._exit(exit_code)
                    raise
                log.warning("rank %d: %s in generation %d; waiting for the restart", sess.rank,
                            type(exc).__name__, gen)
                sess.wait(lambda: sess.interrupter.target > gen or sess.shutdown is not None)
                del exc
                if sess.shutdown is not None:
                    raise SystemExit(sess.shutdown.exit_code or 1)
                target = sess.interrupter.target
            else:
                sess.state = "done"
                sess.send(P.Done(rank=sess.rank, pid=os.getpid(), generation=gen))
                sess.wait(lambda: sess.interrupter.target > gen or sess.shutdown is not None)
                if sess.shutdown is not None and sess.interrupter.target <= gen:
                    release_parked(wait=True)   # no gloo thread may outlive the interpreter (see release_parked)
                    if callable(getattr(self.checkpoint_manager, "close", None)):   # every rank finished: drop slots
                        self.checkpoint_manager.close(success=sess.shutdown.reason == "complete"
                                                      and not sess.shutdown.exit_code)
                    _release_data_cache()
                    sess.client.close()
                    _exit_without_last_collection()
                    return result
                target = sess.interrupter.target
                del result
            gen = self._recover(sess, target, t_fault)

    def _abort(self, sess: Session) -> float:
        """Run abort within abort_timeout; past it this process cannot recover and exits to be replaced."""
        t0 = time.monotonic()
        sess.aborting()
        box: dict = {}

        def run() -> None:
            try:
                self.abort()
            except Exception as exc:
                box["error"] = exc
        t = threading.Thread(target=run, name="hyperpodrun-abort", daemon=True)
        t.start()
        t.join(self.abort_timeout)
        if t.is_alive():
            log.error("rank %d: abort did not finish within %gs; exiting so the agent replaces this process",
                      sess.rank, self.abort_timeout)
            os._exit(EXIT_WORKER_UNHEALTHY)
        if "error" in box:
            log.warning("rank %d: abort raised %r", sess.rank, box["error"])
        return time.monotonic() - t0

    def _recover(self, sess: Session, target: int, t_fault: Optional[float]) -> int:
        """abort -> finalize -> health check; returns the generation to report READY for."""
        sess.state = "recovering"
        abort_s = self._abort(sess) + sess.first_abort_s
        sess.first_abort_s = 0.0
        t1 = time.monotonic()
        self.finalize()
        finalize_s = time.monotonic() - t1
        t2 = time.monotonic()
        if self.health_check is not None:
            try:
                self.health_check()
            except HealthCheckError as exc:
                log.error("rank %d failed its health check (%s); exiting so the agent replaces it", sess.rank, exc)
                sys.stderr.flush()
                os._exit(EXIT_WORKER_UNHEALTHY)
        sess.timings = (abort_s, finalize_s, time.monotonic() - t2)
        return target

    def _ready_and_go(self, sess: Session, gen: int) -> int:
        """READY(gen), then wait for GO(gen) - or a newer RESTART (report READY again) or SHUTDOWN."""
        timings = sess.timings
        while True:
            gen = max(gen, sess.interrupter.target)
            sess.generation = gen
            sess.state = "waiting"
            sess.send(P.Ready(rank=sess.rank, pid=os.getpid(), generation=gen, abort_s=timings[0],
                              finalize_s=timings[1], health_s=timings[2]))
            sess.wait(lambda: gen in sess.go or sess.interrupter.target > gen or sess.shutdown is not None)
            if sess.shutdown is not None:
                raise SystemExit(sess.shutdown.exit_code)
            if gen in sess.go and sess.interrupter.target <= gen:
                go = sess.go[gen]
                os.environ.update({"MASTER_ADDR": go.master_addr, "MASTER_PORT": str(go.master_port),
                                   "TORCHELASTIC_RESTART_COUNT": str(gen), E.HYPERPODRUN_GENERATION: str(gen)})
                if go.rank is not None and go.world_size is not None:   # an elastic job shrank or grew
                    sess.move_to(go.rank)
                    os.environ.update({"RANK": str(go.rank), "ROLE_RANK": str(go.rank),
                                       "WORLD_SIZE": str(go.world_size), "ROLE_WORLD_SIZE": str(go.world_size)})
                    if go.group_rank is not None and go.group_world_size is not None:
                        os.environ.update({"GROUP_RANK": str(go.group_rank), E.HYPERPODRUN_NODE_RANK:
                                           str(go.group_rank), "GROUP_WORLD_SIZE": str(go.group_world_size)})
                    log.info("rank %d of %d from generation %d (the job's nodes changed; was %s ranks)", go.rank,
                             go.world_size, gen, go.previous_world_size)
                return gen
