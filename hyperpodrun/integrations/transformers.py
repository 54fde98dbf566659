"""CheckpointlessTrainerCallback: a CheckpointManager wired into a Hugging Face `transformers.Trainer`.

    cm = CheckpointManager()

    @HPWrapper(checkpoint_manager=cm)
    def main(caller=None):
        args = TrainingArguments(...)            # inside the function: it creates the process group
        trainer = Trainer(model=build(), args=args, train_dataset=data,
                          callbacks=[CheckpointlessTrainerCallback(checkpoint_manager=cm)])
        trainer.train()                          # unchanged; resume_from_checkpoint= stays the disk tier

Why: after an in-process restart the wrapped function runs again and builds a new Trainer, which would start
at step 0 or read a disk checkpoint. The callback restores the newest committed step from memory into it and
makes the Trainer continue exactly where a run without the fault would be: same batches, same RNG, same
logged losses, same `train_loss` and `TrainerState`.

How it hooks in (transformers 5.x; the Trainer gives a callback no handle on itself nor on the loop's
position, so a few Trainer internals are used, all checked at `train()` start - a Trainer that lacks one
fails with one MissingDependencyError naming it, never with silently wrong results):
- on_train_begin (the model is wrapped in DDP, optimizer and LR scheduler exist): find the Trainer (the
  frame that runs its training loop), restore model, optimizer, LR scheduler, grad scaler, `TrainerState`,
  `TrainerControl`, the stateful callbacks, the RNG states and the loss bookkeeping (`_tr_loss`,
  `_total_loss_scalar`, `_globalstep_last_logged`, `current_flos`, and `_initial_global_step` where the
  Trainer has one: 5.17 has not).
- `Trainer._run_epoch` (wrapped on the instance): epochs already completed are skipped; the resumed epoch
  runs with the Trainer's own resume arguments (epochs_trained, steps_trained_in_current_epoch and a
  marker in place of resume_from_checkpoint), so accelerate's `skip_first_batches` skips the batches
  already trained, the sampler gets its epoch and the loop its step counters exactly as when resuming from a
  disk checkpoint; `Trainer._load_rng_state` (wrapped) gives back the restored RNG for the marker.
- `Trainer._maybe_log_save_evaluate` (wrapped): the snapshot is taken after it, once the step's loss is
  logged - a restore then neither logs a step twice nor merges two steps into one logged loss. The last step
  of an epoch (or of training) is saved after the epoch's end (on_epoch_end and its log/evaluate/save).
- on_step_begin reports `state.global_step` as the progress the agent watches.

TrainingArguments creates the process group when it is built: built before the wrapped function (module
level, HfArgumentParser), the group cannot be created again at a restart, so under --inprocess-restart the
callback refuses it (SetupOrderError). Without --inprocess-restart (plain python, torchrun, process-level
restarts) HPWrapper calls the function once and the saves are CheckpointManager's local snapshots: removed
at exit under plain python, restored from by the workers a launcher starts again.

Limits: exact with the rank's own memory (in-process restart, or a respawned rank on the same node). From a
replica peer's memory a rank gets that peer's RNG and its share of the not yet logged loss. At a restore,
callbacks see on_epoch_begin again for the epochs already completed (no training, no on_epoch_end).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import sys
from types import FrameType
from typing import Any, Callable, Optional

from hyperpodrun.errors import ApiTypeError, ApiValueError, MissingDependencyError, SetupOrderError

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as _exc:   # transformers is optional: only this module needs it
    raise MissingDependencyError("hyperpodrun.integrations.transformers needs Hugging Face transformers: pip install "
                                 "'transformers>=5' accelerate (without it use CheckpointManager.save()/restore() in "
                                 "your own loop)") from _exc

log = logging.getLogger("hyperpodrun.runtime")

#: Trainer internals used, each with the parameters used (checked when train() starts)
_METHODS: dict[str, tuple[str, ...]] = {
    "_run_epoch": ("model", "epoch", "num_update_steps_per_epoch", "resume_from_checkpoint", "epochs_trained",
                   "steps_trained_in_current_epoch"),
    "_maybe_log_save_evaluate": (),
    "_load_rng_state": ("checkpoint",),
}
_ATTRIBUTES = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged", "current_flos",
               "model_wrapped", "optimizer", "lr_scheduler", "accelerator", "callback_handler", "control", "state")
#: the transformers releases the callback is tested with, in CI (tests/test_hf_trainer.py): the oldest and newest
TESTED = ("5.17.0", "5.25.0")
#: per-rank fields of TrainerState that a replica peer's snapshot must not overwrite
_PER_RANK = ("is_local_process_zero", "is_world_process_zero")


class _FromMemory(str):
    """Stands for `resume_from_checkpoint` in the resumed epoch: the state came from memory, not a directory."""


_MEMORY = _FromMemory("<hyperpodrun: in-memory snapshot>")


def _check_internals(trainer: Any) -> None:
    """One clear error when this Trainer lacks an internal the callback relies on (another transformers)."""
    missing = [a for a in _ATTRIBUTES if not hasattr(trainer, a)]
    for name, params in _METHODS.items():
        method = getattr(trainer, name, None)
        if not callable(method):
            missing.append(f"{name}()")
            continue
        have = inspect.signature(method).parameters
        missing += [f"{name}({p}=)" for p in params if p not in have]
    if missing:
        raise MissingDependencyError(
            f"CheckpointlessTrainerCallback: this transformers ({transformers.__version__}) Trainer lacks "
            f"{', '.join(missing)}, which the callback needs to resume exactly (it supports transformers 5.x, "
            f"tested with {' and '.join(TESTED)}); install a supported transformers")


def _find_trainer(callback: Any) -> Any:
    """The Trainer whose training loop called `callback`: the caller's frames (the Trainer hands callbacks
    neither itself nor its position in the loop)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer) and any(cb is callback for cb in obj.callback_handler.callbacks):
            return obj
        frame = frame.f_back
    raise MissingDependencyError("CheckpointlessTrainerCallback: no transformers.Trainer runs this callback "
                                 "(on_train_begin was called from outside Trainer.train())")


