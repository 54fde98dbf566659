"""Steady-state cost of CheckpointManager snapshots on a GPU, every configuration in one process and one run.

    python3 scripts/bench/gpu/gpu_snapshot_overhead.py --out DIR [--dim 8192 --layers 16 --batch 8192]
        [--every 1,2,4,8] [--rounds 2] [--steps 16] [--configs NAME,...]

One process, one GPU, the recovery benchmark's model (LAYERS x DIM² bf16 MLP, Adam, batches made on the
device). Configurations: no snapshot (the baseline), then a snapshot every k steps for each k with
`enable_offload=True` (the copy overlaps the next forward/backward; the optimizer step waits for it), and
the same with `stage_on_device=True` (the optimizer step waits only for a device-to-device copy). They run
in rounds, one block of --steps measured steps each (after two warm-up steps that map and pin the slots),
so drift of the machine hits every configuration alike. Overhead = a configuration's mean step time over
the baseline's, in the same round; the medians over rounds are reported. --configs names them instead:
`none`, `every<k>-offload`, `every<k>-staged`, with `-t<n>` to cap the checksum threads at n
(slot_checksum.MAX_THREADS). Each block also records every step's time and each save() call's time.

Correctness is checked on the way (first round only with --check-first): after a snapshot block the
newest slot is read back, its checksum verified, and every tensor compared bitwise with the live state at
that step.

Writes DIR/snapshot-overhead.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from hyperpodrun import CheckpointManager  # noqa: E402
from hyperpodrun.state.slots import slot_checksum
from hyperpodrun.state.slots import snapshot_io  # noqa: E402
from hyperpodrun.state.state_dicts import state_dict_of, tensors_in  # noqa: E402

DEVICE = "cuda"


def build(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    with torch.device(DEVICE):
        for _ in range(layers):
            mods += [nn.Linear(dim, dim), nn.GELU()]
    model = nn.Sequential(*mods).to(torch.bfloat16)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def check_slot(cm: CheckpointManager, step: int, state: dict) -> None:
    """The slot of `step` holds exactly the live state (which is at `step`: nothing ran since that save)."""
    cm.wait()
    found = None
    for i in (0, 1):                       # the slot that holds `step` (not the step's parity: see _next_slot)
        path = os.path.join(cm.slot_dir(), f"slot{i}")
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        if snapshot_io.header(data, path)[0] == step:
            found = (data, path)
    assert found is not None, f"no slot holds step {step}"
    got_step, payload = snapshot_io.decode(found[0], found[1], verify=True, copy=False)
    assert got_step == step, (got_step, step)
    for name, obj in state.items():
        saved = list(tensors_in(payload["state"][name][1]))
        live = list(tensors_in(state_dict_of(obj)))
        assert len(saved) == len(live), (name, len(saved), len(live))
        for a, b in zip(saved, live):
            if a.dtype != b.dtype or not torch.equal(a, b.detach().cpu()):
                raise AssertionError(f"slot of step {step}: {name} differs from the live state")


def parse(name: str) -> dict:
    if name == "none":
        return {"name": name, "every": 0, "staged": False, "threads": None}
    parts = name.split("-")
    threads = int(parts[2][1:]) if len(parts) > 2 else None
    return {"name": name, "every": int(parts[0].removeprefix("every")), "staged": parts[1] == "staged",
            "threads": threads}


def block(model: nn.Module, opt: torch.optim.Optimizer, cfg: dict, start: int, steps: int, args: argparse.Namespace,
          base: str, check: bool) -> dict:
    every = cfg["every"]
    cm = None
    slot_checksum.MAX_THREADS = cfg["threads"] or 16
    if every:
        shm = os.path.join(base, "slots")     # one place for every configuration: the slot files are reused
        os.makedirs(shm, mode=0o700, exist_ok=True)
        cm = CheckpointManager(enable_offload=True, stage_on_device=cfg["staged"], shm_dir=shm)
    saves = []
    state = {"model": model, "opt": opt}
    times = []
    step = start
    warm = 2 * max(every, 1)
    for i in range(warm + steps):
        t0 = time.perf_counter()
        g = torch.Generator(device=DEVICE).manual_seed(1000 * step)
        x = torch.randn(args.batch, args.dim, generator=g, device=DEVICE, dtype=torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        step += 1
        if cm is not None and step % every == 0:
            s0 = time.perf_counter()
            cm.save(step, state)
            if i >= warm:
                saves.append(time.perf_counter() - s0)
        if i >= warm:
            times.append(time.perf_counter() - t0)
    out = {"name": cfg["name"], "mean_step_s": statistics.fmean(times), "median_step_s": statistics.median(times),
           "steps": len(times), "step_s": times, "save_call_s": saves}
    if cm is not None:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if check:                          # the slot of the last step must equal the live state
            if step % every:
                cm.save(step, state)       # not timed: the block ended between two saves
            check_slot(cm, step, state)
            out["slot_checked"] = True
        out["staging_bytes"] = cm._staging.nbytes if cm._staging is not None else 0
        cm.close(success=False)            # the slot files stay for the next configuration
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--every", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--configs", default="", help="comma-separated configuration names (see the module doc)")
    ap.add_argument("--check-first", action="store_true", help="check the slots in the first round only")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself (no staging there)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    model, opt = build(args.dim, args.layers)
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3   # params + Adam's two
    names = args.configs.split(",") if args.configs else ["none"] + [
        f"every{k}-{how}" for k in args.every.split(",") for how in ("offload", "staged")]
    configs = [parse(n) for n in names]
    if "none" not in names:
        configs.insert(0, parse("none"))
    base = f"/dev/shm/hpr-overhead-{os.getpid()}"
    os.makedirs(base, mode=0o700)
    rounds: list[dict[str, dict]] = []
    step = 0
    try:
        for r in range(args.rounds):
            results: dict[str, dict] = {}
            for cfg in configs:
                res = block(model, opt, cfg, step, args.steps, args, base, r == 0 or not args.check_first)
                step += args.steps + 2 * max(cfg["every"], 1)
                results[cfg["name"]] = res
                print(json.dumps({"round": r, **res}), flush=True)
            rounds.append(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = []
    for cfg in configs:
        name = cfg["name"]
        means = [rd[name]["mean_step_s"] for rd in rounds]
        over = [rd[name]["mean_step_s"] / rd["none"]["mean_step_s"] - 1 for rd in rounds]
        summary.append({"name": name, "every": cfg["every"], "staged": cfg["staged"],
                        "mean_step_s_median": statistics.median(means), "overhead_median": statistics.median(over),
                        "overheads": over, "slot_checked": any(rd[name].get("slot_checked", False) for rd in rounds), "threads": cfg["threads"],
                        "staging_bytes": rounds[-1][name].get("staging_bytes", 0)})
    doc = {"dim": args.dim, "layers": args.layers, "batch": args.batch, "state_bytes": state_bytes,
           "steps_per_block": args.steps, "rounds": rounds, "summary": summary,
           "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    with open(os.path.join(args.out, "snapshot-overhead.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    lines = [f"state {state_bytes / 1e9:.2f} GB, {args.rounds} rounds x {args.steps} steps per configuration",
             "", "| configuration | snapshot every | mean step (s) | overhead (median of rounds) | slot == live state |",
             "|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['name']} | {s['every'] or '-'} | {s['mean_step_s_median']:.4f} | "
                     f"{100 * s['overhead_median']:+.1f} % | {'yes' if s['slot_checked'] else '-'} |")
    with open(os.path.join(args.out, "snapshot-overhead.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
