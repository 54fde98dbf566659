"""Where the state tier's time goes on one GPU, phase by phase, in one process (no launcher, no faults).

For a ~1 B-parameter model with fused AdamW (bf16 MLP or GPT-style decoder), measured in the same process:
  step        the training step alone (no CheckpointManager), median of --steps
  save/cert   a save() that only certifies the live state (the value fingerprint): host time in save(),
              device time of the fingerprint kernels (side stream)
  save/snap   a save() that snapshots: host time; the steady step with CheckpointManager() at its defaults
              (save() after every step) against the step without it, in alternating blocks
  restore     live (the objects kept), handed over (model and optimizer built again: the previous generation's
              tensors), from the own slot (DMA through the registered mapping), with restore_phases
  norms       torch._foreach_norm over the state's tensors, float64 vs float32 accumulation

Usage: python scripts/bench/gpu/gpu_state_paths.py --model gpt --out DIR   (CUDA required; --size tiny runs on CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build(model: str, size: str, device: str) -> tuple[nn.Module, torch.optim.Optimizer, callable]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model == "mlp":
        d, layers = (8192, 16) if size == "1b" else (64, 2)
        net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.GELU())]).to(device, dtype)
        batch = 64 if size == "1b" else 8

        def step_fn() -> torch.Tensor:
            x = torch.randn(batch, d, device=device, dtype=dtype)
            return net(x).float().pow(2).mean()
    else:
        d, layers, vocab, seq = (2048, 20, 32000, 1024) if size == "1b" else (64, 2, 128, 16)
        net = _Gpt(d, layers, vocab, seq).to(device, dtype)
        batch = 8 if size == "1b" else 2

        def step_fn() -> torch.Tensor:
            ids = torch.randint(0, vocab, (batch, seq), device=device)
            return F.cross_entropy(net(ids).float().view(-1, vocab), ids.view(-1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device == "cuda")
    return net, opt, step_fn


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = d // 128 if d >= 128 else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _Gpt(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.emb.weight.t()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
    ap.add_argument("--size", choices=("1b", "tiny"), default="1b")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size == "1b" and device != "cuda":
        sys.exit("gpu_state_paths.py: --size 1b needs CUDA; use --size tiny on a CPU")
    from hyperpodrun import CheckpointManager
    from hyperpodrun.state.fingerprint import Fingerprint
    net, opt, step_fn = build(args.model, args.size, device)
    nparams = sum(p.numel() for p in net.parameters())
    res: dict = {"model": args.model, "params": nparams, "device": torch.cuda.get_device_name() if device == "cuda"
                 else "cpu", "torch": torch.__version__}

    def train_step() -> float:
        t = time.perf_counter()
        loss = step_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        return time.perf_counter() - t

    for _ in range(3):
        train_step()
    # norms
    tensors = [p for p in net.parameters()] + [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    res["tensors"] = len(tensors)
    res["state_gb"] = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    for acc in (torch.float64, torch.float32):
        times = []
        for _ in range(5):
            sync()
            t = time.perf_counter()
            by: dict = {}
            for x in tensors:
                by.setdefault(x.dtype, []).append(x)
            for ts in by.values():
                torch._foreach_norm(ts, 2, dtype=acc)
            sync()
            times.append(time.perf_counter() - t)
        res[f"norms_{str(acc)[6:]}_ms"] = 1e3 * statistics.median(times)
    host = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        Fingerprint(tensors)
        host.append(time.perf_counter() - t)
        sync()
    res["fingerprint_launch_ms"] = 1e3 * statistics.median(host)
    # steady steps: plain vs CheckpointManager() with save() every step, alternating blocks
    cm = CheckpointManager()
    state = {"model": net, "opt": opt}
    plain, with_cm, save_host = [], [], []
    step = 0
    for block in range(4):
        for _ in range(args.steps // 4):
            plain.append(train_step())
        for _ in range(args.steps // 4):
            dt = train_step()
            t = time.perf_counter()
            step += 1
            cm.save(step, state)
            save_host.append(time.perf_counter() - t)
            with_cm.append(dt + save_host[-1])
    cm.wait()
    res["step_plain_s"] = statistics.median(plain)
    res["step_with_cm_s"] = statistics.median(with_cm)
    res["step_ratio"] = statistics.mean(with_cm) / statistics.mean(plain)
    res["save_host_ms_median"] = 1e3 * statistics.median(save_host)
    res["save_host_ms_max"] = 1e3 * max(save_host)
    res["snapshot_interval"] = cm.snapshot_interval
    res["retrain_bound"] = cm.retrain_bound
    # restores
    for how in ("live", "handed", "slot"):
        if how == "handed":
            net2, opt2, _ = build(args.model, args.size, device)
            st = {"model": net2, "opt": opt2}
        elif how == "slot":
            cm._live = None
            st = state
        else:
            st = state
        sync()
        t = time.perf_counter()
        got = cm.restore(st)
        sync()
        res[f"restore_{how}_s"] = time.perf_counter() - t
        res[f"restore_{how}_from"] = cm.restored_from
        res[f"restore_{how}_phases"] = dict(cm.restore_phases)
        res[f"restore_{how}_step"] = got
    cm.close()
    print(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"paths-{args.model}.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
