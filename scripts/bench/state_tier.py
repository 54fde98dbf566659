"""State-tier benchmark: what recovery and the steady step cost depending on how the training script is written
(issue 25), every row of the table in one invocation, for a bf16 MLP and a GPT-style decoder.

Each row is the same training script, scripts/bench/workers/state_tier_worker.py, written one way (--row there; its
docstring says how each is written), run as its own job:

  none     hyperpodrun --inprocess-restart; HPWrapper only, model and optimizer built outside the function,
           no CheckpointManager
  readme   the same launcher; CheckpointManager() (default arguments), model and optimizer outside, DDP
           wrapped inside before restore() and passed as the state (the README's wrapping)
  inside   CheckpointManager() default, model and optimizer built inside the function (the product note),
           the module as the state, DDP made after restore()
  bare     CheckpointManager() default, model outside, DDP made after restore(), the bare module as the state
  nvrx     NVIDIA Resiliency Extension 0.7 inprocess.Wrapper, last_call_wait=0.1 s, model and optimizer kept
           in the process (built outside), no reload from disk; under torchrun. Skipped, with the reason, where
           nvidia_resiliency_ext does not import, and for --kind kill (a SIGKILLed rank cannot come back
           in-process under NVRx: torchrun restarts every worker)

The hyperpodrun rows get the launcher's default flags for `--inprocess-restart` (nothing about standbys,
heartbeats or timeouts; only where its logs go and which port it uses). Faults are injected by the worker
itself (--faults per job, after backward and before optimizer.step(), in generation g once it has completed
--fault-every + g % 3 steps, plus --warmup in the first generation, and --fault-gap seconds have passed since
its first step): `raise` (a RuntimeError), `kill` (SIGKILL of its own process) or `none` (no fault: the
steady step alone). Rows readme/inside/bare call save(step + 1, state) after every optimizer step. A SIGKILL
fires only once the launcher could serve it the fast way (this script reads hyperpodrun's event log while
the job runs and tells the worker when the warm spawner and, where the launcher keeps any, every local
rank's standby are ready; after --arm-timeout it fires anyway): the figure is the launcher's recovery, not
a standby still starting; what served each kill (standby, warm fork, cold start) is in the table.

Measured per job, from the records the worker writes (one JSON line per completed step, per fault, per entry
of the wrapped function; time.time() after the compute stream is synchronised):
  - fault -> first completed step: from the fault's time (written right before the raise / SIGKILL) to the
    moment every rank has completed its first step after it; median, min, max over the faults. Split into
    fault -> function entered again, -> state in place (after restore()), -> first step done;
  - steps retrained per fault (the step in progress at the fault minus the step the next generation started
    from, at least 0) and what restore() did on each rank (CheckpointManager.restored_from, restore_phases);
  - the steady step: the mean interval between consecutive completed steps of a generation (the mean, not the
    median: a snapshot every k steps costs some steps only, which a median hides; the median is kept too), leaving out
    the warm-up steps of the first generation, the first 2 steps of every later one (the first steps after a
    fault) and the step before each fault; its ratio to the `none` row of the same fault kind (with
    --kind none: the cost of save() after every step with the default CheckpointManager());
  - NVRx's fault -> first step median over each row's, where NVRx ran ("x faster than NVRx").

Output: DIR/summary.json (every job, every fault; the command and the machine), DIR/table.md (also printed),
DIR/jobs/<model>-<row>-<kind>/ (records/: the workers' JSONL; launcher.log: the launcher's console; logs/:
hyperpodrun's run directory with its event log). Both files are rewritten after every job, so a run cut
short keeps what it measured. Every job has a time limit (--job-timeout) and the invocation may have one
(--budget: jobs that would start after it are listed as not run). Every process a job starts carries a tag
in its environment; after the job (also at its time limit, or when this script gets SIGTERM/SIGINT) every
process still carrying it is killed by pid, found through /proc/<pid>/environ.

    .venv/bin/python scripts/bench/state_tier.py --size tiny --model mlp --rows none,inside --kinds raise \\
        --faults 2 --nproc 2 --out DIR                                   # CPU, gloo, about 30 s
    python3 scripts/bench/state_tier.py --size 1b --model mlp,gpt --kinds none,raise,kill \\
        --only kill=none,readme,inside --only none=none,readme,inside,bare --out DIR   # one H200
    (scripts/bench/gpu.sh state-tier: the whole GPU sequence in one go)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import find_launcher  # noqa: E402

WORKER = HERE / "workers" / "state_tier_worker.py"
ROWS = ("none", "readme", "inside", "bare", "nvrx")
KINDS = ("raise", "kill", "none")
MODELS = ("mlp", "gpt")
TAG_VAR = "STATE_TIER_TAG"
LABELS = {
    "none": "`HPWrapper` only; model and optimizer built outside the function; no `CheckpointManager`",
    "readme": "`CheckpointManager()`; model and optimizer outside; DDP wrapped inside before `restore()` and "
              "passed as the state (the README)",
    "inside": "`CheckpointManager()`; model and optimizer built inside the function (the product note); DDP "
              "after `restore()`",
    "bare": "`CheckpointManager()`; model and optimizer outside; DDP made after `restore()`, the bare module as "
            "the state",
    "nvrx": "NVRx 0.7 `inprocess.Wrapper`, `last_call_wait` 0.1 s; model and optimizer outside, no reload "
            "(torchrun)",
}
MODEL_TEXT = {
    ("mlp", "1b"): "bf16 MLP, 16 x Linear(8192, 8192) + GELU, batch 8192, fused AdamW",
    ("gpt", "1b"): "bf16 GPT-style decoder, vocab 32768, d 2048, 20 layers, 16 heads, 8 x 1024 tokens, tied "
                   "head, fused AdamW",
    ("mlp", "tiny"): "fp32 MLP, 2 x Linear(32, 32) + GELU, batch 16, AdamW (CPU)",
    ("gpt", "tiny"): "fp32 GPT-style decoder, vocab 64, d 16, 2 layers, 2 heads, 4 x 8 tokens, AdamW (CPU)",
}


class Stop(Exception):
    """SIGTERM / SIGINT to this script: end the job in flight, write what is done, exit."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit 2."""

    def error(self, message: str) -> None:   # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


