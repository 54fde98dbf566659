"""What a standby's kernel warm-up saves a replacement rank, and what it costs, on one GPU.

    python3 scripts/bench/gpu/gpu_standby_warm.py --out DIR [--rounds 3] [--dim 8192 --layers 16 --batch 8192]
        [--variants cold,warm,eager]

Each round starts one fresh process per variant (in turn, so drift hits them alike). A process first does
what a standby does before a fault, then what the script it becomes does after one:
  cold   the CUDA context and a one-rank NCCL group (agent/zygote.warm_nccl): the standby before warm-up
  warm   the same, then agent/kernel_warm.warm() (in line here; a standby runs it in a thread once ready)
  eager  CUDA_MODULE_LOADING=EAGER: every kernel of every library loaded with the context (for comparison)
then, timed: the recovery benchmark's model built on the GPU (LAYERS x DIM^2 MLP, initialised on the device
in fp32, cast to bf16, Adam: what scripts/bench/workers/recovery_worker.py's top does before HPWrapper - the part of
death -> READY that is the script's), its first training step (forward, backward, Adam; it makes Adam's
state) and its second step (the steady state). Also per process, after its preparation: the GPU memory
NVML charges to it and torch's reserved memory, and its host RSS.

Writes DIR/standby-warm.json and .md (medians over rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path



def child(variant: str, dim: int, layers: int, batch: int) -> dict:
    """One process's measurements (run in the child)."""
    t0 = time.monotonic()
    import torch
    import torch._dynamo  # noqa: F401  (a standby's zygote imports it: HPWrapper does)
    import torch.nn as nn
    import hyperpodrun.runtime.wrapper  # noqa: F401  (hyperpodrun as installed: gpu.sh's PYTHONPATH)
    from hyperpodrun.agent.workers import kernel_warm, zygote
    out: dict = {"variant": variant, "import_s": round(time.monotonic() - t0, 3)}
    t = time.monotonic()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    out["context_s"] = round(time.monotonic() - t, 3)
    out["nccl_warm_s"] = zygote.warm_nccl(0)
    if variant == "warm":
        out.update(kernel_warm.warm(torch.device("cuda", 0)))
    out["reserved_mb"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    out["gpu_mb"] = round(nvml_used(os.getpid()) / 2**20, 1)
    with open(f"/proc/{os.getpid()}/status") as fh:
        out["rss_mb"] = next(round(int(line.split()[1]) / 1024, 1) for line in fh if line.startswith("VmRSS"))
    # the script's top: the model and optimizer, as recovery_worker.build_model makes them
    t = time.monotonic()
    torch.manual_seed(0)
    with torch.device("cuda"):
        mods: list = []
        for _ in range(layers):
            mods += [nn.Linear(dim, dim), nn.GELU()]
    model = nn.Sequential(*mods).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    out["build_s"] = round(time.monotonic() - t, 4)
    gen = torch.Generator(device="cuda")
    steps = []
    for step in range(3):
        t = time.monotonic()
        gen.manual_seed(1000 * step)
        x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        steps.append(round(time.monotonic() - t, 4))
    out["first_step_s"], out["second_step_s"], out["third_step_s"] = steps
    return out


def nvml_used(pid: int) -> int:
    """Bytes of GPU memory NVML charges to `pid` (0 where NVML cannot say)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return sum(int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                       if p.pid == pid)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--variants", default="cold,warm,eager")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.dim, a.layers, a.batch)))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for r in range(a.rounds):
        for v in a.variants.split(","):
            env = dict(os.environ)
            if v == "eager":
                env["CUDA_MODULE_LOADING"] = "EAGER"
            p = subprocess.run([sys.executable, __file__, "--out", a.out, "--child", v, "--dim", str(a.dim),
                                "--layers", str(a.layers), "--batch", str(a.batch)],
                               env=env, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                runs.append({"variant": v, "round": r, "error": p.stderr[-2000:]})
                continue
            runs.append({**json.loads(p.stdout.strip().splitlines()[-1]), "round": r})
            print(json.dumps(runs[-1]), flush=True)
    keys = ["context_s", "nccl_warm_s", "warm_s", "gpu_mb", "reserved_mb", "rss_mb", "build_s",
            "first_step_s", "second_step_s", "third_step_s"]
    med: dict = {}
    for v in a.variants.split(","):
        ok = [x for x in runs if x["variant"] == v and "error" not in x]
        med[v] = {k: statistics.median([x[k] for x in ok]) for k in keys if ok and all(k in x for x in ok)}
        med[v]["n"] = len(ok)
    (out / "standby-warm.json").write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs,
                                                       "medians": med}, indent=1))
    lines = ["| variant | n | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for v, m in med.items():
        lines.append(f"| {v} | {m['n']} | " + " | ".join(str(m.get(k, "-")) for k in keys) + " |")
    (out / "standby-warm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
