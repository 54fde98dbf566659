"""The steady cost of `save()` after every step under the default overhead budget, on a GPU, in one process.

    python3 scripts/bench/gpu/gpu_snapshot_budget.py --out DIR --model mlp|gpt [--rounds 3] [--steps 40]
        [--configs none,default,normalprio,fixed8] [--size 1b|tiny] [--device cuda|cpu]

The script is written the way the README writes one: `CheckpointManager()` with its defaults, the model and a
fused AdamW built once, `cm.save(step + 1, state)` right after every `optimizer.step()`, and the loop waits for
the compute stream at the end of each step (as a loop that logs `loss.item()` does). Configurations:
  none        the same loop without a CheckpointManager (the baseline)
  default     CheckpointManager() - what the budget (max_overhead=0.02) makes of a save() every step
  normalprio  the same, with the checksum helpers that sum a snapshot beside the training at normal CPU
              priority instead of the idle class (what that choice buys)
  default-t<n>  default with at most n checksum threads (1: the writer thread sums the slot alone, at seal)
  fixed<k>    CheckpointManager(max_overhead=None), save() every k-th step: every call snapshots (each waits
              for the one before), so the per-snapshot cost is seen without the budget
Each configuration keeps one CheckpointManager for the whole run (as a job does: the budget's measurements
carry over), and they run in rounds of --steps measured steps each (after --warmup steps, in round 1 only),
alternating, so drift of the machine hits each alike. Per block: every step's time, the snapshots sealed, the
interval and the bound on retrained steps the budget reports. At the end the newest slot of `default` is read
back and compared bitwise with the live state (a snapshot forced at the last step).

Models (bench_models.py): `mlp` 16 x Linear(8192, 8192) + GELU, batch 8192 (1.07 B); `gpt` d 2048, 20 layers,
16 heads, 8 x 1024 tokens, vocab 32768 (1.08 B); bf16, fused AdamW (6.4-6.5 GB of state). `--size tiny
--device cpu` is a smoke test of the script. Writes DIR/snapshot-budget-<model>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                     # gpu_snapshot_overhead
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))           # bench_models
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))   # hyperpodrun

from bench_models import GPT, mlp  # noqa: E402
from gpu_snapshot_overhead import check_slot  # noqa: E402

from hyperpodrun import CheckpointManager  # noqa: E402
from hyperpodrun.state.slots import slot_checksum  # noqa: E402

SIZES = {("mlp", "1b"): {"dim": 8192, "layers": 16, "batch": 8192},
         ("gpt", "1b"): {"vocab": 32768, "dim": 2048, "layers": 20, "heads": 16, "seq": 1024, "batch": 8},
         ("mlp", "tiny"): {"dim": 32, "layers": 2, "batch": 16},
         ("gpt", "tiny"): {"vocab": 64, "dim": 16, "layers": 2, "heads": 2, "seq": 8, "batch": 4}}


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = torch.device(args.device)
        self.s = SIZES[(args.model, args.size)]
        torch.manual_seed(0)
        with self.dev:
            if args.model == "mlp":
                self.model = mlp(self.s["dim"], self.s["layers"])
            else:
                self.model = GPT(self.s["vocab"], self.s["dim"], self.s["layers"], self.s["heads"], self.s["seq"])
        cuda = self.dev.type == "cuda"
        if cuda:
            self.model = self.model.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True if cuda else None)
        self.step = 0

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.parameters()) * 3

    def one_step(self, save: Any) -> None:
        s, dev = self.s, self.dev
        g = torch.Generator(device=dev).manual_seed(self.step)
        if self.args.model == "mlp":
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            loss = self.model(torch.randn(s["batch"], s["dim"], generator=g, device=dev, dtype=dtype)).float().pow(2).mean()
        else:
            tok = torch.randint(s["vocab"], (s["batch"], s["seq"] + 1), generator=g, device=dev)
            logits = self.model(tok[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, s["vocab"]).float(), tok[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        if save is not None:
            save(self.step)
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()


def make_cm(name: str, base: str) -> tuple[Optional[CheckpointManager], int]:
    if name == "none":
        return None, 0
    shm = os.path.join(base, name)
    os.makedirs(shm, mode=0o700)
    if name.startswith("fixed"):
        return CheckpointManager(max_overhead=None, shm_dir=shm), int(name.removeprefix("fixed"))
    return CheckpointManager(shm_dir=shm), 1


def block(job: Job, name: str, cm: Optional[CheckpointManager], every: int, steps: int) -> dict:
    state = {"model": job.model, "opt": job.opt}
    if cm is not None:
        cm._budget.restarted()      # the time the other configurations ran is no step of this one
    normal, threads = slot_checksum._BACKGROUND, slot_checksum.MAX_THREADS
    if name == "normalprio":
        slot_checksum._BACKGROUND = NORMAL_POOL
    if "-t" in name:
        slot_checksum.MAX_THREADS = int(name.split("-t")[1])
    sealed, seen = [], cm.last_saved if cm is not None else None

    def save(step: int) -> None:
        nonlocal seen
        if cm is not None and step % every == 0:
            cm.save(step, state)
            if cm.last_saved != seen:
                seen = cm.last_saved
                sealed.append(seen)

    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            job.one_step(save)
            times.append(time.perf_counter() - t0)
    finally:
        slot_checksum._BACKGROUND, slot_checksum.MAX_THREADS = normal, threads
    out: dict[str, Any] = {"name": name, "mean_step_s": statistics.fmean(times), "median_step_s": statistics.median(times),
                           "step_s": times, "sealed_seen": sealed}
    if cm is not None:
        b = cm._budget
        out.update(interval=cm.snapshot_interval, retrain_bound=cm.retrain_bound, last_saved=cm.last_saved,
                   budget={k: getattr(b, k) for k in ("step_s", "snapshot_s", "certify_s", "call_s", "mean_in_flight",
                                                      "in_flight_steps")})
    return out


NORMAL_POOL = slot_checksum._Helpers(idle=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    ap.add_argument("--size", choices=("1b", "tiny"), default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--configs", default="none,default,normalprio,fixed8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    names = args.configs.split(",")
    if "none" not in names:
        names.insert(0, "none")
    job = Job(args)
    base = f"/dev/shm/hpr-budget-{os.getpid()}"
    os.makedirs(base, mode=0o700)
    rounds: list[dict[str, dict]] = []
    cms: dict[str, tuple[Optional[CheckpointManager], int]] = {}
    checked: Optional[bool] = None
    try:
        for name in names:
            cms[name] = make_cm(name, base)
            block(job, name, *cms[name], args.warmup)      # warm-up: kernels, slots mapped, the budget's first figures
        for r in range(args.rounds):
            res = {}
            for name in names:
                res[name] = block(job, name, *cms[name], args.steps)
                print(json.dumps({"round": r, **{k: v for k, v in res[name].items() if k != "step_s"}}), flush=True)
            rounds.append(res)
        cm = cms.get("default", (None, 0))[0]
        if cm is not None and args.device == "cuda":
            state = {"model": job.model, "opt": job.opt}
            cm._save(job.step, state, force=True)
            check_slot(cm, job.step, state)
            checked = True
    finally:
        for cm, _every in cms.values():
            if cm is not None:
                cm.close(success=False)
        shutil.rmtree(base, ignore_errors=True)
    summary = []
    for name in names:
        means = [rd[name]["mean_step_s"] for rd in rounds]
        ratios = [rd[name]["mean_step_s"] / rd["none"]["mean_step_s"] for rd in rounds]
        last = rounds[-1][name]
        summary.append({"name": name, "mean_step_s_median": statistics.median(means),
                        "ratio_median": statistics.median(ratios), "ratios": ratios,
                        "sealed_per_round": [len(rd[name]["sealed_seen"]) for rd in rounds],
                        "interval": last.get("interval"), "retrain_bound": last.get("retrain_bound")})
    doc = {"model": args.model, "size": args.size, "state_bytes": job.state_bytes(), "steps_per_block": args.steps,
           "rounds": rounds, "summary": summary, "slot_checked_bitwise": checked,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    with open(os.path.join(args.out, f"snapshot-budget-{args.model}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    lines = [f"{args.model}: state {job.state_bytes() / 1e9:.2f} GB, {args.rounds} rounds x {args.steps} steps, "
             f"slot == live state: {checked}", "",
             "| configuration | mean step (s), median of rounds | vs none (median; each round) | snapshots sealed per round | interval | retrain bound |",
             "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['name']} | {s['mean_step_s_median']:.4f} | {s['ratio_median']:.3f}x "
                     f"({', '.join(f'{x:.3f}' for x in s['ratios'])}) | {s['sealed_per_round']} | "
                     f"{s['interval'] if s['interval'] is not None else '-'} | "
                     f"{s['retrain_bound'] if s['retrain_bound'] is not None else '-'} |")
    with open(os.path.join(args.out, f"snapshot-budget-{args.model}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
