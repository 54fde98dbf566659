"""A Lightning job written the way the product note writes Tier 4: HPWrapper(checkpoint_manager=cm), a
Trainer with CheckpointlessCallback built inside the wrapped function, MMAPDataModule over a
LightningDataModule, DDP on gloo. SAMPLER=default: `DataLoader(shuffle=True)` and Lightning's own
DistributedSampler; DATA=drawn: a dataset drawn from the global RNG in train_dataloader() (Lightning's
RandomDataset style).

Deterministic: sample i is a function of i, the sampler is a ResumableSampler, fixed seeds. FAULTS is a
';'-separated list of `kind:rank:step:where[:generation]` (default generation 0; kind kill|raise; where:
top, in training_step | prestep, between backward and the optimizer step; step: trainer.global_step).
At the end each rank writes its parameters and optimizer state to OUT_DIR/rank<r>.pt; OUT_DIR/batches<r>.txt
has a line (batch number, digest, time, generation) for every batch trained on, OUT_DIR/faults.txt one per
fault fired.
The script's top reads no variable that names a rank (RANK is read when `main` is entered), so that a standby of
`--standby-prerun auto` runs it ahead - with MODEL_OUTSIDE=1 the LightningModule is built there. FAULT_GATE=path: a
due fault first waits until that file exists; PROCESS_LOG=path: the top appends `import <pid>` there, a SIGKILL
fault `kill <pid>` (tests/test_standby_prerun.py).
"""
import hashlib
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as pl
except ImportError:   # the older distribution name
    import pytorch_lightning as pl

from hyperpodrun import (CacheResumeMMAPConfig, CheckpointlessCallback, CheckpointManager, HPWrapper,
                         MMAPDataModule, ResumableSampler)

STEPS = int(os.environ.get("STEPS", "26"))
ACCUM = int(os.environ.get("ACCUM", "1"))
OUT_DIR = os.environ["OUT_DIR"]
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(";") if f]
RANK = -1   # read when main() is entered: a standby may run this top ahead, before it has a rank
PROCESS_LOG = os.environ.get("PROCESS_LOG")


def _process_log(line: str) -> None:
    if PROCESS_LOG:
        with open(PROCESS_LOG, "a") as fh:
            fh.write(line + "\n")


_process_log(f"import {os.getpid()}")
ACCEL = os.environ.get("ACCEL", "cpu")   # cpu (gloo) or gpu (NCCL)
SAMPLER = os.environ.get("SAMPLER", "resumable")   # resumable (ResumableSampler) | default (shuffle=True)
DATA = os.environ.get("DATA", "numbers")   # numbers (sample i from seed i) | drawn (from the global RNG)
cm = CheckpointManager(enable_checksum=os.environ.get("CHECKSUM") == "1",
                       enable_offload=os.environ.get("OFFLOAD") == "1")


def maybe_fault(where: str, step: int, generation: int) -> None:
    for kind, frank, fstep, fwhere, *gen in FAULTS:
        if fwhere == where and int(frank) == RANK and int(fstep) == step and generation == int((gen or [0])[0]):
            if os.environ.get("FAULT_AFTER_PEERS_SAVED") == "1":
                # every other rank has saved the step this one is in (a prestep raise: the gradients were
                # all-reduced, so the others complete it): else the restart may catch a peer between its optimizer
                # step and that save, and the job rightly restores the step before - a timing, not the case tested
                target, world = step + (where == "prestep"), int(os.environ["WORLD_SIZE"])
                end = time.monotonic() + 120
                while time.monotonic() < end and not all(_progress(r) >= target for r in range(world) if r != RANK):
                    time.sleep(0.002)
            gate = os.environ.get("FAULT_GATE")   # a file the test creates when the fault may fire
            end = time.monotonic() + 120
            while gate and not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.02)
            with open(os.path.join(OUT_DIR, "faults.txt"), "a") as f:
                f.write(f"{RANK} {kind} {step} {time.time()}\n")
            if kind == "kill":
                _process_log(f"kill {os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected {kind} at step {step} ({where})")


