"""The training script of the framework benchmark (scripts/bench/frameworks.py): one Llama-style causal LM trained
through Lightning or the Hugging Face Trainer, written four ways (--row), so that the only difference between the
rows of its table is how the script is written.

  none      `hyperpodrun --inprocess-restart`, HPWrapper only: the module built once outside the wrapped function,
            no CheckpointManager and no callback (every generation trains from step 0 again).
  outside   CheckpointManager() and the framework's callback (CheckpointlessCallback / CheckpointlessTrainerCallback,
            default arguments: a save() after every optimizer step); the module built once outside the function,
            the Trainer inside it (docs/integrations.md's fastest pattern).
  inside    the same, with the module built inside the function on every entry (the README's and the product
            note's pattern): its construction is paid again on every re-entry.
  torchrun  plain torchrun with `--max-restarts`; the framework's own disk checkpoints every --ckpt-every steps
            (Lightning's ModelCheckpoint with save_last and `fit(ckpt_path="last")`; HF's save_steps and
            `train(resume_from_checkpoint=...)`); after a fault every worker starts again from the newest one.

The model (--size): `0.6b` a LlamaForCausalLM from a config (vocab 32000, hidden 1536, MLP 4096, 20 layers, 12
heads, 1024 tokens, untied head: 0.66 B parameters), fp32 weights with bf16 autocast (Lightning
`precision="bf16-mixed"`, HF `bf16=True`), fused AdamW, batch 8 x 1024 tokens; `tiny` a 2-layer model of hidden 32
in fp32 on the CPU (gloo). The data: synthetic token rows (row i drawn from a generator seeded with i) through a
DataLoader with --loader-workers worker processes. Built on the CPU and moved by the framework, as a user's script
does.

Faults (--kind raise|kill|none, --faults K) as scripts/bench/workers/state_tier_worker.py places them: generation
g < K gets one, in rank g % world, between backward and the optimizer step (Lightning's
on_before_optimizer_step, HF's on_pre_optimizer_step), once the generation has completed --fault-every + g % 3
steps (plus --warmup in generation 0) and --fault-gap seconds have passed since its first step; with --gate a due
SIGKILL also waits for OUT/gate.json. Generation K trains --tail steps and stops.

Records: the same JSON lines as state_tier_worker.py (top, built, enter, entry, step, fault, end) in
OUT/rank<r>.jsonl, so that state_tier.py's analysis reads them; `entry` is written when the framework starts
training (after the callback's restore), `step` after the step's save() with the compute stream synchronised;
also `exc` (the framework's on_exception hook, Lightning only) and `built` per construction (`s`: seconds).

The script's top reads no variable that names a rank (RANK, WORLD_SIZE, ...; LOCAL_RANK, which a standby of that
local rank has, is read), so that a standby of `--standby-prerun auto` runs it ahead to the wrapped function -
imports, the module of the `none` and `outside` rows - before a SIGKILL: the rank is read when the function is
entered (`enter_rank`), and the records of the top (`top`, `built`) wait in memory until then.
"""
import os
import time

T_TOP = time.time()
import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

# the frameworks at the top, as scripts import them (the launcher's zygote imports these ahead for a respawn)
import lightning.pytorch as pl  # noqa: E402
import transformers  # noqa: E402,F401
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

# the runtime's restore line (where each rank's state came from, and why it was not kept live) in the rank's log
import logging  # noqa: E402
_restore_log = logging.StreamHandler(sys.stderr)
_restore_log.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
logging.getLogger("hyperpodrun.runtime").addHandler(_restore_log)
logging.getLogger("hyperpodrun.runtime").setLevel(logging.INFO)

LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))   # a standby's too: it only ever becomes a rank of its slot
RANK: Optional[int] = None   # read when the training function is entered (enter_rank), not at the top
WORLD = 1
GENERATION_ENV = "TORCHELASTIC_RESTART_COUNT"
SIZES = {
    "tiny": {"vocab": 64, "hidden": 32, "mlp": 64, "layers": 2, "heads": 2, "seq": 16, "batch": 4},
    "0.6b": {"vocab": 32000, "hidden": 1536, "mlp": 4096, "layers": 20, "heads": 12, "seq": 1024, "batch": 8},
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="framework_worker.py")
    p.add_argument("--framework", choices=("lightning", "hf"), required=True)
    p.add_argument("--row", choices=("none", "outside", "inside", "torchrun"), required=True)
    p.add_argument("--size", choices=tuple(SIZES), required=True)
    p.add_argument("--kind", choices=("raise", "kill", "none"), required=True)
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--fault-every", type=int, default=8)
    p.add_argument("--fault-gap", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--tail", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--build", choices=("cpu", "device"), default="cpu",
                   help="where the module is made: on the host (then moved by the framework) or on the GPU")
    p.add_argument("--gate", action="store_true")
    p.add_argument("--arm-timeout", type=float, default=30.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.kind == "none":
        a.faults = 0
    return a


ARGS = parse()
_FH: Any = None
_EARLY: list[dict[str, Any]] = []   # records of the top, until the rank is known


def enter_rank() -> None:
    """The rank is known now (the training function is entered, or torchrun's worker starts): read it and write
    the records of the script's top to its file."""
    global RANK, WORLD
    if RANK is None:
        RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        for rec in _EARLY:
            _write(dict(rec, rank=RANK))
        _EARLY.clear()


def note(ev: str, **fields: Any) -> None:
    rec = {"ev": ev, "rank": RANK, "pid": os.getpid(), "t": time.time(), **fields}
    if RANK is None:
        _EARLY.append(rec)
    else:
        _write(rec)


def _write(rec: dict[str, Any]) -> None:
    global _FH
    if _FH is None:
        _FH = open(os.path.join(ARGS.out, f"rank{RANK}.jsonl"), "a", buffering=1)
    _FH.write(json.dumps(rec) + "\n")
    _FH.flush()


CUDA = ARGS.size != "tiny"
S = SIZES[ARGS.size]


class Tokens(Dataset):
    """Row i: seq + 1 tokens from a generator seeded with i."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, S["vocab"], (S["seq"] + 1,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def build_llama() -> torch.nn.Module:
    t0 = time.time()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["mlp"],
                         num_hidden_layers=S["layers"], num_attention_heads=S["heads"],
                         num_key_value_heads=S["heads"], max_position_embeddings=S["seq"], tie_word_embeddings=False,
                         attn_implementation="sdpa")
    if ARGS.build == "device" and CUDA:   # made on the GPU: no host init, no copy (the fastest pattern)
        with torch.device("cuda", LOCAL_RANK):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    note("built", s=round(time.time() - t0, 3), params=sum(p.numel() for p in model.parameters()))
    return model


def sync() -> None:
    if CUDA:
        torch.cuda.current_stream().synchronize()


class Faults:
    """The fault schedule of one generation (see the module doc)."""

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.faulting = gen < ARGS.faults
        self.first = ARGS.warmup if gen == 0 else 0
        self.victim = self.faulting and RANK == gen % WORLD
        self.done = 0
        self.t_first: Optional[float] = None
        self.t_due: Optional[float] = None

    def stepped(self) -> bool:
        """A step completed; True when this (last) generation has trained its --tail steps."""
        self.done += 1
        if self.t_first is None:
            self.t_first = time.time()
        return not self.faulting and self.done >= self.first + ARGS.tail

    def before_optimizer_step(self, step: int) -> None:
        if not self.victim or self.done < self.first + ARGS.fault_every + self.gen % 3 or self.t_first is None:
            return
        if time.time() - self.t_first < ARGS.fault_gap:
            return
        self.t_due = self.t_due or time.time()
        ready = armed()
        if not ready and time.time() - self.t_due < ARGS.arm_timeout:
            return
        sync()
        note("fault", gen=self.gen, step=step, kind=ARGS.kind, armed=ready,
             armed_wait_s=round(time.time() - self.t_due, 3))
        if ARGS.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        raise RuntimeError(f"frameworks: injected fault in generation {self.gen} at step {step}")


def armed() -> bool:
    if not ARGS.gate:
        return True
    try:
        with open(os.path.join(ARGS.out, "gate.json")) as fh:
            gate = json.load(fh)
    except (OSError, ValueError):
        return False
    return bool(gate.get("warm")) and gate.get("available", 0) >= gate.get("wanted", 0)


def entry(gen: int, start: int, cm: Any) -> None:
    sync()
    note("entry", gen=gen, start=start, restored_from=cm.restored_from if cm is not None else None,
         restore_phases=dict(cm.restore_phases) if cm is not None else None)


# ------------------------------------------------------------------------------------------ Lightning
def lightning_job(gen: int, cm: Any, module: Optional[Any], caller: Any) -> None:
    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Tokens(), batch_size=S["batch"], shuffle=True, num_workers=ARGS.loader_workers)

    faults = Faults(gen)

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if cm is None and caller is not None:   # the callback reports progress; without it, the script does
                caller.progress(trainer.global_step)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            entry(gen, trainer.global_step, cm)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            faults.before_optimizer_step(trainer.global_step)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            sync()
            note("step", gen=gen, step=trainer.global_step)
            if faults.stepped():
                trainer.should_stop = True

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            note("exc", gen=gen)

    lit = module if module is not None else lightning_module(build_llama())
    callbacks: list = [Record()]
    ckpt_path = None
    if cm is not None:
        from hyperpodrun import CheckpointlessCallback
        callbacks.insert(0, CheckpointlessCallback(checkpoint_manager=cm))
    if ARGS.row == "torchrun":
        from lightning.pytorch.callbacks import ModelCheckpoint
        ckdir = os.path.join(ARGS.out, "ckpt")
        callbacks.insert(0, ModelCheckpoint(dirpath=ckdir, every_n_train_steps=ARGS.ckpt_every, save_last=True))
        ckpt_path = "last" if os.path.exists(os.path.join(ckdir, "last.ckpt")) else None
    trainer = pl.Trainer(accelerator="gpu" if CUDA else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         num_nodes=WORLD // int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         precision="bf16-mixed" if CUDA else "32-true", max_steps=10 ** 6, logger=False,
                         enable_checkpointing=ARGS.row == "torchrun", enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    if caller is not None:
        trainer.wrapper = caller
    trainer.fit(lit, Data(), ckpt_path=ckpt_path)
    note("end", gen=gen, step=trainer.global_step)


# ------------------------------------------------------------------------------------------ Hugging Face
def hf_job(gen: int, cm: Any, model: Optional[torch.nn.Module], caller: Any) -> None:
    from transformers.trainer_utils import get_last_checkpoint
    faults = Faults(gen)

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cm is None and caller is not None:
                caller.progress(state.global_step)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            entry(gen, state.global_step, cm)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            faults.before_optimizer_step(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            note("step", gen=gen, step=state.global_step)
            if faults.stepped():
                control.should_training_stop = True

    outdir = os.path.join(ARGS.out, "hf")
    torchrun = ARGS.row == "torchrun"
    args = TrainingArguments(output_dir=outdir, max_steps=10 ** 6, per_device_train_batch_size=S["batch"],
                             learning_rate=1e-4, lr_scheduler_type="constant", optim="adamw_torch_fused" if CUDA
                             else "adamw_torch", bf16=CUDA, use_cpu=not CUDA, logging_steps=10 ** 6,
                             save_strategy="steps" if torchrun else "no", save_steps=ARGS.ckpt_every,
                             report_to=[], dataloader_num_workers=ARGS.loader_workers, seed=0, disable_tqdm=True)
    callbacks: list = [Record()]
    if cm is not None:
        from hyperpodrun.integrations.transformers import CheckpointlessTrainerCallback
        callbacks.insert(0, CheckpointlessTrainerCallback(checkpoint_manager=cm))
    model = model if model is not None else build_llama()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    last = get_last_checkpoint(outdir) if torchrun and os.path.isdir(outdir) else None
    trainer.train(resume_from_checkpoint=last)
    note("end", gen=gen, step=trainer.state.global_step)
    del trainer


# ------------------------------------------------------------------------------------------ rows
def release() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()


def hyperpodrun_rows() -> None:
    from hyperpodrun import CheckpointManager, HPWrapper, wait_rank
    if CUDA:
        torch.cuda.set_device(LOCAL_RANK)
    cm: Any = CheckpointManager() if ARGS.row != "none" else None
    kept: Any = None
    if ARGS.row in ("none", "outside"):
        kept = build_llama()
        if ARGS.framework == "lightning":
            kept = lightning_module(kept)

    @HPWrapper(checkpoint_manager=cm)
    def main(caller: Any = None) -> None:
        wait_rank()   # here, not at the top: a standby runs the top ahead, before it has a rank
        enter_rank()
        gen = caller.iteration
        train_once(gen, cm, kept, caller)

    main()


def train_once(gen: int, cm: Any, kept: Any, caller: Any) -> None:
    """One generation: the framework's training from `kept` (or a module built now), then the group released."""
    note("enter", gen=gen)
    if ARGS.framework == "lightning":
        lightning_job(gen, cm, kept, caller)
    else:
        hf_job(gen, cm, kept, caller)
    release()


def lightning_module(model: torch.nn.Module) -> Any:
    """`model` in the job's LightningModule (the loss is the model's own; fused AdamW on the GPU)."""

    class Lit(pl.LightningModule):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.model = m

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True if CUDA else None)
    return Lit(model)


def torchrun_row() -> None:
    enter_rank()
    gen = int(os.environ.get(GENERATION_ENV, "0"))
    if CUDA:
        torch.cuda.set_device(LOCAL_RANK)
    train_once(gen, None, None, None)


if __name__ == "__main__":
    os.makedirs(ARGS.out, exist_ok=True)
    note("top", t_top=T_TOP)
    if ARGS.row == "torchrun":
        torchrun_row()
    else:
        hyperpodrun_rows()
    sys.exit(0)
