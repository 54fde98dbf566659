"""CheckpointlessCallback: a CheckpointManager wired into a Lightning Trainer (Tier 4 of the product note).

    cm = CheckpointManager()

    @HPWrapper(checkpoint_manager=cm)
    def main(caller=None):
        trainer = Trainer(..., callbacks=[CheckpointlessCallback(checkpoint_manager=cm)])
        trainer.wrapper = caller
        trainer.fit(model, data_module)

Why a callback: after an in-process restart the wrapped function runs again and builds a new Trainer, so
training must resume from memory where Lightning would otherwise start from step 0 or read a checkpoint.
At fit start (the strategy has wrapped the model and built the optimizers) the callback restores the newest
committed step into the model, optimizers, LR schedulers, precision plugin (grad scaler), the state of the
other callbacks and of the data module, and Lightning's loop state, and at train start (after
`train_dataloader()`, which may draw a dataset from the global RNG) the RNG states - the same state a checkpoint saved at
`on_train_batch_end` would hold, so the Trainer continues with the batch after the committed step. After
every optimizer step it saves. Loaders that keep their position (MMAPDataLoader / MMAPDataModule, or any
state_dict()/load_state_dict() loader) continue exactly there; a plain DataLoader is restarted at the
beginning of its epoch by Lightning (Lightning warns), so use MMAPDataModule for exact resumes: over a
DataLoader with `shuffle=True` (Lightning's DistributedSampler), a seeded RandomSampler, a
SequentialSampler or a ResumableSampler it resumes at the batch after the committed step.

Lightning stays optional: this module imports it only when a callback is created, and the callback derives
from the Callback class of whichever Lightning distribution (`lightning.pytorch`, `pytorch_lightning`) the
script imported.
"""
from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Optional

from hyperpodrun.errors import ApiTypeError, ApiValueError, MissingDependencyError

log = logging.getLogger("hyperpodrun.runtime")

_DISTRIBUTIONS = ("lightning.pytorch", "pytorch_lightning")


def _callback_bases() -> tuple[type, ...]:
    """The Callback classes of the Lightning distributions in use (imported by the script), else of the one
    installed."""
    bases = [sys.modules[m].Callback for m in _DISTRIBUTIONS if m in sys.modules and hasattr(sys.modules[m], "Callback")]
    if bases:
        return tuple(bases)
    for name in _DISTRIBUTIONS:
        try:
            return (importlib.import_module(name).Callback,)
        except ImportError:
            continue
    raise MissingDependencyError("CheckpointlessCallback needs Lightning: pip install lightning (or "
                                 "pytorch_lightning); without Lightning use CheckpointManager.save()/restore() in "
                                 "your own loop")


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _TrainerState:
    """What a Trainer keeps besides model, optimizers and schedulers (one CheckpointManager entry)."""

    def __init__(self, trainer: Any, owner: "CheckpointlessCallback") -> None:
        self.trainer, self.owner = trainer, owner

    def _loops(self) -> dict:
        """The fit loop's state; each MMAP loader's position is the batch after the one just trained (the
        loader itself is ahead by what Lightning's fetcher prefetched)."""
        from hyperpodrun.data.loader import MMAPDataLoader
        fit_loop = self.trainer.fit_loop
        sd = fit_loop.state_dict()
        combined = getattr(fit_loop, "_combined_loader", None)
        states = sd.get("state_dict", {}).get("combined_loader")
        if combined is not None and states:
            ahead = len(getattr(getattr(fit_loop, "_data_fetcher", None), "batches", None) or ())
            stateful = [dl for dl in combined.flattened if _has_state(dl)]
            for i, dl in enumerate(stateful[:len(states)]):
                if isinstance(dl, MMAPDataLoader):
                    states[i] = {"step": max(0, dl.cursor - ahead)}
        return sd

    def state_dict(self) -> dict:
        t = self.trainer
        callbacks = {}
        for cb in t.callbacks:
            if cb is self.owner:
                continue
            sd = cb.state_dict()
            if sd:
                callbacks[cb.state_key] = sd
        dm = t.datamodule
        return {"loops": self._loops(), "precision": t.precision_plugin.state_dict(), "callbacks": callbacks,
                "datamodule": dm.state_dict() if dm is not None and _has_state(dm) else None}

    def load_state_dict(self, sd: dict) -> None:
        t = self.trainer
        dm = t.datamodule
        if sd.get("datamodule") is not None and dm is not None and _has_state(dm):
            dm.load_state_dict(sd["datamodule"])
        if sd.get("precision"):
            t.precision_plugin.load_state_dict(sd["precision"])
        for cb in t.callbacks:
            if cb is not self.owner and cb.state_key in sd.get("callbacks", {}):
                cb.load_state_dict(sd["callbacks"][cb.state_key])
        t.fit_loop.load_state_dict(sd["loops"])   # marks the loops as restarting: Lightning resumes mid-epoch


