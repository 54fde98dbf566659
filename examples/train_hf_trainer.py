"""Checkpointless training with the Hugging Face Trainer: after a fault every rank resumes from memory.

    hyperpodrun --nproc-per-node 4 --inprocess-restart examples/train_hf_trainer.py --steps 200
    hyperpodrun inject --rank 2 --kind kill --step 120      # in another shell: SIGKILL rank 2 at step 120

A tiny Llama built from a LlamaConfig trains on synthetic tokens (nothing is downloaded). The surviving ranks
restart in-process, the killed rank is respawned, the wrapped function builds a new Trainer and
CheckpointlessTrainerCallback puts it back at the last committed optimizer step: same batches, same logged
losses, same final `train_loss` as a run without the fault (bitwise on CPU). `--save-steps N` adds HF's own
disk checkpoints, the tier used when memory has nothing (e.g. the whole job was started again):
`trainer.train(resume_from_checkpoint=...)` then reads the newest one, as usual.

The same script runs unchanged under torchrun and as a plain `python examples/train_hf_trainer.py`.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hyperpodrun import CheckpointManager, HPWrapper, wait_rank
from hyperpodrun.integrations.transformers import CheckpointlessTrainerCallback


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--output-dir", default="hf_trainer_out")
    p.add_argument("--save-steps", type=int, default=0, help="HF disk checkpoints every N steps (0: none)")
    p.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    return p.parse_args()


cli = parse()                 # our own flags may be parsed here; TrainingArguments must be built inside main()
cm = CheckpointManager()


class SyntheticTokens(Dataset):
    """Sample i: 32 tokens from a generator seeded by i (a stand-in for a tokenized corpus)."""

    def __init__(self, size: int, vocab: int) -> None:
        self.size, self.vocab = size, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


@HPWrapper(checkpoint_manager=cm)
def main(caller=None) -> None:
    # inside the wrapped function: TrainingArguments creates the process group (accelerate), which a restart
    # must create again
    args = TrainingArguments(
        output_dir=cli.output_dir, max_steps=cli.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=cli.accumulate, learning_rate=1e-3, warmup_steps=10, logging_steps=10,
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500, report_to=[],
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0, disable_tqdm=True)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(4096, config.vocab_size),
                      callbacks=[CheckpointlessTrainerCallback(checkpoint_manager=cm)])
    # the disk tier: used only when memory holds no committed step (the callback restores from memory first)
    last = get_last_checkpoint(cli.output_dir) if cli.save_steps and os.path.isdir(cli.output_dir) else None
    result = trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"generation {caller.iteration}: global step {result.global_step}, train_loss {result.training_loss:.5f}",
              flush=True)
    # release the model and the Trainer before the group: a gloo thread must not free a tensor while Python
    # exits (torch 2.13 can abort the process then)
    del trainer, model, result
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    wait_rank()
    main()
