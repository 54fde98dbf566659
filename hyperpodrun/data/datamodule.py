"""MMAPDataModule: a Lightning DataModule whose training batches come from the MMAP cache.

    mmap_config = CacheResumeMMAPConfig(prefetch_length=10, lookback_length=2)   # cache: /dev/shm/pdl_cache-<uid>
    data_module = MMAPDataModule(data_module=YourDataModule(...), mmap_config=mmap_config)
    trainer.fit(model, data_module)

Lightning stays optional: nothing here imports it. When the wrapped module is a LightningDataModule
(of `lightning.pytorch` or `pytorch_lightning`: whichever class the wrapped module derives from), the
instance is of a subclass of that very class, so `Trainer.fit` accepts it; otherwise MMAPDataModule is a
duck-typed data module (train_dataloader(), setup(), ...). The training loader is an MMAPDataLoader
over the wrapped module's train_dataloader(): Lightning iterates it epoch by epoch, and its
state_dict()/load_state_dict() (Lightning saves stateful loaders' state in checkpoints; a
CheckpointManager state can hold the data module too) put the stream back at the restored step.
Validation, test and predict loaders are passed through unchanged.

Lightning puts a DistributedSampler into the DataLoaders it is given; it is given the MMAPDataLoader, so
MMAPDataModule does that for the wrapped training loader (same rules: a distributed trainer with
`use_distributed_sampler`). torch's DistributedSampler / RandomSampler / SequentialSampler resume at any
step (positioning.py). When fit ends normally the stream's files go: at once outside an in-process
restart, at the job's end under one (a fault of another rank may still bring this one back into fit).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Optional

from hyperpodrun.data.config import CacheResumeMMAPConfig
from hyperpodrun.data.loader import MMAPDataLoader
from hyperpodrun.errors import ApiTypeError
from hyperpodrun import env as E

log = logging.getLogger("hyperpodrun.data")

_DELEGATED = ("prepare_data", "setup", "val_dataloader", "test_dataloader", "predict_dataloader",
              "transfer_batch_to_device", "on_before_batch_transfer", "on_after_batch_transfer", "on_exception")


def _lightning_base(kind: type) -> Optional[type[Any]]:
    """The LightningDataModule class `kind` derives from (any Lightning distribution), or None."""
    for base in kind.__mro__:
        if base.__name__ == "LightningDataModule":
            return base
    return None


def _rebuild(data_module: Any, mmap_config: CacheResumeMMAPConfig, epochs: Optional[int]) -> "MMAPDataModule":
    return MMAPDataModule(data_module=data_module, mmap_config=mmap_config, epochs=epochs)


class MMAPDataModule:
    """Wraps a data module: its train_dataloader() is served from the MMAP cache (see the module doc).

    data_module: a LightningDataModule, or any object with train_dataloader().
    mmap_config: CacheResumeMMAPConfig (default settings when None).
    epochs: passed to MMAPDataLoader (None: as many epochs as Lightning runs).
    """

    _subclasses: dict[type, type] = {}

    def __new__(cls, data_module: Any = None, mmap_config: Optional[CacheResumeMMAPConfig] = None,
                **kwargs: Any) -> "MMAPDataModule":
        base = _lightning_base(type(data_module)) if data_module is not None else None
        if base is not None and not issubclass(cls, base):
            sub = MMAPDataModule._subclasses.get(base)
            if sub is None:
                sub = type(cls.__name__, (cls, base), {"__module__": cls.__module__})
                MMAPDataModule._subclasses[base] = sub
            cls = sub
        return object.__new__(cls)

    def __init__(self, data_module: Any, mmap_config: Optional[CacheResumeMMAPConfig] = None, *,
                 epochs: Optional[int] = None) -> None:
        if not callable(getattr(data_module, "train_dataloader", None)):
            raise ApiTypeError(f"MMAPDataModule(data_module={type(data_module).__name__}): needs a data module with "
                               "train_dataloader() (a LightningDataModule)")
        base = _lightning_base(type(self))
        if base is not None:
            base.__init__(self)
        self.data_module = data_module
        self.mmap_config = mmap_config if mmap_config is not None else CacheResumeMMAPConfig()
        self.epochs = epochs
        self._train: Optional[MMAPDataLoader] = None
        self._cursor: Optional[int] = None

    def __reduce__(self) -> tuple:
        return _rebuild, (self.data_module, self.mmap_config, self.epochs)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found normally: everything else of the wrapped module
        wrapped = self.__dict__.get("data_module")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(wrapped, name)

    # ------------------------------------------------------------------ the cached loader
    def train_dataloader(self) -> MMAPDataLoader:
        if self._train is None:
            inner = _with_distributed_sampler(self.__dict__.get("trainer"), self.data_module.train_dataloader())
            self._train = MMAPDataLoader(inner, self.mmap_config, epochs=self.epochs, name="train")
            if self._cursor is not None:
                self._train.cursor = self._cursor
        return self._train

    def seek(self, step: int) -> None:
        """Resume the training stream at `step` (e.g. the step CheckpointManager.restore returned)."""
        self._cursor = int(step)
        if self._train is not None:
            self._train.cursor = int(step)

    def state_dict(self) -> dict:
        inner = self.data_module.state_dict() if callable(getattr(self.data_module, "state_dict", None)) else {}
        step = self._train.cursor if self._train is not None else (self._cursor or 0)
        return {"data_module": inner, "mmap_train_step": step}

    def load_state_dict(self, state: dict) -> None:
        if callable(getattr(self.data_module, "load_state_dict", None)) and state.get("data_module") is not None:
            self.data_module.load_state_dict(state["data_module"])
        if "mmap_train_step" in state:
            self.seek(state["mmap_train_step"])

    def teardown(self, stage: Optional[str] = None) -> None:
        """Delegated; after a finished fit the training stream counts as finished (its files go at exit)."""
        fn = getattr(self.data_module, "teardown", None)
        if callable(fn):
            fn(stage)
        if stage in (None, "fit") and self._train is not None and self._fit_finished():
            if E.worker_context().under_inprocess_restart:
                self._train.close()     # files go when the job completes: a peer's fault may still re-enter fit
            else:
                self._train.release()   # nothing can restart this fit in-process: the files go now

    def _fit_finished(self) -> bool:
        """Whether fit ended normally (max_steps / max_epochs reached, or stopped by a callback).

        Lightning calls the teardown hook before it sets the status to "finished" (it is still "running"
        then), and after an exception only with the status "interrupted"."""
        trainer = self.__dict__.get("trainer")   # set by Lightning on the module given to fit()
        status = getattr(getattr(trainer, "state", None), "status", None)
        if status is None:
            return True
        return str(getattr(status, "value", status)) in ("running", "finished")


def _with_distributed_sampler(trainer: Any, loader: Any) -> Any:
    """`loader` with the sampler Lightning would have put in (a DistributedSampler over the job's ranks when
    the trainer is distributed and `use_distributed_sampler` is on), as it does for the DataLoaders it is
    given: Lightning sees only the MMAPDataLoader, which is not a DataLoader. A sampler that already has
    `resume_from` (a ResumableSampler, sharded by the script) is left alone."""
    from torch.utils.data import DataLoader
    if trainer is None or not isinstance(loader, DataLoader):
        return loader
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    if callable(getattr(sampler, "resume_from", None)):
        return loader
    prepare = getattr(getattr(trainer, "_data_connector", None), "_prepare_dataloader", None)
    package = type(trainer).__module__.split(".trainer", 1)[0]   # lightning.pytorch or pytorch_lightning
    try:
        stage = importlib.import_module(f"{package}.trainer.states").RunningStage.TRAINING
        if prepare is None:
            raise AttributeError("Trainer._data_connector._prepare_dataloader")
        return prepare(loader, shuffle=True, mode=stage)
    except (ImportError, AttributeError) as exc:
        log.warning("MMAPDataModule: cannot add Lightning's distributed sampler to %s (%s: this Lightning version "
                    "differs); give the DataLoader a DistributedSampler or a ResumableSampler yourself",
                    type(loader).__name__, exc)
        return loader


def _delegate(name: str) -> Any:
    def hook(self: MMAPDataModule, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.data_module, name, None)
        return fn(*args, **kwargs) if callable(fn) else None
    hook.__name__ = name
    hook.__doc__ = f"The wrapped data module's {name}()."
    return hook


for _name in _DELEGATED:
    setattr(MMAPDataModule, _name, _delegate(_name))


__all__ = ["MMAPDataModule"]