def _refuse_early_group() -> None:
    """Under --inprocess-restart, a process group that existed before the HPWrapper function ran cannot be
    created again at a restart (a respawned rank would wait in it for good): end the job with what to move."""
    from hyperpodrun.runtime.torch_state import group_before_wrapper
    from hyperpodrun.runtime.wrapper import inprocess_enabled
    if inprocess_enabled() and group_before_wrapper():
        raise SetupOrderError(
            "CheckpointlessTrainerCallback: the process group was created before the HPWrapper function ran "
            "(TrainingArguments or HfArgumentParser.parse_args_into_dataclasses() at module level creates it), "
            "so a restart cannot create it again: move that call into the wrapped function")


def _callback_states(trainer: Any) -> dict[str, list[dict]]:
    states: dict[str, list[dict]] = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ExportableState):
            states.setdefault(type(cb).__name__, []).append(cb.state())
    return states


@dataclasses.dataclass
class _Position:
    """Where in the loop a snapshot was taken: the epoch, the global step at its start, whether after its end."""
    step: int
    epoch: int
    epoch_start: int
    at_epoch_end: bool
    stop: bool


def _plain(value: Any) -> Any:
    """A numpy / torch scalar in a log entry as the Python number it holds; anything else is refused."""
    if callable(getattr(value, "item", None)) and getattr(value, "ndim", 0) == 0:
        return value.item()
    raise ApiTypeError(f"CheckpointlessTrainerCallback: TrainerState.log_history holds a {type(value).__name__} "
                       f"({value!r}); log numbers and strings (HF's own checkpoints store it as JSON too)")


class _LogHistory:
    """`TrainerState.log_history` as one JSON text, encoded incrementally: it only grows during training, and
    encoded as a list of dicts at every save it would cost ~6 ms per 1,000 entries (a long run logging every
    step would spend more time saving than training). JSON is what HF's own checkpoints hold (floats exact)."""

    def __init__(self) -> None:
        self._count, self._last, self._body = 0, None, ""

    def encode(self, history: list) -> str:
        n = self._count
        if n > len(history) or (n and history[n - 1] is not self._last):
            n, self._body = 0, ""                  # not the list encoded so far (replaced or rewritten)
        if len(history) > n:
            new = ",".join(json.dumps(e, default=_plain) for e in history[n:])
            self._body = f"{self._body},{new}" if self._body else new
            self._count, self._last = len(history), history[-1]
        else:
            self._count = n
        return f"[{self._body}]"


