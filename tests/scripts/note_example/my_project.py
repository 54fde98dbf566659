"""`my_project` of the product note's complete example (training_script.py): a small LightningModule (MyModel)
and a LightningDataModule (MyDataModule), deterministic on CPU.

For tests/test_note_example.py: OUT_DIR receives, per rank, how the rank got its state in each generation
(restores.rank<r>: generation, step, CheckpointManager.restored_from), the process of each generation
(pids.rank<r>), the CheckpointManager's replica groups (groups.rank<r>) and at the end its parameters and optimizer state (rank<r>.pt). NOTE_FAULT=rank:step: in
generation 0 that rank loses its snapshots and is SIGKILLed at the top of that step (as when its node's memory
goes), once every other rank has saved the step before it.
"""
import os
import shutil
import signal
import time

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

OUT_DIR = os.environ.get("OUT_DIR", ".")


class Samples(Dataset):
    """Sample i is drawn from seed i: the same on every rank and in every process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        return x, torch.tanh(x[:4].sum(dim=0, keepdim=True))


class MyDataModule(pl.LightningDataModule):
    def __init__(self, data_path: str, batch_size: int) -> None:
        super().__init__()
        self.size = int(str(data_path).rsplit(":", 1)[-1])   # "synthetic:<samples>"
        self.batch_size = batch_size

    def train_dataloader(self):
        # Lightning adds its DistributedSampler (shuffled, seeded): each rank reads its own share
        return DataLoader(Samples(self.size), batch_size=self.batch_size, shuffle=True)


def _manager(trainer):
    from hyperpodrun import CheckpointlessCallback
    return next(cb.checkpoint_manager for cb in trainer.callbacks if isinstance(cb, CheckpointlessCallback))


def _saved(rank: int) -> int:
    try:
        with open(os.path.join(OUT_DIR, f"progress.rank{rank}")) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return -1


class MyModel(pl.LightningModule):
    def __init__(self, cfg) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, cfg.width), nn.Tanh(), nn.Linear(cfg.width, cfg.width), nn.Tanh(),
                                 nn.Linear(cfg.width, 1))
        self.lr = cfg.lr

    def _rank(self) -> int:
        return int(os.environ["RANK"])

    def on_train_start(self) -> None:   # after the CheckpointlessCallback restored the state
        caller = self.trainer.wrapper
        with open(os.path.join(OUT_DIR, f"restores.rank{self._rank()}"), "a") as fh:
            fh.write(f"{caller.iteration} {self.trainer.global_step} {_manager(self.trainer).restored_from}\n")
        with open(os.path.join(OUT_DIR, f"pids.rank{self._rank()}"), "a") as fh:
            fh.write(f"{caller.iteration} {os.getpid()}\n")
        manager = _manager(self.trainer)   # the replica map the strategy gave it: where a lost state comes from
        with open(os.path.join(OUT_DIR, f"groups.rank{self._rank()}"), "w") as fh:
            fh.write(repr(manager._groups({}, int(os.environ["WORLD_SIZE"]))))

    def training_step(self, batch, batch_idx):
        fault = os.environ.get("NOTE_FAULT", "")
        step, rank = self.trainer.global_step, self._rank()
        if fault == f"{rank}:{step}" and self.trainer.wrapper.iteration == 0:
            world = int(os.environ["WORLD_SIZE"])
            end = time.monotonic() + 120
            while time.monotonic() < end and not all(_saved(r) >= step for r in range(world) if r != rank):
                time.sleep(0.005)
            shutil.rmtree(_manager(self.trainer).slot_dir(), ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:   # after the callback saved the step
        tmp = os.path.join(OUT_DIR, f"progress.rank{self._rank()}.tmp")
        with open(tmp, "w") as fh:
            fh.write(str(self.trainer.global_step))
        os.replace(tmp, os.path.join(OUT_DIR, f"progress.rank{self._rank()}"))

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0].state_dict()["state"]
        torch.save({"model": {k: v.detach().clone() for k, v in self.net.state_dict().items()},
                    "opt": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                            for k, s in opt.items()}},
                   os.path.join(OUT_DIR, f"rank{self._rank()}.pt"))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
