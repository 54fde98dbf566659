"""Where a replacement's first step goes: one fresh process per configuration plays a rank that took over
after a SIGKILL (its CUDA context made, as a standby's is), then times, phase by phase with the compute
stream synchronised between phases, what the state-tier benchmark's script does next (the same models:
scripts/bench/bench_models.py at 1 B parameters, bf16, fused AdamW):

  build    model and optimizer made on the device (the script's top)
  group    init_process_group("nccl", device_id=...) for one rank (an eager communicator)
  ddp      DistributedDataParallel(model) (its construction broadcast)
  step 1   forward / backward / optimizer.step(), each synchronised; then steps 2-6 the same way

Configurations (--configs), each in its own process, --repeats times, interleaved, all in one invocation:
  cold       nothing ahead but the CUDA context
  warm       the standby's kernel warm-up first (agent/workers/kernel_warm.py), as a standby does
  reserve    warm, and the caching allocator holding ahead as much memory as the first step will ask for
             (a block of --reserve-gb allocated and freed before the fault: what a standby could do if it
             reserved its rank's footprint)
  nccl       warm, and NCCL's process-wide initialisation done ahead (a unique id asked for)

Why: the replacement's first step was measured at 0.41 s against a 0.12 s steady step (BENCHMARKS.md, the
state tier's SIGKILL rows), and the cause was guessed (cold kernels, attention plans); this names it.

    source scripts/bench/gpu_env.sh; python3 scripts/bench/gpu/gpu_first_step.py --models mlp,gpt --repeats 2 --json OUT/first_step.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

SIZES = {"mlp": {"dim": 8192, "layers": 16, "batch": 8192},
         "gpt": {"vocab": 32768, "dim": 2048, "layers": 20, "heads": 16, "seq": 1024, "batch": 8}}


def child(model_name: str, config: str, reserve_gb: float) -> dict[str, Any]:
    t_top = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, str(HERE.parent))
    from bench_models import GPT, mlp
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"model": model_name, "config": config, "context_s": time.perf_counter() - t_top}
    if config in ("warm", "reserve", "nccl"):
        from hyperpodrun.agent.workers.kernel_warm import warm
        t = time.perf_counter()
        out["warm"] = {k: v for k, v in warm(dev).items() if k != "skipped"}
        out["warm_s"] = time.perf_counter() - t
    if config == "reserve":
        block = torch.empty(int(reserve_gb * 2**30), dtype=torch.uint8, device=dev)
        del block   # back to the caching allocator, which keeps it reserved
    if config == "nccl":
        torch.cuda.nccl.unique_id()
    phases: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        phases[name] = time.perf_counter() - t
        return r

    s = SIZES[model_name]

    def build() -> Any:
        torch.manual_seed(0)
        with dev:
            m = mlp(s["dim"], s["layers"]) if model_name == "mlp" else \
                GPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
        m = m.to(torch.bfloat16)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    model, opt = timed("build", build)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    timed("group", lambda: dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev))
    net = timed("ddp", lambda: torch.nn.parallel.DistributedDataParallel(model, device_ids=[0]))
    before = torch.cuda.memory_stats()
    for step in range(1, 7):
        g = torch.Generator(device=dev).manual_seed(step)

        def forward() -> Any:
            if model_name == "mlp":
                x = torch.randn(s["batch"], s["dim"], generator=g, device=dev, dtype=torch.bfloat16)
                return net(x).float().pow(2).mean()
            tok = torch.randint(s["vocab"], (s["batch"], s["seq"] + 1), generator=g, device=dev)
            return F.cross_entropy(net(tok[:, :-1]).reshape(-1, s["vocab"]).float(), tok[:, 1:].reshape(-1))

        opt.zero_grad(set_to_none=True)
        loss = timed(f"s{step}.fwd", forward)
        timed(f"s{step}.bwd", loss.backward)
        timed(f"s{step}.opt", opt.step)
        if step == 1:
            after = torch.cuda.memory_stats()
            out["step1_segments"] = after.get("segment.all.allocated", 0) - before.get("segment.all.allocated", 0)
            out["step1_reserved_gb"] = (after.get("reserved_bytes.all.current", 0)
                                        - before.get("reserved_bytes.all.current", 0)) / 2**30
    out["phases"] = phases
    out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    for step in range(1, 7):
        phases[f"s{step}"] = sum(phases[f"s{step}.{p}"] for p in ("fwd", "bwd", "opt"))
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--configs", default="cold,warm,reserve,nccl")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--reserve-gb", type=float, default=16.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], a.reserve_gb)), flush=True)
        return 0
    results: list[dict[str, Any]] = []
    env = dict(os.environ)   # hyperpodrun importable as installed (scripts/bench/gpu_env.sh)
    for model in a.models.split(","):
        for _ in range(a.repeats):
            for config in a.configs.split(","):
                p = subprocess.run([sys.executable, __file__, "--child", model, config, "--reserve-gb",
                                    str(a.reserve_gb)], capture_output=True, text=True, env=env, timeout=300)
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"{model} {config}: failed rc={p.returncode}\n{p.stderr[-2000:]}", flush=True)
                    continue
                r = json.loads(line[7:])
                results.append(r)
                ph = r["phases"]
                print(f"{model:4s} {config:8s} build {ph['build']:.3f} group {ph['group']:.3f} ddp {ph['ddp']:.3f} "
                      f"step1 {ph['s1']:.3f} (fwd {ph['s1.fwd']:.3f} bwd {ph['s1.bwd']:.3f} opt {ph['s1.opt']:.3f}) "
                      f"step2 {ph['s2']:.3f} steady(3-6) {statistics.median(ph[f's{i}'] for i in range(3, 7)):.3f} "
                      f"step1 new segments {r.get('step1_segments')} ({r.get('step1_reserved_gb', 0):.1f} GiB) "
                      f"peak {r['peak_reserved_gb']:.1f} GiB warm {r.get('warm_s', 0):.1f}s", flush=True)
    print("\nmedians per model and configuration (seconds):")
    for model in a.models.split(","):
        for config in a.configs.split(","):
            rs = [r for r in results if r["model"] == model and r["config"] == config]
            if not rs:
                continue
            med = {k: statistics.median(r["phases"][k] for r in rs) for k in ("group", "ddp", "s1", "s2")}
            steady = statistics.median(r["phases"][f"s{i}"] for r in rs for i in range(3, 7))
            print(f"  {model} {config:8s} group {med['group']:.3f} ddp {med['ddp']:.3f} step1 {med['s1']:.3f} "
                  f"step2 {med['s2']:.3f} steady {steady:.3f} step1/steady {med['s1'] / steady:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
