"""Side-by-side recovery: hyperpodrun vs torchrun + checkpoints vs NVIDIA Resiliency Extension, one command.

The same job (scripts/bench/workers/recovery_worker.py: a DDP MLP with Adam; model, batch and steps fixed by the
flags) runs on this machine in this invocation under each system, with the same faults from one seeded
schedule (--seed): a SIGKILL of one rank, an exception in one rank, a hang of one rank (a Python loop that
never returns: no step, no collective):

  torchrun       torchrun --max-restarts N; a torch.save checkpoint every K steps, reloaded after a restart. K
                 is chosen by Young/Daly, K = sqrt(2 C M) / step, from the save cost C and the step time
                 measured by a calibration run and the schedule's mean time between faults M (reported)
  hpr-process    hyperpodrun --max-restarts N (process level), the same checkpoints
  hpr-inprocess  hyperpodrun --inprocess-restart --standby-workers 1 --progress-timeout, HPWrapper +
                 CheckpointManager (memory; the model and optimizer outside the wrapped function, so that
                 survivors keep theirs)
  nvrx           NVIDIA Resiliency Extension's inprocess.Wrapper as its basic example starts it, under torchrun
                 --max-restarts N, the same checkpoints (it restarts in-process on an exception and a hang; a
                 dead process it cannot replace in-process: torchrun restarts every worker)

With --node-loss RUNS (CPU, as root) also a node loss: scripts/bench/node_loss.py's 2 nodes x 2 ranks on this
machine, node 1 killed whole (its agent, workers and shared memory), under torchrun (node 1 started again,
the checkpoint reloaded), hyperpodrun in-process (node 1 started again) and hyperpodrun with a hot spare -
that script's own worker, so its rows compare the systems with each other, not with the rows above.

Per system and fault kind: downtime (fault -> every rank completed a step after its restart), steps lost
(steps completed before the fault and done again), goodput (the fault-free time of every step / wall time
from the first entry to the last step, checkpoint cost included); medians with min-max over the faults; for
hyperpodrun in-process the phases from its event log. Output: DIR/recovery.json, DIR/recovery.md and
DIR/recovery.png (one timeline per system: a lane per rank, training / recovery / lost work; hyperpodrun
in-process with its own phases).

    .venv/bin/python scripts/bench/recovery.py --quick --out DIR          # CPU, gloo, < 5 minutes on 2 cores
    .venv/bin/python scripts/bench/recovery.py --out DIR                  # CPU, 5 faults per kind
    python scripts/bench/recovery.py --gpu --out DIR                      # NCCL, a 1B-parameter MLP, bf16
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
from _common import find_launcher  # noqa: E402

WORKER = HERE / "workers" / "recovery_worker.py"
SYSTEMS = ("torchrun", "hpr-process", "hpr-inprocess", "nvrx")
KINDS = ("kill", "raise", "hang")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def records(out: Path, kind: str) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    for f in sorted(out.glob(f"{kind}.rank*.jsonl")):
        recs += jsonl(f)
    return recs


def nvrx_problem() -> Optional[str]:
    """Why NVRx cannot run here (None: it can)."""
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except Exception as exc:   # ImportError, or a CUDA/NCCL probe failing at import
        return f"nvidia-resiliency-ext does not import here ({type(exc).__name__}: {exc}); pip install " \
               "nvidia-resiliency-ext (the newest version that installs) to add its rows"
    return None


def command(system: str, a: argparse.Namespace, port: int, log_dir: Path, restarts: int) -> list[str]:
    n = str(a.nproc)
    if system in ("torchrun", "nvrx"):
        # --standalone: the c10d rendezvous on a free port, a fresh store prefix per restart (the static one's
        # second attempt can read the first attempt's gloo addresses)
        return [find_launcher("torchrun"), "--standalone", "--nproc-per-node", n, "--max-restarts", str(restarts),
                "--monitor-interval", "0.1", str(WORKER)]
    base = [find_launcher("hyperpodrun"), "--nproc-per-node", n, "--log-dir", str(log_dir), "--rdzv-id", "job",
            "--master-port", str(port)]
    if system == "hpr-process":
        return [*base, "--max-restarts", str(restarts), str(WORKER)]
    return [*base, "--inprocess-restart", "--standby-workers", "1", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", "5",
            "--progress-timeout", str(a.hang_timeout), "--inprocess-timeout", "60", str(WORKER)]


#: node loss (--node-loss): scripts/bench/node_loss.py's scenarios, as rows of this table
NODE_SYSTEMS = {"torchrun": "torchrun", "hpr-replace": "hpr-inprocess", "hpr-spare": "hpr-inprocess (hot spare)"}


def node_loss_rows(runs: int, tmp: Path) -> list[dict[str, Any]]:
    """Kind "node": 2 nodes x 2 ranks on this machine, node 1 killed whole (its agent, workers and shared memory:
    own pid and mount namespaces, as root), `runs` times per system (scripts/bench/node_loss.py: its own worker,
    a DDP MLP with a torch.save checkpoint every 10 steps under torchrun, CheckpointManager under hyperpodrun)."""
    why = None
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        why = "needs root and unshare (each node in its own pid and mount namespaces)"
    rows: list[dict[str, Any]] = []
    if why is None:
        sys.path.insert(0, str(HERE))
        import node_loss   # noqa: E402 (a sibling script)
        for scenario, system in NODE_SYSTEMS.items():
            faults, codes = [], []
            for i in range(runs):
                where = tmp / f"node-{scenario}-{i}"
                where.mkdir(parents=True)
                try:
                    res = node_loss.run_one(scenario, where)
                except Exception as exc:   # one failed run is reported, not fatal to the others
                    res = {"ok": False, "error": str(exc), "exit_codes": [-1]}
                codes += res.get("exit_codes", [])
                faults.append({"downtime_s": res.get("recovery_s") if res.get("ok") else None,
                               "steps_lost": res.get("steps_redone") or 0})
                print(f"{system:14s} node   run {i}: {res.get('recovery_s')}", flush=True)
            rows.append({"system": system, "kind": "node", "faults": faults, "goodput": None,
                         "ok": all(f["downtime_s"] is not None for f in faults),
                         "exit_code": next((c for c in codes if c), 0)})
    rows.append({"system": "nvrx", "kind": "node", "skipped": why or "not run: its in-process Wrapper cannot "
                 "replace a lost node (torchrun restarts every worker: the torchrun row)"})
    if why is not None:
        rows += [{"system": s, "kind": "node", "skipped": why} for s in NODE_SYSTEMS.values()]
    return rows


def ckpt_dir(a: argparse.Namespace, out: Path) -> Path:
    """Where the torch.save checkpoints go: --ckpt-dir (a fresh folder in it per job), else the job's folder."""
    if not a.ckpt_dir:
        return out
    path = Path(a.ckpt_dir) / f"recovery-ckpt-{os.getpid()}-{out.parent.name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_job(system: str, kind: str, a: argparse.Namespace, steps: list[int], ranks: list[int], every: int,
            tmp: Path) -> dict[str, Any]:
    out = tmp / "out"
    out.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ, SYSTEM=system, OUT_DIR=str(out), STEPS=str(a.steps), DIM=str(a.dim),
               LAYERS=str(a.layers), BATCH=str(a.batch), STEP_SLEEP=str(a.step_sleep), CKPT_EVERY=str(every),
               FAULT_KIND=kind, FAULT_STEPS=",".join(map(str, steps)), FAULT_RANKS=",".join(map(str, ranks)),
               DEVICE=a.device, PG_TIMEOUT=str(a.hang_timeout), NVRX_SOFT_TIMEOUT=str(a.hang_timeout),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1",
               OFFLOAD="1" if a.offload else "0", CKPT_DIR=str(ckpt_dir(a, out)))
    env.pop("HYPERPODRUN_RESTART_GRACE_S", None)
    t0 = time.time()
    with open(tmp / "launcher.log", "wb") as log:
        proc = subprocess.Popen(command(system, a, port, tmp / "logs", len(steps) + 1), env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(a.job_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -999
    where = ckpt_dir(a, out)
    for ck in where.glob("ckpt.pt*"):   # a GPU run's checkpoint is GBs: one job's at a time
        ck.unlink()
    if where != out:
        where.rmdir()
    res = measure(out, a.nproc)
    res.update(system=system, kind=kind, exit_code=code, wall_s=time.time() - t0, ckpt_every=every,
               ok=code == 0 and len(res["faults"]) == len(steps) and all(f["downtime_s"] is not None
                                                                          for f in res["faults"]))
    if system == "hpr-inprocess":
        res["phases"] = phases(tmp / "logs" / "job", res["faults"])
        res["event_log"] = [e for f in sorted((tmp / "logs" / "job").glob("*.events.jsonl")) for e in jsonl(f)]
    if not res["ok"]:
        res["log_tail"] = (tmp / "launcher.log").read_text(errors="replace")[-1500:]
    return res


def measure(out: Path, nproc: int) -> dict[str, Any]:
    steps, entries = records(out, "steps"), records(out, "entries")
    faults = sorted(jsonl(out / "faults.jsonl"), key=lambda f: f["t"])
    per_fault = []
    for i, f in enumerate(faults):
        nxt = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        firsts = []
        for r in range(nproc):
            again = [e for e in entries if e["rank"] == r and f["t"] < e["t"] < nxt]
            after = [s["t"] for s in steps if s["rank"] == r and again and s["t"] > again[0]["t"] and s["t"] < nxt]
            # a rank that kept its process and state: its first step after the others came back
            if not again:
                after = [s["t"] for s in steps if s["rank"] == r and s["t"] > f["t"] and s["t"] < nxt]
            firsts.append(min(after) if after else None)
        done_before = [s["step"] for s in steps if s["t"] <= f["t"]]
        resumed = [e["start"] for e in entries if f["t"] < e["t"] < nxt]
        per_fault.append({"t": f["t"], "rank": f["rank"], "step": f["step"],
                          "downtime_s": max(firsts) - f["t"] if None not in firsts else None,
                          "steps_lost": max(0, max(done_before, default=0) - min(resumed)) if resumed else 0})
    clean = sorted(b["t"] - a["t"] for r in range(nproc)
                   for a, b in zip([s for s in steps if s["rank"] == r], [s for s in steps if s["rank"] == r][1:])
                   if b["step"] == a["step"] + 1)
    step_s = statistics.median(clean) if clean else None
    t_start = min((e["t"] for e in entries), default=None)
    t_end = max((s["t"] for s in steps), default=None)
    n_steps = max((s["step"] for s in steps), default=0)
    goodput = (n_steps * step_s / (t_end - t_start)) if step_s and t_start and t_end and t_end > t_start else None
    return {"faults": per_fault, "step_s": step_s, "goodput": goodput, "steps": steps, "entries": entries,
            "tops": records(out, "tops")}


def phases(run: Path, faults: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """hyperpodrun in-process: median seconds from the fault to each phase of its round (event log)."""
    from hyperpodrun import timeline
    ev = timeline.read_events(run.glob("*.events.jsonl"))
    marks: dict[str, list[float]] = {"detected": [], "restart_sent": [], "go": [], "state_restored": []}
    for f in faults:
        later = [e for e in ev if e["ts"] >= f["t"] - 0.05]
        for name, event in (("detected", "fault"), ("restart_sent", "restart_signal"), ("go", "go"),
                            ("state_restored", "state_restored")):
            hit = next((e for e in later if e.get("event") == event), None)
            if hit is not None:
                marks[name].append(max(0.0, hit["ts"] - f["t"]))
    return {k: (statistics.median(v) if v else None) for k, v in marks.items()}


def calibrate(a: argparse.Namespace, tmp: Path) -> tuple[float, float]:
    """(step seconds, checkpoint save seconds) from a short fault-free torchrun job saving every 5 steps."""
    b = argparse.Namespace(**{**vars(a), "steps": 11 if a.gpu else 25})   # GPU: 2 saves of GBs
    res = run_job("torchrun", "", b, [], [0], 5, tmp)
    saves = [s["s"] for s in records(tmp / "out", "saves")]
    if not res["step_s"]:
        raise SystemExit("calibration run failed:\n" + (tmp / "launcher.log").read_text(errors="replace")[-2000:])
    return res["step_s"], statistics.median(saves) if saves else 0.0


def schedule(a: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Fault steps (one per generation, increasing, --interval apart with jitter) and victim ranks."""
    rng = random.Random(a.seed)
    steps, at = [], a.warmup   # after the warm-up: every system's start-up (and hyperpodrun's warm spawner) is done
    for _ in range(a.faults):
        at += rng.randrange(0, max(1, a.interval // 3))
        steps.append(at)
        at += a.interval
    return steps, [rng.randrange(a.nproc) for _ in steps]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Recovery side by side ({meta['mode']})", "",
             f"Machine: {meta['machine']}; {meta['nproc']} ranks, {meta['device']}; model {meta['params'] / 1e6:.3g}M "
             f"parameters; {meta['steps']} steps, faults at steps {meta['fault_steps']} on ranks {meta['fault_ranks']} "
             f"(seed {meta['seed']}); checkpoint every {meta['ckpt_every']} steps (Young/Daly: save {meta['save_s']:.3f} s, "
             f"step {meta['step_s']:.3f} s, mean time between faults {meta['mtbf_s']:.1f} s).", "",
             f"Command: `{meta['command']}`", "",
             "| system | fault | runs ok | downtime median (min-max) s | steps lost | goodput | vs torchrun |",
             "|---|---|---|---|---|---|---|"]
    base = {r["kind"]: r for r in results if r["system"] == "torchrun" and r.get("ok")}
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['system']} | {r['kind']} | - | {r['skipped']} | | | |")
            continue
        down = [f["downtime_s"] for f in r["faults"] if f["downtime_s"] is not None]
        lost = [f["steps_lost"] for f in r["faults"]]
        ratio = ""
        b = base.get(r["kind"])
        if b is not None and down and r["system"] != "torchrun":
            bd = [f["downtime_s"] for f in b["faults"] if f["downtime_s"] is not None]
            ratio = f"{statistics.median(bd) / statistics.median(down):.1f}x" if bd else ""
        good = f"{100 * r['goodput']:.0f} %" if r.get("goodput") else "-"
        lines.append(f"| {r['system']} | {r['kind']} | {'yes' if r.get('ok') else 'NO (exit ' + str(r.get('exit_code')) + ')'} "
                     f"| {spread(down)} | {statistics.median(lost) if lost else '-'} | {good} | {ratio} |")
    ph = [r for r in results if r["system"] == "hpr-inprocess" and r.get("phases")]
    if ph:
        lines += ["", "hyperpodrun in-process, median seconds after the fault:", "",
                  "| fault | detected | RESTART sent | GO | state restored |", "|---|---|---|---|---|"]
        for r in ph:
            p = r["phases"]
            lines.append("| " + r["kind"] + " | " + " | ".join(f"{p[k]:.3f}" if p.get(k) is not None else "-"
                                                              for k in ("detected", "restart_sent", "go",
                                                                        "state_restored")) + " |")
    return "\n".join(lines) + "\n"


def draw(results: list[dict[str, Any]], kind: str, path: Path) -> None:
    """One timeline per system for fault kind `kind`: a lane per rank (training, recovery, lost work); the
    hyperpodrun in-process one with the phases of its event log."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from hyperpodrun import timeline
    rows = [r for r in results if r["kind"] == kind and not r.get("skipped") and r.get("steps")]
    if not rows:
        return
    colours = {**timeline.COLOURS, "recovery": "#cccccc", "checkpoint": "#f4a261", "lost work": "#000000"}
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.2 + 1.0 * len(rows) * max(1, len({s["rank"] for s in rows[0]["steps"]})) / 2),
                             squeeze=False)
    used: set[str] = set()
    for ax, r in zip(axes[:, 0], rows):
        t0 = min(e["t"] for e in r["entries"])
        nranks = sorted({s["rank"] for s in r["steps"]})
        segs: list[tuple[int, str, float, float]] = []
        if r["system"] == "hpr-inprocess" and r.get("event_log"):
            ev = sorted(r["event_log"], key=lambda e: e["ts"])
            segs = [(s.rank, s.phase, s.start, s.end) for s in timeline.segments(ev) if s.end > t0]
        else:
            for rank in nranks:
                mine = sorted((s for s in r["steps"] if s["rank"] == rank), key=lambda s: s["t"])
                best = 0
                prev_t = min(e["t"] for e in r["entries"] if e["rank"] == rank)
                for s in mine:
                    gap = s["t"] - prev_t
                    phase = "lost work" if s["step"] <= best else "training"
                    if gap > 5 * (r["step_s"] or 1):
                        # a stall with no fault in it is a checkpoint save (the only other pause in the job)
                        stall = "recovery" if any(prev_t - 0.5 <= f["t"] <= s["t"] for f in r["faults"]) \
                            else "checkpoint"
                        segs.append((rank, stall, prev_t, s["t"] - (r["step_s"] or 0)))
                        prev_t = s["t"] - (r["step_s"] or 0)
                    segs.append((rank, phase, prev_t, s["t"]))
                    best, prev_t = max(best, s["step"]), s["t"]
        for rank, phase, a, b in segs:
            ax.barh(nranks.index(rank) if rank in nranks else rank, b - max(a, t0), left=max(a, t0) - t0,
                    color=colours.get(phase, "#888888"), height=0.8, linewidth=0)
            used.add(phase)
        for f in r["faults"]:
            ax.axvline(f["t"] - t0, color="red", linewidth=0.8, linestyle=":")
        ax.set_yticks(range(len(nranks)), [f"rank {x}" for x in nranks])
        ax.invert_yaxis()
        ax.set_title(f"{r['system']} - {kind}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the job's first training entry (red: faults)")
    order = [p for p in (*timeline.COLOURS, "recovery", "checkpoint", "lost work") if p in used]
    fig.legend(handles=[Patch(color=colours[p], label=p) for p in order], loc="lower center", ncol=len(order),
               frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for recovery.json, recovery.md, recovery.png")
    ap.add_argument("--quick", action="store_true", help="CPU, small model, 3 faults per kind (< 5 min on 2 cores)")
    ap.add_argument("--tiny", action="store_true", help="seconds: 1 fault, 2 ranks (the test's)")
    ap.add_argument("--gpu", action="store_true", help="NCCL, one rank per GPU, a ~1B-parameter bf16 MLP")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--interval", type=int, default=15, help="steps between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=None, help="steps before the first fault (default 3 intervals)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default 32; --gpu 8192)")
    ap.add_argument("--calibrated", default=None, metavar="STEP_S,SAVE_S",
                    help="skip the calibration job: the step and checkpoint-save seconds of an earlier run (its "
                    "recovery.json meta), so that runs split over several commands use the same interval")
    ap.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                    help="only merge the recovery.json of runs split over several commands into --out")
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--hang-timeout", type=float, default=3.0, help="hang detection: --progress-timeout, NVRx "
                    "soft timeout, the process group timeout of the process-level systems")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    ap.add_argument("--node-loss", type=int, default=0, metavar="RUNS",
                    help="also a node loss (CPU, 2 nodes x 2 ranks on this machine, as root), RUNS times per system "
                    "(scripts/bench/node_loss.py's job; not part of --quick)")
    ap.add_argument("--ckpt-dir", default=None, help="where the torch.save checkpoints go (default: the job's "
                    "temporary folder; --gpu: /dev/shm, the fastest place there - in the checkpointing systems' favour)")
    ap.add_argument("--offload", action="store_true", help="hyperpodrun in-process: CheckpointManager("
                    "enable_offload=True), the snapshot copy overlapping the next step (on with --gpu)")
    ap.add_argument("--timeline-kind", default="kill")
    ap.add_argument("--redraw", action="store_true", help="only draw DIR/recovery.png again from DIR/recovery.json "
                    "(e.g. on a machine with matplotlib, for a run made on one without)")
    a = ap.parse_args(argv)
    if a.merge:
        parts = [json.loads((Path(d) / "recovery.json").read_text()) for d in a.merge.split(",")]
        meta = dict(parts[0]["meta"], command=" + ".join(p["meta"]["command"] for p in parts))
        results = [r for p in parts for r in p["results"]]
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "recovery.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        (out / "recovery.md").write_text(report(results, meta))
        kinds = sorted({r["kind"] for r in results})
        draw(results, a.timeline_kind if a.timeline_kind in kinds else kinds[0], out / "recovery.png")
        print((out / "recovery.md").read_text())
        return 0
    if a.redraw:
        data = json.loads((Path(a.out) / "recovery.json").read_text())
        kinds = sorted({r["kind"] for r in data["results"]})
        draw(data["results"], a.timeline_kind if a.timeline_kind in kinds else kinds[0], Path(a.out) / "recovery.png")
        return 0
    a.device = "cpu"
    if a.quick:
        a.faults, a.dim, a.layers, a.interval = 3, 128, 2, 20
    if a.tiny:
        a.faults, a.dim, a.layers, a.interval, a.nproc = 1, 64, 2, 6, 2
    if a.warmup is None:
        a.warmup = 3 * a.interval
    if a.gpu:
        import torch
        a.device, a.dim, a.layers, a.step_sleep = "cuda", 8192, 16, 0.0   # 16 x 8192^2 = 1.07B
        a.batch = a.batch or 8192
        a.nproc = max(1, torch.cuda.device_count()) if a.nproc == 2 else a.nproc
        a.hang_timeout = max(a.hang_timeout, 10.0)
        a.offload = True
        a.ckpt_dir = a.ckpt_dir or "/dev/shm"
    a.batch = a.batch or 32
    fault_steps, fault_ranks = schedule(a)
    a.steps = fault_steps[-1] + a.interval if fault_steps else 2 * a.interval
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    systems, kinds = a.systems.split(","), a.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmpdir:
        tmp = Path(tmpdir)
        if a.calibrated:
            step_s, save_s = (float(v) for v in a.calibrated.split(","))
        else:
            step_s, save_s = calibrate(a, tmp / "calibrate")
        mtbf = a.interval * step_s
        every = max(1, min(a.interval, round(math.sqrt(2 * save_s * mtbf) / step_s))) if save_s > 0 else a.interval
        results: list[dict[str, Any]] = []
        problem = nvrx_problem() if "nvrx" in systems else None
        for kind in kinds:
            for system in systems:
                if system == "nvrx" and problem:
                    results.append({"system": system, "kind": kind, "skipped": problem})
                    continue
                res = run_job(system, kind, a, fault_steps, fault_ranks, every, tmp / f"{system}-{kind}")
                results.append(res)
                down = [f["downtime_s"] for f in res["faults"] if f["downtime_s"] is not None]
                print(f"{system:14s} {kind:6s} ok={res['ok']} downtime {spread(down)} s", flush=True)
                # what is done so far survives a run cut short (a command's time limit on the GPU machine)
                (out / "partial.json").write_text(json.dumps({"results": results}, indent=1))
        if a.node_loss:
            results += node_loss_rows(a.node_loss, tmp)
        params = a.layers * (a.dim * a.dim + a.dim)
        meta = {"mode": "gpu" if a.gpu else "tiny" if a.tiny else "quick" if a.quick else "cpu",
                "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
                           f"{platform.python_version()}, torch {__import__('torch').__version__})",
                "nproc": a.nproc, "device": "NCCL" if a.gpu else "gloo", "params": params, "steps": a.steps,
                "fault_steps": fault_steps, "fault_ranks": fault_ranks, "seed": a.seed, "ckpt_every": every,
                "save_s": save_s, "step_s": step_s, "mtbf_s": mtbf, "command": " ".join(["recovery.py", *(argv or sys.argv[1:])])}
        (out / "recovery.md").write_text(report(results, meta))
        try:
            draw(results, a.timeline_kind if a.timeline_kind in kinds else kinds[0], out / "recovery.png")
        except ImportError:
            print("no recovery.png: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        (out / "recovery.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print((out / "recovery.md").read_text())
    return 0 if all(r.get("ok") or r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
