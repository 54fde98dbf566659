"""Side-by-side launcher benchmark: hyperpodrun vs torchrun on the same script (scripts/bench/workers/bench_worker.py).

Scenarios (every run of every scenario alternates the launchers, so drift hits both alike):
  startup          launch -> every rank's first line (before `import torch`), and
                   launch -> every rank past init_process_group.
  restart-term     --max-restarts 1; rank 1 exits 1 in generation 0 at a time it records; the other ranks
                   exit on SIGTERM (Python's default). Failure -> every rank of generation 1 at its first
                   line, and past init_process_group.
  restart-term-unshared
                   the same, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of both launchers:
                   stock torchrun then lets rank 0 host a fresh store per attempt instead of reusing its
                   agent's store, whose stale keys make its restarted gloo group fail to form (pytorch
                   issue 135712). hyperpodrun does not read the variable (its workers always get a fresh
                   agent-hosted store per generation).
  restart-ignore   like restart-term, but every rank ignores SIGTERM, and both launchers get
                   --shutdown-timeout 2.

All times come from timestamps the workers write to files (time.time(), same machine), plus the launch
time taken right before the launcher is started. Prints a markdown table, then the JSON (or writes it to
--json).

    .venv/bin/python scripts/bench/launcher_bench.py --runs 5
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
WORKER = os.path.join(HERE, "workers", "bench_worker.py")
SCENARIOS = ("startup", "restart-term", "restart-term-unshared", "restart-ignore")




def launcher_argv(launcher: str, exe: str, scenario: str, nproc: int, log_dir: str) -> list[str]:
    argv = [exe, "--standalone", "--nproc-per-node", str(nproc)]
    if scenario != "startup":
        argv += ["--max-restarts", "1"]
    if scenario == "restart-ignore":
        argv += ["--shutdown-timeout", "2"]
    if launcher == "hyperpodrun":
        argv += ["--log-dir", log_dir]
    return argv + [WORKER]


def read_records(out: str) -> dict[tuple[int, int], dict[str, Any]]:
    """(generation, rank) -> {'pid':..., event: time} (the latest process of that rank in that generation)."""
    recs: dict[tuple[int, int], dict[str, Any]] = {}
    for path in glob.glob(os.path.join(out, "g*_r*_p*.txt")):
        m = re.search(r"g(\d+)_r(\d+)_p(\d+)\.txt$", path)
        assert m
        key = (int(m.group(1)), int(m.group(2)))
        rec: dict[str, Any] = {"pid": int(m.group(3))}
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2:
                    rec[parts[0]] = float(parts[1])
        recs[key] = rec
    return recs


def kill_leftovers(recs: dict[tuple[int, int], dict[str, Any]]) -> int:
    """SIGKILL any recorded worker that is still alive (a launcher that left orphans); returns how many."""
    n = 0
    for rec in recs.values():
        try:
            with open(f"/proc/{rec['pid']}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == b"Z":
            continue
        try:
            os.kill(rec["pid"], signal.SIGKILL)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def one_run(launcher: str, exe: str, scenario: str, nproc: int, workdir: str, timeout: float,
            fail_after: float) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix=f"{launcher}-{scenario}-", dir=workdir)
    env = dict(os.environ, BENCH_OUT=out, OMP_NUM_THREADS="1",
               **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if scenario == "restart-term-unshared" else {}),
               BENCH_MODE="startup" if scenario == "startup" else "restart",
               BENCH_IGNORE_TERM="1" if scenario == "restart-ignore" else "0", BENCH_FAIL_AFTER=str(fail_after))
    argv = launcher_argv(launcher, exe, scenario, nproc, os.path.join(out, "logs"))
    console = open(os.path.join(out, "console.log"), "wb")
    t_launch = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        code: Optional[int] = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    t_end = time.time()
    console.close()
    recs = read_records(out)
    leftovers = kill_leftovers(recs)
    res: dict[str, Any] = {"launcher": launcher, "scenario": scenario, "exit_code": code,
                           "job_s": t_end - t_launch, "workers_left_running": leftovers, "dir": out}

    def all_of(gen: int, event: str) -> Optional[float]:
        times = [recs.get((gen, r), {}).get(event) for r in range(nproc)]
        return None if any(t is None for t in times) else max(times)  # type: ignore[type-var]

    if scenario == "startup":
        top, init = all_of(0, "top"), all_of(0, "init")
        res["first_line_s"] = None if top is None else top - t_launch
        res["pg_ready_s"] = None if init is None else init - t_launch
    else:
        fail = recs.get((0, 1), {}).get("fail")
        top, init = all_of(1, "top"), all_of(1, "init")
        res["first_line_s"] = None if fail is None or top is None else top - fail
        res["pg_ready_s"] = None if fail is None or init is None else init - fail
    res["timed_out"] = code is None
    # completed: the launcher exited 0 and every rank got past init_process_group (in the last generation)
    res["ok"] = code == 0 and res["first_line_s"] is not None and res["pg_ready_s"] is not None
    return res


def median(values: list[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for sc in SCENARIOS:
        per: dict[str, Any] = {}
        for la in ("hyperpodrun", "torchrun"):
            rs = [r for r in results if r["scenario"] == sc and r["launcher"] == la]
            if not rs:
                continue
            per[la] = {
                "runs": len(rs),
                "ok": sum(1 for r in rs if r["ok"]),
                "first_line_s": {"median": median([r["first_line_s"] for r in rs]),
                                 "min": min((r["first_line_s"] for r in rs if r["first_line_s"] is not None),
                                            default=None),
                                 "max": max((r["first_line_s"] for r in rs if r["first_line_s"] is not None),
                                            default=None)},
                "pg_ready_s": {"median": median([r["pg_ready_s"] for r in rs]),
                               "min": min((r["pg_ready_s"] for r in rs if r["pg_ready_s"] is not None),
                                          default=None),
                               "max": max((r["pg_ready_s"] for r in rs if r["pg_ready_s"] is not None),
                                          default=None)},
                "job_s": {"median": median([r["job_s"] for r in rs])},
                "timed_out": sum(1 for r in rs if r["timed_out"]),
                "workers_left_running": sum(r["workers_left_running"] for r in rs),
            }
        if per:
            summary[sc] = per
    return summary


def markdown(summary: dict[str, Any]) -> str:
    label = {"startup": "job start-up: launch ->",
             "restart-term": "restart, peers exit on SIGTERM: failure ->",
             "restart-term-unshared": "restart, peers exit on SIGTERM, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: failure ->",
             "restart-ignore": "restart, peers ignore SIGTERM, --shutdown-timeout 2: failure ->"}
    lines = ["| scenario | measured until every rank ... | hyperpodrun median (min-max) s | "
             "torchrun median (min-max) s | torchrun / hyperpodrun | jobs completed (hyperpodrun / torchrun) |",
             "|---|---|---|---|---|---|"]
    for sc, per in summary.items():
        h, t = per.get("hyperpodrun"), per.get("torchrun")
        for metric, what in (("first_line_s", "printed its first line"),
                             ("pg_ready_s", "returned from init_process_group")):
            def cell(x: Optional[dict[str, Any]]) -> str:
                if not x:
                    return "-"
                m = x[metric]
                return f"{fmt(m['median'])} ({fmt(m['min'])}-{fmt(m['max'])})"
            ratio = "n/a"
            if h and t and h[metric]["median"] and t[metric]["median"] is not None:
                ratio = f"{t[metric]['median'] / h[metric]['median']:.2f}x"
            ok = f"{h['ok'] if h else '-'}/{h['runs'] if h else '-'} / {t['ok'] if t else '-'}/{t['runs'] if t else '-'}"
            lines.append(f"| {sc} | {label[sc]} {what} | {cell(h)} | {cell(t)} | {ratio} | {ok} |")
    return "\n".join(lines)


def source_version() -> Optional[str]:
    """The commit the launcher ran from (`+dirty` when the work tree differs), if this is a git checkout."""
    root = os.path.dirname(os.path.dirname(HERE))
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in text.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs per launcher and scenario (median over these)")
    p.add_argument("--nproc", type=int, default=4, help="workers (--nproc-per-node)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ",".join(SCENARIOS))
    p.add_argument("--fail-after", type=float, default=0.5, help="seconds after the first barrier rank 1 fails")
    p.add_argument("--timeout", type=float, default=180, help="seconds before one launcher run is killed")
    p.add_argument("--json", default=None, help="write the JSON here instead of printing it after the table")
    p.add_argument("--keep", action="store_true", help="keep the per-run directories (timestamps, console logs)")
    args = p.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; pick from {', '.join(SCENARIOS)}")
    exes = {"hyperpodrun": find_launcher("hyperpodrun"), "torchrun": find_launcher("torchrun")}
    workdir = tempfile.mkdtemp(prefix="launcher-bench-")
    load_start = os.getloadavg()
    source = source_version()
    results: list[dict[str, Any]] = []
    try:
        for sc in scenarios:
            for i in range(args.runs):
                order = ["hyperpodrun", "torchrun"] if i % 2 == 0 else ["torchrun", "hyperpodrun"]
                for la in order:
                    r = one_run(la, exes[la], sc, args.nproc, workdir, args.timeout, args.fail_after)
                    r["round"] = i
                    results.append(r)
                    print(f"# {sc:<15} run {i + 1}/{args.runs} {la:<12} exit={r['exit_code']} "
                          f"first_line={fmt(r['first_line_s'])}s pg_ready={fmt(r['pg_ready_s'])}s "
                          f"job={r['job_s']:.3f}s left_running={r['workers_left_running']}",
                          file=sys.stderr, flush=True)
                    if not args.keep and r["ok"]:
                        shutil.rmtree(r["dir"], ignore_errors=True)
                        r["dir"] = None
    finally:
        if not args.keep and not any(r.get("dir") for r in results):
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results)
    kept = [r["dir"] for r in results if r.get("dir")]
    for r in results:  # the JSON names a kept run directory relative to the work dir printed below
        r["dir"] = os.path.basename(r["dir"]) if r.get("dir") else None
    doc = {"command": " ".join(["scripts/bench/launcher_bench.py", *sys.argv[1:]]), "source": source,
           "machine": machine(),
           "loadavg_1_5_15min": {"start": load_start, "end": os.getloadavg()},
           "nproc_per_node": args.nproc, "runs": args.runs, "fail_after_s": args.fail_after,
           "summary": summary, "results": results}
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    else:
        print()
        print(json.dumps(doc, indent=2))
    if kept:
        print(f"# runs that did not complete keep their timestamps and console logs under {workdir}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