class CheckpointlessCallback:
    """Saves the training state with `checkpoint_manager` after every optimizer step and restores it when
    `Trainer.fit` starts again after a restart (see the module doc).

    checkpoint_manager: the CheckpointManager given to HPWrapper(checkpoint_manager=...).
    save_every: save after every N-th optimizer step (default 1: at most one step is lost to a fault).
    """

    _subclasses: dict[tuple[type, ...], type] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "CheckpointlessCallback":
        bases = tuple(b for b in _callback_bases() if not issubclass(cls, b))
        if bases:
            key = (cls, *bases)
            sub = CheckpointlessCallback._subclasses.get(key)
            if sub is None:
                sub = type(cls.__name__, key, {"__module__": cls.__module__, "__doc__": cls.__doc__})
                CheckpointlessCallback._subclasses[key] = sub
            cls = sub
        return object.__new__(cls)

    def __init__(self, checkpoint_manager: Any, save_every: int = 1) -> None:
        from hyperpodrun.state.checkpoint import CheckpointManager
        if not isinstance(checkpoint_manager, CheckpointManager):
            raise ApiTypeError(f"CheckpointlessCallback(checkpoint_manager={type(checkpoint_manager).__name__}): "
                               "needs the CheckpointManager given to HPWrapper(checkpoint_manager=...)")
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ApiValueError(f"CheckpointlessCallback(save_every={save_every!r}): an int >= 1 (optimizer steps)")
        self.checkpoint_manager = checkpoint_manager
        self.save_every = save_every
        self.restored_step: Optional[int] = None
        self._state: Optional[dict] = None
        self._last_saved: Optional[int] = None
        self._rng: Optional[dict] = None
        self._unsynced: Optional[dict] = None   # the DDP arguments given init_sync=False by setup()

    def __reduce__(self) -> tuple:
        return CheckpointlessCallback, (self.checkpoint_manager, self.save_every)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before the strategy wraps the module (DDP): in a generation after a restart, DDP is made without its
        construction broadcast, which would copy rank 0's parameters over every rank's before restore() runs.
        Why: a survivor keeps the values of its last committed step only if nothing wrote them - and rank 0 may be
        the rank that raised, a step behind the others (then every survivor's live state was overwritten with
        the older values and copied back from its slot). restore() makes every rank's module the committed
        step; where nothing was committed, on_fit_start broadcasts from rank 0 as DDP would have. Every rank
        decides alike: the generation is the same on all, and an init_sync the script set is left as it is."""
        self._unsynced = None
        if stage != "fit" or self._generation(trainer) < 1:
            return
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)
        if isinstance(kwargs, dict) and "init_sync" not in kwargs and _ddp_takes_init_sync():
            kwargs["init_sync"] = False
            self._unsynced = kwargs

    def _generation(self, trainer: Any) -> int:
        caller = getattr(trainer, "wrapper", None) or self.checkpoint_manager.caller
        generation = getattr(caller, "iteration", 0)
        return generation if isinstance(generation, int) else 0

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from hyperpodrun.state.state_dicts import rng_state, set_rng_state
        unsynced, self._unsynced = self._unsynced, None
        if unsynced is not None:
            unsynced.pop("init_sync", None)        # the strategy's arguments as the script gave them
        self._state = self.state_of(trainer)
        before = rng_state()
        self.restored_step = self.checkpoint_manager.restore(self._state)
        if unsynced is not None and self.restored_step is None:
            _broadcast_module(trainer.strategy.model)
        if self.restored_step is not None:
            # the restored RNG is for the training steps; what fit does first (train_dataloader() may draw a
            # dataset from the global RNG, as Lightning's RandomDataset does) draws as in the fault-free run
            self._rng = rng_state()
            set_rng_state(before)
        # a fresh start saves after the first optimizer step, not the untrained state
        self._last_saved = self.restored_step if self.restored_step is not None else trainer.global_step
        if self.restored_step is not None:
            log.info("Lightning: resuming at optimizer step %d (epoch %d) from memory", self.restored_step,
                     trainer.current_epoch)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._rng is not None:
            from hyperpodrun.state.state_dicts import set_rng_state
            set_rng_state(self._rng)
            self._rng = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        caller = getattr(trainer, "wrapper", None) or self.checkpoint_manager.caller
        if caller is not None and callable(getattr(caller, "progress", None)):
            caller.progress(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_saved or step % self.save_every:
            return   # no optimizer step since the last save (gradient accumulation), or not a save step
        if self._state is None:
            self._state = self.state_of(trainer)
        self.checkpoint_manager.save(step, self._state)
        self._last_saved = step

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The fit failed and HPWrapper will run the function again in this process: Lightning's teardown that
        follows this hook keeps the module and the optimizers' state where they are (see keep_on_device)."""
        if _restarted_in_process():
            keep_on_device(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.checkpoint_manager.wait()
        self._state = None

    # ------------------------------------------------------------------ what is saved
    def state_of(self, trainer: Any) -> dict[str, Any]:
        """The CheckpointManager state of `trainer`: the strategy's model (DDP / FSDP wrapped), optimizers,
        LR schedulers and the rest of the trainer's state (loops, precision, callbacks, data module)."""
        state: dict[str, Any] = {"model": trainer.strategy.model}
        for i, opt in enumerate(trainer.optimizers):
            state[f"optimizer{i}"] = opt
        for i, config in enumerate(trainer.lr_scheduler_configs):
            state[f"lr_scheduler{i}"] = config.scheduler
        state["trainer"] = _TrainerState(trainer, self)
        return state


def _restarted_in_process() -> bool:
    from hyperpodrun.runtime.wrapper import inprocess_enabled
    return inprocess_enabled()


def keep_on_device(trainer: Any) -> None:
    """Make the Trainer's next strategy teardown (the one Lightning runs right after a failed fit) leave the
    module, the optimizers' state and the device's cache as they are; everything else it does (DDP unwrapped,
    layer sync reverted, precision plugin, checkpoint IO, cluster environment) still runs.

    Why: Lightning's teardown moves the module and every optimizer's state to host memory and empties the CUDA
    cache - for a 0.67 B model with AdamW about 8 GB copied to pageable host memory, seconds of the recovery -
    and the fit that the restart runs next moves the module back. A survivor's tensors must stay where they
    are for the state tier to keep them live, and what the failed generation leaves behind is collected by
    HPWrapper's finalize (gc.collect, torch.cuda.empty_cache) before the next generation starts. Only this one
    teardown is changed: the strategy gets an instance attribute that removes itself when called.

    The helper patched is a module global of Lightning's strategy modules, so this relies on no other thread of
    the process tearing a Trainer down at the same moment (Lightning itself never does)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or "teardown" in vars(strategy):
        return
    full = type(strategy).teardown

    def teardown() -> None:
        del vars(strategy)["teardown"]
        scopes = {id(fn.__globals__): fn.__globals__ for cls in type(strategy).__mro__
                  if (fn := vars(cls).get("teardown")) is not None
                  and "_optimizers_to_device" in getattr(fn, "__globals__", {})}
        moves = [(scope, scope["_optimizers_to_device"]) for scope in scopes.values()]
        module, accelerator = getattr(strategy, "lightning_module", None), getattr(strategy, "accelerator", None)
        for scope, _ in moves:
            scope["_optimizers_to_device"] = _stay
        if module is not None:
            vars(module)["cpu"] = lambda: module
        if accelerator is not None:
            vars(accelerator)["teardown"] = _stay
        try:
            full(strategy)
        finally:
            for scope, move in moves:
                scope["_optimizers_to_device"] = move
            if module is not None:
                vars(module).pop("cpu", None)
            if accelerator is not None:
                vars(accelerator).pop("teardown", None)
    strategy.teardown = teardown


def _stay(*args: Any, **kwargs: Any) -> None:
    """Stands in for moving the optimizers to the host and for the accelerator's teardown (keep_on_device)."""


def _ddp_takes_init_sync() -> bool:
    import inspect

    from torch.nn.parallel import DistributedDataParallel
    try:
        return "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):
        return False


def _broadcast_module(module: Any) -> None:
    """Rank 0's parameters and buffers to every rank (what DDP's construction does when init_sync is on)."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    inner = getattr(module, "module", module)
    with torch.no_grad():
        for t in list(inner.parameters()) + list(inner.buffers()):
            dist.broadcast(t.data, src=0)


__all__ = ["CheckpointlessCallback"]