def _progress(rank: int) -> int:
    """The last step rank `rank` saved, as its progress file says, or -1."""
    try:
        with open(os.path.join(OUT_DIR, f"progress.rank{rank}")) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


class Numbers(Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        return x, torch.tanh(x[:4].sum(dim=0, keepdim=True))


class Drawn(Dataset):
    """Like Lightning's demo RandomDataset: the samples are drawn from the global RNG when it is made."""

    def __init__(self) -> None:
        self.x = torch.randn(256, 16)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        return x, torch.tanh(x[:4].sum(dim=0, keepdim=True))


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        world = int(os.environ["WORLD_SIZE"])
        data = Drawn() if DATA == "drawn" else Numbers()
        if SAMPLER == "default":   # what most scripts write: Lightning adds its DistributedSampler
            return DataLoader(data, batch_size=8, shuffle=True)
        return DataLoader(data, batch_size=8, sampler=ResumableSampler(data, seed=3, num_replicas=world, rank=RANK))


class Net(pl.LightningModule):
    def __init__(self, generation: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        width, depth = int(os.environ.get("WIDTH", "64")), int(os.environ.get("DEPTH", "0"))
        blocks = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
        self.net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), *blocks, nn.Dropout(0.1), nn.Linear(width, 1))
        self.generation = generation

    def training_step(self, batch, batch_idx):
        x, y = batch
        seen = self.trainer.fit_loop.total_batch_idx
        with open(os.path.join(OUT_DIR, f"batches{RANK}.txt"), "a") as f:
            digest = hashlib.sha1(x.cpu().numpy().tobytes() + y.cpu().numpy().tobytes()).hexdigest()
            f.write(f"{seen} {digest} {time.time():.6f} {self.generation}\n")
        maybe_fault("top", self.trainer.global_step, self.generation)
        return F.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        maybe_fault("prestep", self.trainer.global_step, self.generation)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:   # after the callback's save() of the step
        tmp = os.path.join(OUT_DIR, f"progress.rank{RANK}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{self.trainer.global_step}\n")
        os.replace(tmp, os.path.join(OUT_DIR, f"progress.rank{RANK}"))

    def on_train_start(self) -> None:   # after the callback's restore: how this rank got its state
        with open(os.path.join(OUT_DIR, f"restores.rank{RANK}"), "a") as f:
            f.write(f"{self.generation} {cm.restored_from}\n")

    def cpu(self):   # Lightning's teardown moves the module to host memory with this: which generations did
        with open(os.path.join(OUT_DIR, f"cpu_calls.rank{RANK}"), "a") as f:
            f.write(f"{self.generation}\n")
        return super().cpu()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# MODEL_OUTSIDE=1: the LightningModule is built once, outside the re-executed function (the Trainer, its DDP
# wrapper and the optimizers are made again in every generation)
OUTSIDE = Net(0) if os.environ.get("MODEL_OUTSIDE") == "1" else None


@HPWrapper(checkpoint_manager=cm)
def main(caller=None):
    global RANK
    RANK = int(os.environ["RANK"])
    trainer = pl.Trainer(accelerator=ACCEL, strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                         max_steps=STEPS, accumulate_grad_batches=ACCUM, deterministic=ACCEL == "cpu",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=SAMPLER == "default",
                         callbacks=[CheckpointlessCallback(checkpoint_manager=cm)])
    trainer.wrapper = caller
    data = MMAPDataModule(data_module=Data(), mmap_config=CacheResumeMMAPConfig(
        cache_dir=os.environ["CACHE_DIR"], prefetch_length=4, lookback_length=2))
    model = OUTSIDE if OUTSIDE is not None else Net(caller.iteration)
    model.generation = caller.iteration
    trainer.fit(model, data)
    opt = trainer.optimizers[0]
    torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "opt": opt.state_dict(), "global_step": trainer.global_step, "epoch": trainer.current_epoch},
               os.path.join(OUT_DIR, f"rank{RANK}.pt"))


if __name__ == "__main__":
    main()
