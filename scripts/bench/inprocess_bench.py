"""In-process restart benchmark (issue 3, "Measure"): detection latency, the per-phase restart timeline, and
recovery side by side with a process-level restart (hyperpodrun without --inprocess-restart) and torchrun,
all on the same worker script (scripts/bench/workers/inprocess_worker.py: DDP + Adam on an MLP) in one invocation.

Every fault is planned by the worker itself (one per generation, alternating SIGKILL and exception, the
victim rank rotating, rank 0 included): it writes time.time() to its record file right before it kills
itself / raises. The agent's event log (<log-dir>/<run-id>/node0.events.jsonl) gives the restart phases
(fault, restart_signal, rank_ready, respawn, kill, barrier_complete, go); the workers' records give the
first step each generation completes. Both clocks are this machine's wall clock (time.time()).

Jobs (--modes, all by default, one after the other):
  inprocess        hyperpodrun --inprocess-restart, --faults SIGKILLs + --faults exceptions; the worker runs
                   with --workaround, two workarounds for a deadlock found while writing this benchmark
                   (BENCHMARKS.md; gloo group teardown in torch 2.13 under HPWrapper): B keeps each
                   generation's DDP alive until the next generation has its group, A makes the abort shut down
                   the generation's gloo TCP connections (as the group is no longer freed there);
                   --no-workaround drops them;
  inprocess-asis   the same without the workarounds, --asis-faults of each kind (what ships today);
  process          hyperpodrun without --inprocess-restart, --max-restarts N, --baseline-faults faults;
  torchrun         torchrun --max-restarts N, --baseline-faults faults, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
                   (stock torchrun's shared store often fails to re-form a gloo group after a restart, pytorch
                   issue 135712; --torchrun-shared-store keeps the default).
Measured:
  1. detection latency: the worker's fault timestamp -> the agent's restart_signal (RESTART sent); median
     and p99, separately for SIGKILL and exception;
  2. the timeline of an in-process restart, medians over the faults (offsets from the fault);
  3. fault -> first completed training step after the restart (every rank done with its first step of the
     next generation) for each job; ratios = a baseline's median / the in-process median of one fault kind.

CPU (gloo, 4 ranks; 5.1 minutes on 2 cores with other jobs running, load average 3-6; 7.7 minutes at load 9):
    .venv/bin/python scripts/bench/inprocess_bench.py --out bench-inprocess.json --md bench-inprocess.md

GPU (NCCL, 2 ranks, e.g. 2xH200). NCCL_NVLS_ENABLE=0 is set in the launchers' environment; each worker calls
torch.cuda.set_device(local_rank) and init_process_group("nccl", device_id=torch.device("cuda", local_rank)).
The victim is SIGKILLed right after issuing its part of an all-reduce of --fault-buf-mb MB that its peer
entered --fault-delay s earlier (so the peer is inside the collective), or raises while the peer waits in it.
Workaround A is off on NCCL (the abort is ncclCommAbort), B stays on. `--sync item` (default) waits for
each step with loss.item(), a C call: the survivor is then released by the runtime's NCCL communicator abort
from its monitor thread; `--sync poll` waits by polling a CUDA event from Python, where the RESTART interrupt
lands too. The row "rounds where the agent killed a rank that had not failed" shows whether a survivor had to
be replaced (2xH200, --sync item, as shipped: 0 of 8 rounds; scripts/bench/results/inprocess-gpu-2xh200.md).
Run both (each about 8 minutes by estimate; split with --modes
inprocess,inprocess-asis / --modes process,torchrun if a command may run at most 10 minutes):
    .venv/bin/python scripts/bench/inprocess_bench.py --backend nccl --nproc-per-node 2 --dim 4096 \
        --layers 6 --batch 1024 --fault-buf-mb 256 --faults 10 --asis-faults 2 --baseline-faults 5 \
        --sync item --out bench-inprocess-gpu-item.json --md bench-inprocess-gpu-item.md
    .venv/bin/python scripts/bench/inprocess_bench.py --backend nccl --nproc-per-node 2 --dim 4096 \
        --layers 6 --batch 1024 --fault-buf-mb 256 --faults 10 --asis-faults 2 --baseline-faults 5 \
        --sync poll --out bench-inprocess-gpu-poll.json --md bench-inprocess-gpu-poll.md
(7 Linear layers of 4096x4096 = 117M parameters, Adam, DDP: close to the NVRx measurement in REFERENCE.md.)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from _common import find_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "inprocess_worker.py")
MODES = ("inprocess", "inprocess-asis", "process", "torchrun")
LABELS = {"inprocess": "hyperpodrun --inprocess-restart (+ workarounds A, B)",
          "inprocess-asis": "hyperpodrun --inprocess-restart (as shipped)",
          "process": "hyperpodrun, process-level restart", "torchrun": "torchrun --max-restarts"}


# ------------------------------------------------------------------------------------------------ helpers


def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def p99(xs: list[float]) -> Optional[float]:
    """Linear-interpolated 99th percentile (with ~20 samples it is close to the maximum)."""
    if not xs:
        return None
    s = sorted(xs)
    k = 0.99 * (len(s) - 1)
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": median(xs), "p99": p99(xs), "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cores": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        info["cpu"] = m.group(1).strip() if m else platform.processor()
    except (OSError, subprocess.SubprocessError):
        info["cpu"] = platform.processor()
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():   # names from nvidia-smi: no CUDA context in this process
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    except (ImportError, OSError, subprocess.SubprocessError):
        pass
    return info


def loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------ records
def read_records(out: str) -> dict[str, Any]:
    """Parse every worker record file of one job."""
    rec: dict[str, Any] = {"faults": [], "steps": {}, "init": {}, "ddp": {}, "top": []}
    for path in glob.glob(os.path.join(out, "r*_p*.txt")):
        m = re.search(r"r(\d+)_p(\d+)\.txt$", path)
        assert m
        rank, pid = int(m.group(1)), int(m.group(2))
        with open(path) as fh:
            for line in fh:
                p = line.split()
                try:
                    if p[0] == "top":
                        rec["top"].append((rank, pid, float(p[1])))
                    elif p[0] in ("init", "ddp"):
                        rec[p[0]].setdefault(int(p[1]), {})[rank] = float(p[2])
                    elif p[0] == "step":
                        rec["steps"].setdefault(int(p[1]), {}).setdefault(rank, []).append((int(p[2]), float(p[3])))
                    elif p[0] == "fault":
                        rec["faults"].append({"gen": int(p[1]), "step": int(p[2]), "kind": p[3], "rank": rank,
                                              "pid": pid, "t": float(p[4])})
                except (IndexError, ValueError):
                    continue   # a torn last line
    rec["faults"].sort(key=lambda f: f["t"])
    return rec


def first_step_done(rec: dict[str, Any], gen: int, nproc: int) -> Optional[float]:
    """When every rank had completed its first step of `gen` (the job's first completed step)."""
    by_rank = rec["steps"].get(gen, {})
    if len(by_rank) < nproc:
        return None
    return max(min(t for _, t in steps) for steps in by_rank.values())


def all_ranks(d: dict[int, dict[int, float]], gen: int, nproc: int) -> Optional[float]:
    ranks = d.get(gen, {})
    return max(ranks.values()) if len(ranks) >= nproc else None


def step_time(rec: dict[str, Any]) -> Optional[float]:
    """Median duration of a steady-state step (consecutive steps of one rank, first step of a generation
    excluded)."""
    ds = []
    for by_rank in rec["steps"].values():
        for steps in by_rank.values():
            steps = sorted(steps)
            ds += [b[1] - a[1] for a, b in zip(steps, steps[1:]) if b[0] == a[0] + 1 and a[0] >= 1]
    return median(ds)


def read_events(log_dir: str) -> list[dict[str, Any]]:
    evs = []
    for path in glob.glob(os.path.join(log_dir, "*", "node*.events.jsonl")):
        with open(path) as fh:
            for line in fh:
                try:
                    evs.append(json.loads(line))
                except ValueError:
                    pass
    return sorted(evs, key=lambda e: e.get("ts", 0.0))


# ------------------------------------------------------------------------------------------------ jobs
def run_job(mode: str, args: argparse.Namespace, workdir: str, n_faults: int, kinds: str) -> dict[str, Any]:
    out = os.path.join(workdir, mode)
    os.makedirs(out)
    log_dir = os.path.join(out, "logs")
    worker_args = ["--backend", args.backend, "--faults", str(n_faults), "--kinds", kinds,
                   "--fault-step", str(args.fault_step), "--fault-delay", str(args.fault_delay),
                   "--fault-buf-mb", str(args.fault_buf_mb), "--final-steps", str(args.final_steps),
                   "--dim", str(args.dim), "--layers", str(args.layers), "--batch", str(args.batch),
                   "--sync", args.sync]
    if mode != "inprocess-asis" and not args.no_workaround:
        worker_args.append("--workaround")
    if args.victims:
        worker_args += ["--victims", args.victims]
    nproc = ["--nproc-per-node", str(args.nproc_per_node)]
    if mode.startswith("inprocess"):
        argv = [find_launcher("hyperpodrun"), "--standalone", *nproc, "--inprocess-restart",
                "--max-restarts", str(args.escalation_budget), "--max-step-failures", "1000000",
                "--log-dir", log_dir, *args.hyperpodrun_arg]
    elif mode == "process":
        argv = [find_launcher("hyperpodrun"), "--standalone", *nproc, "--max-restarts",
                str(n_faults + args.restart_slack), "--log-dir", log_dir, *args.hyperpodrun_arg]
    else:
        argv = [find_launcher("torchrun"), "--standalone", *nproc, "--max-restarts",
                str(n_faults + args.restart_slack)]
    argv += [WORKER, *worker_args]
    env = dict(os.environ, BENCH_OUT=out, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    if args.backend == "nccl":
        env["NCCL_NVLS_ENABLE"] = "0"   # NVLink SHARP multicast off (not available on every H200 host)
    if mode == "torchrun" and not args.torchrun_shared_store:
        # stock torchrun re-forms a gloo group after a restart only sometimes with its default shared store
        # (stale keys, pytorch issue 135712; REFERENCE.md): let rank 0 host a fresh store per attempt
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    console_path = os.path.join(out, "console.log")
    timeout = args.job_timeout or (60 + n_faults * {"inprocess": 12, "inprocess-asis": 40}.get(mode, 25))
    shown_argv = " ".join(os.path.basename(a) if a.startswith("/") else a for a in argv)
    print(f"[{mode}] {n_faults} faults ({kinds}); limit {timeout:.0f}s: {shown_argv}", file=sys.stderr, flush=True)
    load0 = loadavg()
    t0 = time.time()
    with open(console_path, "wb") as console:
        proc = subprocess.Popen(argv, env=env, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    wall = time.time() - t0
    rec = read_records(out)
    left = kill_leftovers(rec)
    def shown(a: str) -> str:
        if a.startswith(workdir):
            return "<workdir>" + a[len(workdir):]
        return os.path.relpath(a) if a.startswith("/") else a
    res: dict[str, Any] = {"mode": mode, "argv": [shown(a) for a in argv],
                           "exit_code": code, "timed_out": code is None, "job_s": round(wall, 2),
                           "workers_left_running": left, "loadavg_before": load0, "loadavg_after": loadavg(),
                           "step_s": step_time(rec), "dir": out}
    print(f"[{mode}] exit {code} after {wall:.1f}s, {len(rec['faults'])} faults recorded", file=sys.stderr,
          flush=True)
    if mode.startswith("inprocess"):
        res.update(analyse_inprocess(rec, read_events(log_dir), args.nproc_per_node))
    else:
        res.update(analyse_process(rec, args.nproc_per_node, read_events(log_dir) if mode == "process" else []))
    return res


def kill_leftovers(rec: dict[str, Any]) -> int:
    """SIGKILL any recorded worker that is still alive after its launcher ended; returns how many."""
    n = 0
    for _, pid, _ in rec["top"]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"inprocess_worker.py" not in fh.read():
                    continue
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            os.kill(pid, signal.SIGKILL)
            n += 1
        except (OSError, IndexError):
            pass
    return n


def analyse_inprocess(rec: dict[str, Any], evs: list[dict[str, Any]], nproc: int) -> dict[str, Any]:
    by = {}
    for e in evs:
        by.setdefault(e.get("event"), []).append(e)

    def with_gen(name: str, gen: int) -> list[dict[str, Any]]:
        return [e for e in by.get(name, []) if e.get("generation") == gen]

    faults = []
    for f in rec["faults"]:
        g, tf = f["gen"], f["t"]
        target = g + 1
        rs = with_gen("restart_signal", target)
        go = with_gen("go", target)
        if not rs:
            faults.append({**f, "error": f"no restart_signal for generation {target}"})
            continue
        rs_ts = rs[0]["ts"]
        detect = [e for e in by.get("fault", []) if tf - 1.0 <= e["ts"] <= rs_ts]
        row: dict[str, Any] = {**f, "target": target, "detect_s": detect[-1]["ts"] - tf if detect else None,
                               "restart_signal_s": rs_ts - tf,
                               "root_cause": detect[-1].get("root_cause") if detect else None}
        go_ts = go[0]["ts"] if go else None
        end = go_ts if go_ts is not None else rs_ts + 120
        ready = with_gen("rank_ready", target)
        respawn = with_gen("respawn", target)
        kills = [e for e in by.get("kill", []) if rs_ts - 0.01 <= e["ts"] <= end]
        folded = [e for e in by.get("fault_folded", []) if e.get("generation") == target]
        bc = with_gen("barrier_complete", target)
        respawned = {e.get("rank") for e in respawn}
        survivors = [e for e in ready if e.get("rank") not in respawned]
        row.update({
            "survivors_ready_s": max(e["ts"] for e in survivors) - tf if survivors else None,
            "all_ready_s": max(e["ts"] for e in ready) - tf if ready else None,
            "abort_s": max(e.get("abort_s", 0.0) for e in survivors) if survivors else None,
            "finalize_s": max(e.get("finalize_s", 0.0) for e in survivors) if survivors else None,
            "health_s": max(e.get("health_s", 0.0) for e in survivors) if survivors else None,
            "respawn_s": min(e["ts"] for e in respawn) - tf if respawn else None,
            "respawned_ranks": sorted(r for r in respawned if r is not None),
            "killed_by_agent": [e.get("rank") for e in kills],
            "secondary_folded": len(folded),
            "barrier_complete_s": bc[0]["ts"] - tf if bc else None,
            "go_s": go_ts - tf if go_ts is not None else None,
            "downtime_s": go[0].get("downtime_s") if go else None,
        })
        init = all_ranks(rec["init"], target, nproc)
        ddp = all_ranks(rec["ddp"], target, nproc)
        first = first_step_done(rec, target, nproc)
        row.update({"init_s": init - tf if init else None, "ddp_s": ddp - tf if ddp else None,
                    "first_step_s": first - tf if first else None,
                    "go_to_first_step_s": first - go_ts if first and go_ts is not None else None})
        faults.append(row)
    out: dict[str, Any] = {"faults": faults,
                           "rounds": len(by.get("restart_signal", [])), "escalations":
                           len(by.get("inprocess_timeout", [])) + len(by.get("restart_begin", [])),
                           "completed": bool(by.get("complete"))}
    for kind in ("kill", "raise"):
        rows = [r for r in faults if r["kind"] == kind and "error" not in r]
        out[kind] = {key: stats([r[key] for r in rows if r.get(key) is not None]) for key in
                     ("detect_s", "restart_signal_s", "survivors_ready_s", "all_ready_s", "abort_s", "finalize_s",
                      "health_s", "respawn_s", "barrier_complete_s", "go_s", "downtime_s", "init_s", "ddp_s",
                      "first_step_s", "go_to_first_step_s")}
        out[kind]["n"] = len(rows)
        out[kind]["rounds_with_survivors_killed"] = sum(1 for r in rows if r["killed_by_agent"])
        out[kind]["rounds_with_respawn"] = sum(1 for r in rows if r["respawned_ranks"])
    return out


def analyse_process(rec: dict[str, Any], nproc: int, evs: list[dict[str, Any]]) -> dict[str, Any]:
    """Process-level restarts: fault -> every new process started / in the group / first step completed."""
    tops = sorted(t for _, _, t in rec["top"])
    gens_with_steps = sorted(rec["steps"])
    faults = []
    for f in rec["faults"]:
        tf = f["t"]
        later = [g for g in gens_with_steps if g > f["gen"] and first_step_done(rec, g, nproc) is not None]
        row: dict[str, Any] = dict(f)
        if later:
            g2 = later[0]
            first = first_step_done(rec, g2, nproc)
            init = all_ranks(rec["init"], g2, nproc)
            # the new processes' first lines: the nproc earliest `top` records after the fault
            new_tops = [t for t in tops if t > tf][:nproc]
            row.update({"next_gen": g2, "lost_attempts": g2 - f["gen"] - 1,
                        "processes_started_s": max(new_tops) - tf if len(new_tops) == nproc else None,
                        "init_s": init - tf if init else None, "first_step_s": first - tf})
        else:
            row["error"] = "no completed step after this fault"
        if evs:
            det = [e for e in evs if e.get("event") == "fault" and e["ts"] >= tf - 1.0]
            row["detect_s"] = det[0]["ts"] - tf if det else None
        faults.append(row)
    out: dict[str, Any] = {"faults": faults}
    ok = [r for r in faults if "error" not in r]
    for kind in ("all", "kill", "raise"):
        rows = [r for r in ok if kind == "all" or r["kind"] == kind]
        out[kind] = {key: stats([r[key] for r in rows if r.get(key) is not None])
                     for key in ("detect_s", "processes_started_s", "init_s", "first_step_s")}
        out[kind]["n"] = len(rows)
    out["lost_attempts"] = sum(r.get("lost_attempts", 0) for r in ok)
    return out


# ------------------------------------------------------------------------------------------------ report
def markdown(res: dict[str, Any]) -> str:
    L: list[str] = []
    m = res["machine"]
    L.append(f"Machine: {m.get('cpu')} ({m.get('cores')} cores), Python {m.get('python')}, torch {m.get('torch')}"
             + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else "") + ".")
    c = res["config"]
    L.append(f"Workload: {c['backend']}, {c['nproc_per_node']} ranks, MLP {c['layers'] + 1}x({c['dim']}x{c['dim']}) = "
             f"{c['params'] / 1e6:.1f}M parameters, Adam, DDP, batch {c['batch']}; median step "
             + ", ".join(f"{k} {fmt(v.get('step_s'))} s" for k, v in res["modes"].items()) + ".")
    for mode in ("inprocess", "inprocess-asis"):
        ip = res["modes"].get(mode)
        if ip:
            L.append(f"{LABELS[mode]}: exit {ip['exit_code']}, {ip['rounds']} restart rounds for "
                     f"{len(ip['faults'])} injected faults, {ip['escalations']} escalations, {ip['job_s']:.0f} s.")
    ip = res["modes"].get("inprocess") or res["modes"].get("inprocess-asis")
    if ip:
        L.append("")
        L.append("| detection (fault -> agent) | kind | n | median (ms) | p99 (ms) | min (ms) | max (ms) |")
        L.append("|---|---|---|---|---|---|---|")
        for key, label in (("detect_s", "fault -> `fault` event"), ("restart_signal_s", "fault -> `restart_signal`")):
            for kind in ("kill", "raise"):
                s = ip[kind][key]
                L.append(f"| {label} | {'SIGKILL' if kind == 'kill' else 'exception'} | {s['n']} | "
                         + " | ".join(fmt(None if s[k] is None else s[k] * 1000, 1)
                                      for k in ("median", "p99", "min", "max"))
                         + " |")
        L.append("")
        both = [m for m in ("inprocess", "inprocess-asis") if m in res["modes"]]
        heads = [f"{'SIGKILL' if k == 'kill' else 'exception'}{' (as shipped)' if m == 'inprocess-asis' else ''}"
                 for m in both for k in ("kill", "raise")]
        L.append("| phase (median seconds after the fault) | " + " | ".join(heads) + " |")
        L.append("|---" * (len(heads) + 1) + "|")
        rows = (("agent detects (`fault`)", "detect_s"), ("RESTART sent (`restart_signal`)", "restart_signal_s"),
                ("survivors READY (`rank_ready`, last)", "survivors_ready_s"),
                ("  survivor abort (max over ranks, duration)", "abort_s"),
                ("  survivor finalize (duration)", "finalize_s"), ("  survivor health check (duration)", "health_s"),
                ("failed rank respawned (`respawn`)", "respawn_s"), ("every rank READY", "all_ready_s"),
                ("`barrier_complete`", "barrier_complete_s"), ("`go`", "go_s"),
                ("every rank past init_process_group", "init_s"), ("every rank past DDP construction", "ddp_s"),
                ("**first training step completed**", "first_step_s"),
                ("  of which GO -> first step", "go_to_first_step_s"))
        cols = [(res["modes"][m], k) for m in both for k in ("kill", "raise")]
        L.append(f"| faults | " + " | ".join(str(r[k]["n"]) for r, k in cols) + " |")
        for label, key in rows:
            L.append(f"| {label} | " + " | ".join(fmt(r[k][key]["median"]) for r, k in cols) + " |")
        L.append("| rounds where the agent killed a rank that had not failed | " + " | ".join(
            f"{r[k]['rounds_with_survivors_killed']}/{r[k]['n']}" for r, k in cols) + " |")
        L.append("| rounds with a respawn | " + " | ".join(
            f"{r[k]['rounds_with_respawn']}/{r[k]['n']}" for r, k in cols) + " |")
    L.append("")
    L.append("| fault -> first completed step after the restart | n | SIGKILL median (s) | exception median (s) | "
             "all: median (s) | p99 (s) | / in-process (SIGKILL, exception) | / in-process as shipped |")
    L.append("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        label = LABELS[mode]
        r = res["modes"].get(mode)
        if not r:
            continue
        if mode.startswith("inprocess"):
            k, e = r["kill"]["first_step_s"], r["raise"]["first_step_s"]
            allv = [x["first_step_s"] for x in r["faults"] if x.get("first_step_s") is not None]
            n = len(allv)
            ratio = " | "
        else:
            k, e = r["kill"]["first_step_s"], r["raise"]["first_step_s"]
            allv = [x["first_step_s"] for x in r["faults"] if x.get("first_step_s") is not None]
            n = len(allv)
            rr = res.get("ratios", {}).get(mode, {})
            ratio = " | ".join(f"{fmt(rr[v].get('kill'), 1)}x, {fmt(rr[v].get('raise'), 1)}x" if v in rr else "-"
                               for v in ("inprocess", "inprocess-asis"))
        lost = f", {r['lost_attempts']} lost attempts" if r.get("lost_attempts") else ""
        extra = f" (exit {r['exit_code']}{lost})"
        L.append(f"| {label}{extra} | {n} | {fmt(k['median'])} | {fmt(e['median'])} | {fmt(median(allv))} | "
                 f"{fmt(p99(allv))} | {ratio} |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl when CUDA is available, else gloo")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="default: 4 on CPU, 2 on GPU")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--faults", type=int, default=20, help="in-process faults of each kind (SIGKILL, exception)")
    ap.add_argument("--baseline-faults", type=int, default=6,
                    help="faults (alternating SIGKILL / exception) for process-level restart and torchrun each")
    ap.add_argument("--restart-slack", type=int, default=4,
                    help="extra --max-restarts for the baselines (attempts that fail to re-form the group)")
    ap.add_argument("--asis-faults", type=int, default=6,
                    help="faults of each kind for the in-process job without the worker's workarounds")
    ap.add_argument("--no-workaround", action="store_true",
                    help="run the 'inprocess' job (and the baselines) without the worker's workarounds A and B")
    ap.add_argument("--torchrun-shared-store", action="store_true",
                    help="leave torchrun's default shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset)")
    ap.add_argument("--escalation-budget", type=int, default=2, help="--max-restarts of the in-process job")
    ap.add_argument("--victims", default="", help="ranks to hit in turn (default: all, rank 1 first)")
    ap.add_argument("--fault-step", type=int, default=3)
    ap.add_argument("--fault-delay", type=float, default=0.1)
    ap.add_argument("--fault-buf-mb", type=float, default=4.0)
    ap.add_argument("--final-steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3, help="hidden layers (the MLP has layers+1 Linear)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sync", choices=("item", "poll"), default="item", help="GPU: see the module docstring")
    ap.add_argument("--hyperpodrun-arg", action="append", default=[],
                    help="extra hyperpodrun flag (repeatable), e.g. --hyperpodrun-arg=--heartbeat-interval=0.5")
    ap.add_argument("--job-timeout", type=float, default=None, help="seconds per job (default: by fault count)")
    ap.add_argument("--workdir", default=None, help="keep the jobs' files here (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--md", default=None, help="write the markdown here")
    args = ap.parse_args()

    if args.backend == "auto":
        try:
            import torch
            args.backend = "nccl" if torch.cuda.is_available() else "gloo"
        except ImportError:
            args.backend = "gloo"
    if args.nproc_per_node is None:
        args.nproc_per_node = 2 if args.backend == "nccl" else 4
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; pick from {MODES}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="hpr-inprocess-bench-")
    os.makedirs(workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    params = (args.layers + 1) * (args.dim * args.dim + args.dim)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "md", "workdir")}
    res: dict[str, Any] = {"machine": machine(),
                           "command": " ".join(["python", os.path.relpath(__file__)] + sys.argv[1:]),
                           "config": config | {"params": params},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "modes": {}}
    t0 = time.time()
    try:
        for mode in modes:
            if mode == "inprocess":
                res["modes"][mode] = run_job(mode, args, workdir, 2 * args.faults, "kill,raise")
            elif mode == "inprocess-asis":
                res["modes"][mode] = run_job(mode, args, workdir, 2 * args.asis_faults, "kill,raise")
            else:
                res["modes"][mode] = run_job(mode, args, workdir, args.baseline_faults, "kill,raise")
    finally:
        res["total_s"] = round(time.time() - t0, 1)
        if not args.workdir:
            shutil.rmtree(os.path.dirname(workdir), ignore_errors=True)
    # ratios: a baseline's median (all its faults) / an in-process variant's median for one fault kind
    res["ratios"] = {}
    for mode in ("process", "torchrun"):
        r = res["modes"].get(mode)
        if not r:
            continue
        base = r["all"]["first_step_s"]["median"]
        res["ratios"][mode] = {"baseline_median_s": base}
        for variant in ("inprocess", "inprocess-asis"):
            ip = res["modes"].get(variant)
            if ip:
                res["ratios"][mode][variant] = {
                    kind: (base / ip[kind]["first_step_s"]["median"] if base and ip[kind]["first_step_s"]["median"]
                           else None) for kind in ("kill", "raise")}
    for r in res["modes"].values():
        r.pop("dir", None)
    md = markdown(res)
    print(md)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