# ------------------------------------------------------------------------------------------ helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": statistics.median(xs) if xs else None, "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_spread(s: dict[str, Any], digits: int = 3) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def nvrx_problem() -> Optional[str]:
    """Why the NVRx row cannot run here (None: it can)."""
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except Exception as exc:   # ImportError, or a probe failing at import
        return f"nvidia-resiliency-ext does not import here ({type(exc).__name__}: {str(exc)[:120]})"
    return None


def nvrx_version() -> Optional[str]:
    try:
        from importlib.metadata import version
        return version("nvidia-resiliency-ext")
    except Exception:
        return None


def machine() -> dict[str, Any]:
    """The machine in words: GPU names from nvidia-smi (no CUDA context in this process), torch, Python."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    info["nvrx"] = nvrx_version()
    return info


def machine_line(m: dict[str, Any]) -> str:
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    return (f"{gpus}; {m.get('cpus')} CPUs; Python {m.get('python')}; torch {m.get('torch')}"
            f"{' (CUDA ' + m['cuda'] + ')' if m.get('cuda') else ''}; NVRx {m.get('nvrx') or 'not installed'}")


# ------------------------------------------------------------------------------------------ processes
def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries this job's tag (read from /proc/<pid>/environ)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(name))
    return found


def sweep(tag: str) -> int:
    """SIGKILL, by pid, every process of the job still alive; returns how many there were."""
    pids = tagged_pids(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(pids)


def stop_launcher(proc: subprocess.Popen) -> None:
    """The launcher's own process group: SIGTERM (it forwards to its workers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------------------ one job
