"""A Hugging Face Trainer job written the way a user writes it: HPWrapper(checkpoint_manager=cm), TrainingArguments
and a Trainer with CheckpointlessTrainerCallback built inside the wrapped function, `trainer.train()` unchanged.
A tiny Llama from a LlamaConfig (attention dropout on, so the RNG matters), synthetic tokens, DDP on gloo.

Runs the same under hyperpodrun --inprocess-restart, torchrun and plain python. Environment: STEPS (max_steps),
ACCUM (gradient accumulation), LOG_EVERY (logging_steps), SAVE_STEPS (HF disk checkpoints every N steps, 0 for
none; HF_DIR: their directory), RESUME (train(resume_from_checkpoint=HF_DIR/RESUME; `last`: the newest one, if
any), EARLY_ARGS=1 (TrainingArguments built at module level, which under --inprocess-restart must be refused),
FAULTS: a ';'-separated list
of `kind:rank:step:micro[:generation]` (kind kill|raise; fires in training_step of that micro-batch of the
optimizer step that starts at global_step `step`, or with step -1 after train() returned; default generation 0).

Writes to OUT_DIR: rank<r>.pt at the end (parameters, optimizer state, global_step, train_loss, log_history
without timings), batches<r>.txt (a line `step.micro digest generation` per micro-batch trained),
logs<r>.txt (a JSON line per on_log), faults.txt (one line per fault fired).
"""
import gc
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hyperpodrun import CheckpointManager, HPWrapper, wait_rank
from hyperpodrun.integrations.transformers import CheckpointlessTrainerCallback

wait_rank()   # a plain `python worker.py` gets a one-rank environment
STEPS = int(os.environ.get("STEPS", "8"))
ACCUM = int(os.environ.get("ACCUM", "1"))
LOG_EVERY = int(os.environ.get("LOG_EVERY", "1"))
SAVE_STEPS = int(os.environ.get("SAVE_STEPS", "0"))
OUT_DIR = os.environ["OUT_DIR"]
FAULTS = [f.split(":") for f in os.environ.get("FAULTS", "").split(";") if f]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCHES_PER_EPOCH = 5        # per rank: with ACCUM=2 the last optimizer step of an epoch has one micro-batch
cm = CheckpointManager()


def maybe_fault(step: int, micro: int, generation: int) -> None:
    for kind, frank, fstep, fmicro, *gen in FAULTS:
        if (int(frank), int(fstep), int(fmicro), int((gen or [0])[0])) == (RANK, step, micro, generation):
            with open(os.path.join(OUT_DIR, "faults.txt"), "a") as f:
                f.write(f"{RANK} {kind} {step} {micro} {generation}\n")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected {kind} at step {step}.{micro}")


class Tokens(Dataset):
    """Sample i: 16 tokens drawn from a generator seeded by i."""

    def __len__(self) -> int:
        return 2 * BATCHES_PER_EPOCH * WORLD

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids.clone()}


class FaultyTrainer(Trainer):
    """Records each micro-batch it trains on and fires the injected faults."""

    generation = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        self._micro = getattr(self, "_micro", {})
        micro = self._micro[step] = self._micro.get(step, -1) + 1
        digest = hashlib.sha1(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        with open(os.path.join(OUT_DIR, f"batches{RANK}.txt"), "a") as f:
            f.write(f"{step}.{micro} {digest} {self.generation}\n")
        maybe_fault(step, micro, self.generation)
        return super().training_step(model, inputs, num_items_in_batch)


class Record(TrainerCallback):
    def __init__(self, generation: int) -> None:
        self.generation = generation

    def on_train_begin(self, args, state, control, **kwargs):   # after the checkpointless callback's restore
        with open(os.path.join(OUT_DIR, f"restores.rank{RANK}"), "a") as f:
            f.write(f"{self.generation} {cm.restored_from}\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(os.path.join(OUT_DIR, f"logs{RANK}.txt"), "a") as f:
            f.write(json.dumps({"gen": self.generation, "step": state.global_step, "logs": logs}) + "\n")


def timeless(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}


def arguments() -> TrainingArguments:
    return TrainingArguments(
        output_dir=os.environ.get("HF_DIR") or os.path.join(OUT_DIR, "hf"), max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM, learning_rate=3e-3, warmup_steps=2, weight_decay=0.01,
        max_grad_norm=1.0, logging_steps=LOG_EVERY, save_strategy="steps" if SAVE_STEPS else "no",
        save_steps=SAVE_STEPS or 500, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, ddp_backend="gloo")


EARLY = arguments() if os.environ.get("EARLY_ARGS") == "1" else None


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


# MODEL_OUTSIDE=1: the model is built once, outside the re-executed function (the Trainer, its optimizer and
# DDP wrapper are made again in every generation)
OUTSIDE = build_model() if os.environ.get("MODEL_OUTSIDE") == "1" else None


@HPWrapper(checkpoint_manager=cm)
def main(caller=None):
    args = EARLY or arguments()
    model = OUTSIDE if OUTSIDE is not None else build_model()
    torch.manual_seed(0)
    checkpointless = CheckpointlessTrainerCallback(checkpoint_manager=cm)
    trainer = FaultyTrainer(model=model, args=args, train_dataset=Tokens(),
                            callbacks=[checkpointless, Record(caller.iteration)])
    trainer.generation = caller.iteration
    resume = os.environ.get("RESUME")
    if resume == "last":
        resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    elif resume:
        resume = os.path.join(args.output_dir, resume)
    out = trainer.train(resume_from_checkpoint=resume)
    maybe_fault(-1, 0, caller.iteration)   # step -1: after train() returned
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    torch.save({"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "opt": opt.state_dict(), "global_step": trainer.state.global_step, "train_loss": out.training_loss,
                "epoch": trainer.state.epoch, "log_history": [timeless(e) for e in trainer.state.log_history],
                "restored_step": checkpointless.restored_step, "transformers": transformers.__version__},
               os.path.join(OUT_DIR, f"rank{RANK}.pt"))
    del trainer, model, out, opt   # before the group goes: a gloo thread must not free a tensor at exit
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