class _TrainerEntry:
    """What a Trainer keeps besides model, optimizer, scheduler and scaler (one CheckpointManager entry)."""

    def __init__(self, trainer: Any, owner: "CheckpointlessTrainerCallback") -> None:
        self.trainer, self.owner = trainer, owner

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        state = {f.name: getattr(t.state, f.name) for f in dataclasses.fields(t.state)
                 if f.name not in ("log_history", "stateful_callbacks")}   # callbacks: saved from themselves
        state = copy.deepcopy(state)
        state["log_history"] = self.owner._history.encode(t.state.log_history)
        return {"state": state, "control": dataclasses.asdict(t.control), "callbacks": _callback_states(t),
                # a copy: the Trainer adds each step's loss into its tensor in place before the next optimizer
                # step, which would change the saved value (and a fault there would not find the state as saved)
                "loss": {"tr_loss": t._tr_loss.detach().clone(), "total": float(t._total_loss_scalar),
                         "last_logged": int(t._globalstep_last_logged),
                         # 5.25 has it (train_loss averages over this train() call's steps); 5.17 has not
                         "initial_step": int(getattr(t, "_initial_global_step", -1)),
                         "initial_tokens": int(getattr(t, "_initial_num_input_tokens_seen", 0) or 0),
                         "flos": float(t.current_flos)},
                "position": dict(self.owner._position)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        for k, v in sd["state"].items():
            if k not in _PER_RANK and hasattr(t.state, k):
                setattr(t.state, k, json.loads(v) if k == "log_history" else v)
        control = dict(sd["control"])
        stop = bool(control.pop("should_training_stop", False))   # applied where the loop reaches the position
        for k, v in control.items():
            setattr(t.control, k, v)
        by_name: dict[str, list[Any]] = {}
        for cb in t.callback_handler.callbacks:
            if isinstance(cb, ExportableState):
                by_name.setdefault(type(cb).__name__, []).append(cb)
        for name, saved in sd["callbacks"].items():
            for cb, st in zip(by_name.get(name, []), saved):
                for attr, value in st.get("attributes", {}).items():
                    setattr(cb, attr, value)
        loss = sd["loss"]
        t._tr_loss = loss["tr_loss"].to(t._tr_loss.device)
        t._total_loss_scalar = loss["total"]
        t._globalstep_last_logged = loss["last_logged"]
        if hasattr(t, "_initial_global_step") and loss["initial_step"] >= 0:
            t._initial_global_step = loss["initial_step"]
        t._initial_num_input_tokens_seen = loss["initial_tokens"]
        t.current_flos = loss["flos"]
        pos = sd["position"]
        self.owner._restored = _Position(int(t.state.global_step), int(pos["epoch"]), int(pos["epoch_start"]),
                                         bool(pos["at_epoch_end"]), stop)


class CheckpointlessTrainerCallback(TrainerCallback):
    """Saves the training state with `checkpoint_manager` after every optimizer step and restores it when
    `Trainer.train()` starts again after a restart (see the module doc).

    checkpoint_manager: the CheckpointManager given to HPWrapper(checkpoint_manager=...).
    save_every: save after every N-th optimizer step (default 1: at most one step is lost to a fault).
    """

    def __init__(self, checkpoint_manager: Any, save_every: int = 1) -> None:
        from hyperpodrun.state.checkpoint import CheckpointManager
        if not isinstance(checkpoint_manager, CheckpointManager):
            raise ApiTypeError(f"CheckpointlessTrainerCallback(checkpoint_manager={type(checkpoint_manager).__name__})"
                               ": needs the CheckpointManager given to HPWrapper(checkpoint_manager=...)")
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ApiValueError(f"CheckpointlessTrainerCallback(save_every={save_every!r}): an int >= 1 "
                                "(optimizer steps)")
        _refuse_early_group()
        self.checkpoint_manager = checkpoint_manager
        self.save_every = save_every
        #: the step restored from memory by the last train() (None: a fresh start or a disk checkpoint)
        self.restored_step: Optional[int] = None
        self._trainer: Any = None
        self._state: Optional[dict[str, Any]] = None
        self._restored: Optional[_Position] = None   # set by _TrainerEntry.load_state_dict
        self._resume: Optional[_Position] = None     # the position the loop still has to reach
        self._rng: Optional[dict[str, Any]] = None
        self._position: dict[str, Any] = {"epoch": 0, "epoch_start": 0, "at_epoch_end": False}
        self._steps_per_epoch = 0
        self._epoch_ending = False
        self._last_saved: Optional[tuple[int, int, bool]] = None
        self._history = _LogHistory()

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from hyperpodrun.state.state_dicts import rng_state
        _refuse_early_group()          # also when the callback itself was built before the wrapped function
        trainer = _find_trainer(self)
        _check_internals(trainer)
        self._install(trainer)
        self._state = self.state_of(trainer)
        self._restored = self._resume = self._rng = None
        self._epoch_ending = False     # a fault may have come between on_epoch_end and the epoch's last log
        self.restored_step = self.checkpoint_manager.restore(self._state)
        if self.restored_step is not None and self._restored is not None:
            self._rng = rng_state()          # as restored: given back where the Trainer reloads a checkpoint's RNG
            self._resume = self._restored
            log.info("Trainer: resuming at optimizer step %d (epoch %d) from memory", self.restored_step,
                     self._restored.epoch)
        # a fresh start saves after the first optimizer step, not the untrained state
        self._last_saved = (int(state.global_step), -1, False)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        caller = self.checkpoint_manager.caller
        if caller is not None and callable(getattr(caller, "progress", None)):
            caller.progress(state.global_step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_ending = True   # the next _maybe_log_save_evaluate is the epoch's last one

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.checkpoint_manager.wait()
        self._state = self._resume = self._rng = None

    # ------------------------------------------------------------------ what is saved
    def state_of(self, trainer: Any) -> dict[str, Any]:
        """The CheckpointManager state of `trainer`: the model as trained (DDP-wrapped), the optimizer, the LR
        scheduler, accelerate's grad scaler (when there is one) and the rest of the Trainer's state."""
        import torch
        opt = trainer.optimizer
        inner = getattr(opt, "optimizer", None)   # accelerate's AcceleratedOptimizer wraps the torch one
        state: dict[str, Any] = {"model": trainer.model_wrapped,
                                 "optimizer": inner if isinstance(inner, torch.optim.Optimizer) else opt}
        if trainer.lr_scheduler is not None:
            state["lr_scheduler"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["grad_scaler"] = scaler
        state["trainer"] = _TrainerEntry(trainer, self)
        return state

    # ------------------------------------------------------------------ hooks into the Trainer's loop
    def _install(self, trainer: Any) -> None:
        """Wrap the three Trainer methods on this instance (once; the class stays untouched)."""
        if trainer.__dict__.get("_hyperpodrun_callback") is self:
            return
        trainer._hyperpodrun_callback = self
        for name, hook in (("_run_epoch", self._run_epoch), ("_maybe_log_save_evaluate", self._after_log),
                           ("_load_rng_state", self._load_rng)):
            original = getattr(type(trainer), name).__get__(trainer)
            setattr(trainer, name, _bind(hook, original))
        self._trainer = trainer

    def _run_epoch(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        trainer = self._trainer
        bound = inspect.signature(original).bind(*a, **kw)
        arg = bound.arguments
        epoch = int(arg["epoch"])
        r = self._resume
        if r is not None:
            if r.at_epoch_end and r.stop:      # the snapshot is after the end of training
                if epoch < r.epoch:
                    return None
                self._resume = None
                trainer.control.should_training_stop = True
                return None
            target = r.epoch + 1 if r.at_epoch_end else r.epoch
            if epoch < target:
                return None                    # completed before the snapshot
            self._resume = None
            done = 0 if r.at_epoch_end else r.step - r.epoch_start
            arg.update(epochs_trained=epoch, resume_from_checkpoint=_MEMORY,
                       steps_trained_in_current_epoch=done * trainer.args.gradient_accumulation_steps)
        gs = int(trainer.state.global_step)
        start = gs
        if arg.get("resume_from_checkpoint") is not None and epoch == arg.get("epochs_trained"):
            skipped = int(arg.get("steps_trained_in_current_epoch") or 0)
            if skipped > 0 and not trainer.args.ignore_data_skip:
                start = gs - skipped // trainer.args.gradient_accumulation_steps
        self._steps_per_epoch = int(arg["num_update_steps_per_epoch"])
        self._position = {"epoch": epoch, "epoch_start": start, "at_epoch_end": False}
        return original(*bound.args, **bound.kwargs)

    def _after_log(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        result = original(*a, **kw)
        trainer = self._trainer
        at_end, self._epoch_ending = self._epoch_ending, False
        gs = int(trainer.state.global_step)
        pos = self._position
        if not at_end:
            control = trainer.control
            if control.should_training_stop or control.should_epoch_stop or \
                    gs - int(pos["epoch_start"]) >= self._steps_per_epoch:
                return result                  # the epoch ends next: saved after its end
        key = (gs, int(pos["epoch"]), at_end)
        if gs == 0 or key == self._last_saved or gs % self.save_every:
            return result
        self._position = dict(pos, at_epoch_end=at_end)
        if self._state is None:
            self._state = self.state_of(trainer)
        self.checkpoint_manager.save(gs, self._state)
        self._last_saved = key
        return result

    def _load_rng(self, original: Callable[..., Any], checkpoint: Any, *a: Any, **kw: Any) -> Any:
        if checkpoint is _MEMORY:
            from hyperpodrun.state.state_dicts import set_rng_state
            if self._rng is not None:
                set_rng_state(self._rng)
            return None
        return original(checkpoint, *a, **kw)


def _bind(hook: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*a: Any, **kw: Any) -> Any:
        return hook(original, *a, **kw)
    call.__wrapped__ = original   # type: ignore[attr-defined]
    call.__signature__ = inspect.signature(original)   # type: ignore[attr-defined]
    return call


__all__ = ["CheckpointlessTrainerCallback"]