def job_command(row: str, a: argparse.Namespace, kind: str, model: str, out: Path, logs: Path) -> list[str]:
    worker = [str(WORKER), "--row", row, "--model", model, "--size", a.size, "--kind", kind,
              "--faults", str(a.faults), "--fault-every", str(a.fault_every), "--fault-gap",
              str(a.fault_gap if a.fault_gap is not None else (a.kill_gap if kind == "kill" else 0.0)),
              "--warmup", str(a.warmup), "--tail", str(a.steady_steps if kind == "none" else a.tail),
              "--step-sleep", str(a.step_sleep), "--arm-timeout", str(a.arm_timeout), "--out", str(out)]
    if kind == "kill" and row != "nvrx":
        worker.append("--gate")
    if row == "nvrx":
        return [find_launcher("torchrun"), "--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", "0",
                "--monitor-interval", "0.1", *worker]
    return [find_launcher("hyperpodrun"), "--nproc_per_node", str(a.nproc), "--inprocess-restart",
            "--log-dir", str(logs), "--rdzv-id", "job", "--master-port", str(free_port()), *worker]


def run_job(row: str, kind: str, model: str, a: argparse.Namespace, jobdir: Path,
            command: Optional[Any] = None, gated: Optional[bool] = None) -> dict[str, Any]:
    """One job; `command(out, logs)` gives its argv (default: this benchmark's worker) and `gated` whether the
    driver writes the worker's SIGKILL gate (default: a kill job under hyperpodrun)."""
    out, logs = jobdir / "records", jobdir / "logs"
    out.mkdir(parents=True)
    tag = uuid.uuid4().hex
    argv = command(out, logs) if command is not None else job_command(row, a, kind, model, out, logs)
    if gated is None:
        gated = kind == "kill" and row != "nvrx"
    env = dict(os.environ, **{TAG_VAR: tag}, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    shown = " ".join(Path(x).name if x.startswith("/") and not x.startswith(str(jobdir)) else x for x in argv)
    print(f"[{model} {row} {kind}] limit {a.job_timeout:.0f}s: {shown}", file=sys.stderr, flush=True)
    t0 = time.time()
    code: Optional[int] = None
    timed_out = interrupted = False
    with open(jobdir / "launcher.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + a.job_timeout
            while (code := proc.poll()) is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, a.job_timeout)
                if gated:
                    write_gate(out, logs, a.nproc)
                time.sleep(0.1)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_launcher(proc)
        except Stop:
            interrupted = True
            stop_launcher(proc)
        finally:
            left = sweep(tag)
    wall = time.time() - t0
    res = analyse(read_records(out), a.nproc, read_events(logs), kind, a.warmup)
    expected = a.faults if kind != "none" else 0
    res.update(model=model, row=row, kind=kind, exit_code=code, timed_out=timed_out, wall_s=round(wall, 2),
               processes_left=left, faults_expected=expected, command=shown)
    res["ok"] = (code == 0 and len(res["faults"]) == expected
                 and all(f["fault_to_first_s"] is not None for f in res["faults"]))
    if not res["ok"]:
        res["log_tail"] = (jobdir / "launcher.log").read_text(errors="replace")[-2500:]
    print(f"[{model} {row} {kind}] exit {code}{' (timed out)' if timed_out else ''} after {wall:.1f}s; "
          f"fault -> first step {fmt_spread(res['fault_to_first_s'])} s; steady {fmt(res['steady_step_s'], 4)} s",
          file=sys.stderr, flush=True)
    res["stopped"] = interrupted
    return res


def write_gate(out: Path, logs: Path, nproc: int) -> None:
    """For a SIGKILL job: tell the worker (OUT/gate.json) whether a killed rank would now be served the fast way
    - the warm spawner ready and, where the launcher keeps standbys, every local rank's standby ready - so
    that each fault measures the launcher's recovery rather than a standby still starting (the worker waits
    for it up to --arm-timeout, then fires anyway; the table says what served each kill)."""
    ev = read_events(logs)
    per_rank = next((e.get("per_local_rank") for e in ev if e.get("event") == "standby_workers"), None)
    ready = {e.get("pid") for e in ev if e.get("event") == "standby_ready"}
    if per_rank is None:
        per_rank = 1 if ready else 0
    gone = {e.get("pid") for e in ev if e.get("event") == "standby_lost"
            or (e.get("event") == "worker_start" and e.get("source") == "standby")}
    gate = {"warm": any(e.get("event") == "warm_ready" for e in ev), "wanted": int(per_rank or 0) * nproc,
            "available": len(ready - gone), "t": time.time()}
    tmp = out / "gate.json.tmp"
    tmp.write_text(json.dumps(gate))
    os.replace(tmp, out / "gate.json")


# ------------------------------------------------------------------------------------------ analysis
def read_records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for path in sorted(out.glob("rank*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue   # a torn last line
            if isinstance(rec, dict) and "ev" in rec:
                recs.append(rec)
    return sorted(recs, key=lambda r: r["t"])


def read_events(logs: Path) -> list[dict[str, Any]]:
    evs = []
    for path in logs.glob("*/node*.events.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                evs.append(json.loads(line))
            except ValueError:
                continue
    return sorted((e for e in evs if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))),
                  key=lambda e: e["ts"])


def steady_intervals(steps: list[dict[str, Any]], faults: list[dict[str, Any]], warmup: int) -> list[float]:
    """Intervals between consecutive completed steps of one rank's generation, without the warm-up of the first
    generation, the first 2 steps of a later one and the step before a fault of that generation."""
    out = []
    fault_gens = {(f["rank"], f["gen"]) for f in faults}
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for s in steps:
        groups.setdefault((s["rank"], s["gen"], s["pid"]), []).append(s)
    for (rank, gen, _), seq in groups.items():
        seq.sort(key=lambda s: s["step"])
        skip = warmup if gen == 0 else 2
        pairs = list(zip(seq, seq[1:]))[skip:]
        if (rank, gen) in fault_gens or any(f["gen"] == gen for f in faults):
            pairs = pairs[:-1]
        out += [b["t"] - a["t"] for a, b in pairs if b["step"] == a["step"] + 1]
    return out


def analyse(recs: list[dict[str, Any]], nproc: int, events: list[dict[str, Any]], kind: str,
            warmup: int = 3) -> dict[str, Any]:
    steps = [r for r in recs if r["ev"] == "step"]
    entries = [r for r in recs if r["ev"] == "entry"]
    enters = [r for r in recs if r["ev"] == "enter"]
    faults = sorted((r for r in recs if r["ev"] == "fault"), key=lambda r: r["t"])
    params = next((r["params"] for r in entries if r.get("params")), None)
    per_fault = []
    for i, f in enumerate(faults):
        later = [e for e in entries if e["gen"] > f["gen"] and e["t"] > f["t"]]
        nxt_gen = min((e["gen"] for e in later), default=None)
        mine = [e for e in later if e["gen"] == nxt_gen]
        firsts, entered, placed = [], [], []
        for r in range(nproc):
            after = [s["t"] for s in steps if s["rank"] == r and s["gen"] > f["gen"] and s["t"] > f["t"]]
            firsts.append(min(after) if after else None)
            en = [e["t"] for e in enters if e["rank"] == r and e["gen"] > f["gen"] and e["t"] > f["t"]]
            entered.append(min(en) if en else None)
            pl = [e["t"] for e in mine if e["rank"] == r]
            placed.append(min(pl) if pl else None)

        def last(ts: list[Optional[float]]) -> Optional[float]:
            """When every rank had got there, in seconds after the fault (None: some rank never did)."""
            got = [t for t in ts if t is not None]
            return max(got) - f["t"] if got and len(got) == len(ts) else None
        start = min((e["start"] for e in mine), default=None)
        phases = [e.get("restore_phases") or {} for e in mine]
        restore_s = max((sum(p.values()) for p in phases), default=None) if any(phases) else None
        served = [e.get("source") for e in events if e.get("event") == "worker_start" and e["ts"] > f["t"]
                  and (i + 1 >= len(faults) or e["ts"] < faults[i + 1]["t"])]
        first_done, in_place = last(firsts), last(placed)
        per_fault.append({
            "t": f["t"], "gen": f["gen"], "rank": f["rank"], "step": f["step"],
            "fault_to_first_s": first_done, "to_enter_s": last(entered), "to_state_s": in_place,
            "first_step_s": first_done - in_place if first_done is not None and in_place is not None else None,
            "start": start, "retrained": max(0, f["step"] - start) if start is not None else None,
            "restored_from": dict(Counter(str(e.get("restored_from")) for e in mine)),
            "restore_phases": phases, "restore_s": restore_s, "served_by": served,
            "armed": f.get("armed"), "armed_wait_s": f.get("armed_wait_s"),
        })
    intervals = steady_intervals(steps, faults, warmup)
    restored: Counter[str] = Counter()
    for pf in per_fault:
        restored.update(pf["restored_from"])
    down = [pf["fault_to_first_s"] for pf in per_fault if pf["fault_to_first_s"] is not None]
    phase_names = sorted({k for pf in per_fault for p in pf["restore_phases"] for k in p})
    return {
        "params": params, "faults": per_fault, "fault_to_first_s": spread(down),
        "to_enter_s": spread([pf["to_enter_s"] for pf in per_fault if pf["to_enter_s"] is not None]),
        "to_state_s": spread([pf["to_state_s"] for pf in per_fault if pf["to_state_s"] is not None]),
        "first_step_s": spread([pf["first_step_s"] for pf in per_fault if pf["first_step_s"] is not None]),
        "restore_s": spread([pf["restore_s"] for pf in per_fault if pf["restore_s"] is not None]),
        "restore_phases_median": {k: statistics.median([p[k] for pf in per_fault for p in pf["restore_phases"]
                                                        if k in p]) for k in phase_names},
        "retrained": [pf["retrained"] for pf in per_fault],
        "restored_from": dict(restored),
        "served_by": dict(Counter(s for pf in per_fault for s in pf["served_by"] if s)),
        "steady_step_s": statistics.mean(intervals) if intervals else None,
        "steady_step_median_s": statistics.median(intervals) if intervals else None,
        "steady_n": len(intervals), "steps_completed": len(steps),
    }


def add_ratios(jobs: list[dict[str, Any]]) -> None:
    """Per model and fault kind: steady step / the `none` row's, and NVRx's fault -> first step / each row's."""
    for j in jobs:
        if j.get("skipped"):
            continue
        same = [o for o in jobs if not o.get("skipped") and o["model"] == j["model"] and o["kind"] == j["kind"]]
        base = next((o for o in same if o["row"] == "none"), None)
        nvrx = next((o for o in same if o["row"] == "nvrx"), None)
        j["steady_vs_none"] = (j["steady_step_s"] / base["steady_step_s"]
                               if base and base["steady_step_s"] and j["steady_step_s"] else None)
        mine, theirs = j["fault_to_first_s"]["median"], nvrx["fault_to_first_s"]["median"] if nvrx else None
        j["nvrx_over_this"] = theirs / mine if mine and theirs else None


# ------------------------------------------------------------------------------------------ report
KIND_TEXT = {"none": "No fault: the steady step (the cost of save() after every step)",
             "raise": "An exception after backward, before `optimizer.step()`",
             "kill": "SIGKILL of the rank's process after backward, before `optimizer.step()` (the launcher's "
                     "default flags)"}


def table(summary: dict[str, Any]) -> str:
    """The report: per model and fault kind one table (the rows as written), then where the time of a recovery
    goes."""
    meta = summary["meta"]
    lines = ["# State tier: recovery and steady step by how the script is written", "",
             f"Machine: {machine_line(meta['machine'])}.", "", f"Command: `{meta['command']}`", "",
             f"{meta['nproc']} rank(s). Faults per job: {meta['faults']}, in generation g after "
             f"{meta['fault_every']} + g % 3 completed steps (and {meta['warmup']} warm-up steps first). Rows "
             "readme/inside/bare call `save(step + 1, state)` after every step. Seconds; median (min-max) over the "
             "faults; \"NVRx / this\": NVRx's median over this row's; \"vs `none`\": this row's mean steady step over "
             "the `none` row's in the same table.", ""]
    for model, m in summary["models"].items():
        jobs = m["jobs"]
        params = next((j.get("params") for j in jobs if j.get("params")), None)
        lines += [f"## {model}: {MODEL_TEXT.get((model, meta['size']), model)}"
                  + (f", {params / 1e9:.3g} B parameters" if params and params >= 1e8 else
                     f", {params} parameters" if params else ""), ""]
        for kind in [k for k in KINDS if any(j["kind"] == k for j in jobs)]:
            lines += [f"### {KIND_TEXT[kind]}", ""]
            rows = [j for j in jobs if j["kind"] == kind]
            if kind == "none":
                lines += ["| how the script is written | ran | steady step (intervals) | vs `none` |",
                          "|---|---|---|---|"]
            else:
                lines += ["| how the script is written | faults | fault -> first step | NVRx / this | "
                          "steps retrained | restored_from (every rank) | steady step | vs `none` |",
                          "|---|---|---|---|---|---|---|---|"]
            for j in rows:
                label = f"{j['row']}: {LABELS[j['row']]}"
                if j.get("skipped"):
                    lines.append(f"| {label} | skipped: {j['skipped']} |" + " |" * (2 if kind == "none" else 6))
                    continue
                status = "" if j["ok"] else (f" (exit {j['exit_code']}{', timed out' if j['timed_out'] else ''}"
                                             f"{', stopped' if j.get('stopped') else ''})")
                steady = f"{fmt(j['steady_step_s'], 4)}"
                vs = fmt(j.get("steady_vs_none"), 3) + "x" if j.get("steady_vs_none") else "-"
                if kind == "none":
                    lines.append(f"| {label} | {'yes' if j['ok'] else 'no'}{status} | {steady} ({j['steady_n']}) "
                                 f"| {vs} |")
                    continue
                got = sum(1 for f in j["faults"] if f["fault_to_first_s"] is not None)
                retr = ",".join(str(x) for x in j["retrained"]) if j["retrained"] else "-"
                rf = ", ".join(f"{k} {v}" for k, v in sorted(j["restored_from"].items())) \
                    if j["restored_from"] and j["row"] not in ("none", "nvrx") else "-"
                ratio = fmt(j.get("nvrx_over_this"), 2) + "x" if j.get("nvrx_over_this") else "-"
                lines.append(f"| {label} | {got}/{j['faults_expected']}{status} | "
                             f"{fmt_spread(j['fault_to_first_s'])} | {ratio} | {retr} | {rf} | {steady} | {vs} |")
            lines.append("")
        faulted = [j for j in jobs if not j.get("skipped") and j["faults"]]
        if faulted:
            lines += ["Where the time goes (medians; seconds after the fault, until every rank got there):", "",
                      "| row | fault | function entered again | state in place (after `restore()`) | `restore()` | "
                      "its phases | first step done | the first step itself | a killed rank served by |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for j in faulted:
                ph = ", ".join(f"{k} {v:.3f}" for k, v in j["restore_phases_median"].items()) or "-"
                served = ", ".join(f"{k} {v}" for k, v in sorted(j["served_by"].items())) or "-"
                lines.append(f"| {j['row']} | {j['kind']} | {fmt(j['to_enter_s']['median'])} | "
                             f"{fmt(j['to_state_s']['median'])} | {fmt(j['restore_s']['median'])} | {ph} | "
                             f"{fmt(j['fault_to_first_s']['median'])} | {fmt(j['first_step_s']['median'])} | "
                             f"{served if j['kind'] == 'kill' else '-'} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def write(summary: dict[str, Any], out: Path) -> None:
    for m in summary["models"].values():
        add_ratios(m["jobs"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "table.md").write_text(table(summary))


# ------------------------------------------------------------------------------------------ main
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = OneLineParser(prog="state_tier.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", help="mlp, gpt or mlp,gpt")
    ap.add_argument("--size", default="tiny", help="tiny (CPU, gloo) or 1b (one GPU per rank, NCCL)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ROWS)}")
    ap.add_argument("--kinds", default="raise", help="any of raise,kill,none (run in this order)")
    ap.add_argument("--only", action="append", default=[], metavar="KIND=ROWS",
                    help="run only these rows for this kind, e.g. --only kill=none,readme,inside (repeatable)")
    ap.add_argument("--nproc", default="1", help="ranks (one GPU each with --size 1b)")
    ap.add_argument("--faults", default="5", help="faults per job")
    ap.add_argument("--fault-every", default="12", help="steps between faults")
    ap.add_argument("--fault-gap", default=None,
                    help="seconds from a generation's first step before its fault may fire (default: 0, and "
                         "--kill-gap for --kind kill)")
    ap.add_argument("--kill-gap", default=None, help="--fault-gap of kill jobs (default 1 s: the agent then has a "
                    "heartbeat with the step, which its --max-step-failures guard counts by)")
    ap.add_argument("--arm-timeout", default=None,
                    help="SIGKILL jobs: seconds a due fault waits for the launcher's warm spawner and standbys to be "
                         "ready before it fires anyway (default 30)")
    ap.add_argument("--warmup", default=None, help="steps before the first fault (default 3 tiny, 4 1b)")
    ap.add_argument("--tail", default="4", help="steps of the last generation of a faulted job")
    ap.add_argument("--steady-steps", default=None, help="steps after the warm-up of a --kind none job (default 30)")
    ap.add_argument("--step-sleep", default=None,
                    help="seconds of sleep after each step (default 0.01 tiny, 0 1b: tiny steps take "
                         "microseconds)")
    ap.add_argument("--job-timeout", default=None, help="seconds per job (default 120 tiny, 150 1b)")
    ap.add_argument("--budget", default=None, help="seconds for the whole invocation: jobs that would start after "
                    "it are skipped (reported)")
    ap.add_argument("--out", required=True, help="directory for summary.json, table.md and jobs/")
    a = ap.parse_args(argv)

    def pick(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            ap.error(f"{flag} {value!r}: pick from {','.join(allowed)}")
        return list(dict.fromkeys(items))

    def number(flag: str, value: Optional[str], default: float, kind: type = int, low: float = 0,
               high: float = 10 ** 6) -> Any:
        if value is None:
            return kind(default)
        try:
            x = kind(value)
        except ValueError:
            ap.error(f"{flag} {value!r}: not {'a whole number' if kind is int else 'a number'}")
        if not (isinstance(x, int) or math.isfinite(x)) or not low <= x <= high:
            ap.error(f"{flag} {value!r}: must be between {low} and {high}")
        return x
    a.models = pick(a.model, MODELS, "--model")
    if a.size not in ("tiny", "1b"):
        ap.error(f"--size {a.size!r}: pick tiny or 1b")
    a.rows = pick(a.rows, ROWS, "--rows")
    a.kinds = pick(a.kinds, KINDS, "--kinds")
    a.only_rows = {}
    for spec in a.only:
        kind, sep, rows = spec.partition("=")
        if not sep or kind not in KINDS:
            ap.error(f"--only {spec!r}: expected KIND=ROWS with KIND one of {','.join(KINDS)}")
        a.only_rows[kind] = pick(rows, ROWS, "--only")
    tiny = a.size == "tiny"
    a.nproc = number("--nproc", a.nproc, 1, int, 1, 64)
    a.faults = number("--faults", a.faults, 5, int, 1, 100)
    a.fault_every = number("--fault-every", a.fault_every, 12, int, 1, 10000)
    a.fault_gap = None if a.fault_gap is None else number("--fault-gap", a.fault_gap, 0, float, 0, 600)
    a.kill_gap = number("--kill-gap", a.kill_gap, 1.0, float, 0, 600)
    a.arm_timeout = number("--arm-timeout", a.arm_timeout, 30.0, float, 0, 600)
    a.warmup = number("--warmup", a.warmup, 3 if tiny else 4, int, 2, 10000)
    a.tail = number("--tail", a.tail, 4, int, 1, 10000)
    a.steady_steps = number("--steady-steps", a.steady_steps, 30, int, 3, 100000)
    a.step_sleep = number("--step-sleep", a.step_sleep, 0.01 if tiny else 0.0, float, 0, 10)
    a.job_timeout = number("--job-timeout", a.job_timeout, 120 if tiny else 150, float, 5, 3600)
    a.budget = None if a.budget is None else number("--budget", a.budget, 0, float, 1, 86400)
    if not tiny:
        try:
            import torch
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            gpus = 0
        if gpus < a.nproc:
            ap.error(f"--size 1b needs one CUDA GPU per rank: {a.nproc} rank(s), {gpus} GPU(s) visible")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs").mkdir(exist_ok=True)

    def stop(signum: int, _frame: Any) -> None:
        raise Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.time()
    summary: dict[str, Any] = {
        "meta": {"command": " ".join(["python", "scripts/bench/state_tier.py", *(argv if argv is not None
                                                                                  else sys.argv[1:])]),
                 "machine": machine(), "size": a.size, "nproc": a.nproc, "faults": a.faults,
                 "fault_every": a.fault_every, "warmup": a.warmup, "tail": a.tail, "steady_steps": a.steady_steps,
                 "fault_gap": a.fault_gap, "kill_gap": a.kill_gap, "arm_timeout": a.arm_timeout, "step_sleep": a.step_sleep,
                 "job_timeout": a.job_timeout, "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "models": {m: {"jobs": []} for m in a.models}}
    problem = nvrx_problem() if "nvrx" in a.rows else None
    stopped = False
    try:
        for model in a.models:
            for kind in a.kinds:
                for row in a.only_rows.get(kind, a.rows):
                    if row not in a.rows:
                        continue
                    jobs = summary["models"][model]["jobs"]
                    skip = None
                    if row == "nvrx" and kind == "kill":
                        skip = ("NVRx's in-process Wrapper cannot survive a SIGKILL: the dead rank ends the "
                                "iteration and torchrun restarts every worker (a process-level restart)")
                    elif row == "nvrx" and problem:
                        skip = problem
                    elif stopped:
                        skip = "the benchmark was stopped"
                    elif a.budget is not None and time.time() - t0 > a.budget:
                        skip = f"the --budget of {a.budget:g} s was spent"
                    if skip:
                        jobs.append({"model": model, "row": row, "kind": kind, "skipped": skip})
                        continue
                    jobdir = out / "jobs" / f"{model}-{row}-{kind}"
                    if jobdir.exists():
                        import shutil
                        shutil.rmtree(jobdir)
                    try:
                        res = run_job(row, kind, model, a, jobdir)
                    except Stop:
                        stopped = True
                        jobs.append({"model": model, "row": row, "kind": kind,
                                     "skipped": "stopped while it ran (SIGTERM/SIGINT)"})
                        continue
                    jobs.append(res)
                    stopped = stopped or res["stopped"]
                    write(summary, out)
    finally:
        summary["meta"]["total_s"] = round(time.time() - t0, 1)
        write(summary, out)
    print((out / "table.md").read_text())
    unrun = [j for m in summary["models"].values() for j in m["jobs"] if "budget" in j.get("skipped", "")]
    if unrun:
        print(f"{len(unrun)} job(s) not run: the --budget was spent", file=sys.stderr)
    ran = [j for m in summary["models"].values() for j in m["jobs"] if not j.get("skipped")]
    return 0 if ran and all(j["ok"] for j in ran) and not stopped else 1


if __name__ == "__main__":
    sys.exit(main())
