"""Framework benchmark: Lightning and the Hugging Face Trainer with hyperpodrun's callbacks, beside the same script
with HPWrapper only and beside torchrun with the framework's own disk checkpoints, every row in one invocation.

Each row is the same training script, scripts/bench/workers/framework_worker.py (its docstring says how each row
is written: `none` HPWrapper only, `outside` the callback with the module built once outside the wrapped
function, `inside` the callback with the module built inside it - the README's pattern -, `torchrun` plain torchrun
with the framework's checkpoints every --ckpt-every steps), run as its own job. The hyperpodrun rows get the
launcher's default flags for `--inprocess-restart`; a SIGKILL job also gets `--standby-workers 1
--standby-prerun auto` (this script's --standby-prerun: with auto the standby runs the script ahead to the
wrapped function, so that the `none` and `outside` rows' module is built before the kill; the worker's top reads
no rank for that), and `--standby-workers 0` rows are added with --no-standby. Faults as in state_tier.py: an exception (`raise`) or a
SIGKILL (`kill`) between backward and the optimizer step. "killed rank from" says what served each killed rank:
a standby that ran the script ahead (`standby, ran ahead`), one that waited before it, a warm fork or a cold
start - and why the standbys did not run it ahead, where they gave up.

Measured per job (state_tier.py's analysis of the worker's records): fault -> first completed step (median,
min-max), split into fault -> the function entered again, -> training started (after the callback's restore),
-> first step done; steps retrained per fault; the steady step (mean interval between completed steps, leaving
out warm-up, the first 2 steps after a fault and the step before one) and its ratio to the `none` row's in the
same invocation (the cost of the callback's save() after every step); the model's construction time.

    .venv/bin/python scripts/bench/frameworks.py --size tiny --frameworks lightning,hf --kinds raise \\
        --faults 2 --nproc 2 --out DIR                                     # CPU, gloo
    python3 scripts/bench/frameworks.py --size 0.6b --frameworks lightning,hf --kinds raise,kill \\
        --faults 3 --out DIR                                               # one GPU
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import state_tier as st  # noqa: E402
from _common import find_launcher  # noqa: E402

WORKER = HERE / "workers" / "framework_worker.py"
ROWS = ("none", "outside", "inside", "torchrun")
LABELS = {
    "none": "`HPWrapper` only, module built outside, no callback (restarts at step 0)",
    "outside": "callback (default), module built once outside the function",
    "inside": "callback (default), module built inside the function (README pattern)",
    "torchrun": "torchrun, the framework's own checkpoints",
}


def command(fw: str, row: str, kind: str, a: argparse.Namespace, out: Path, logs: Path, standby: bool) -> list[str]:
    worker = [str(WORKER), "--framework", fw, "--row", row, "--size", a.size, "--kind", kind, "--faults",
              str(a.faults), "--fault-every", str(a.fault_every), "--fault-gap",
              str(a.kill_gap if kind == "kill" else 0.0), "--warmup", str(a.warmup), "--tail", str(a.tail),
              "--ckpt-every", str(a.ckpt_every), "--loader-workers", str(a.loader_workers), "--build", a.build, "--arm-timeout",
              str(a.arm_timeout), "--out", str(out)]
    if row == "torchrun":
        return [find_launcher("torchrun"), "--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts",
                str(a.faults), "--monitor-interval", "0.1", *worker]
    if kind == "kill":
        worker.append("--gate")
    extra = ["--standby-workers", "0"] if not standby else \
        ["--standby-workers", "1", "--standby-prerun", a.standby_prerun] if kind == "kill" else []
    return [find_launcher("hyperpodrun"), "--nproc_per_node", str(a.nproc), "--inprocess-restart", *extra,
            "--log-dir", str(logs), "--rdzv-id", "job", "--master-port", str(st.free_port()), *worker]


def construction(jobdir: Path) -> Optional[float]:
    """The median seconds of the model's construction in this job (the worker's `built` records)."""
    took = [r["s"] for r in st.read_records(jobdir / "records") if r["ev"] == "built" and "s" in r]
    return statistics.median(took) if took else None


def served(jobdir: Path) -> dict[str, Any]:
    """What served each killed rank of a job - a standby that ran the script ahead (--standby-prerun), a standby
    that waited before it, a warm fork, a cold start - and why the standbys gave up running it ahead, if they did
    (the launcher's events)."""
    ev = st.read_events(jobdir / "logs")
    ahead = {e.get("pid") for e in ev if e.get("event") == "standby_ready" and e.get("prerun")}
    by = Counter("standby, ran ahead" if e.get("pid") in ahead else str(e.get("source")) for e in ev
                 if e.get("event") == "worker_start" and e.get("generation", 0) > 0)
    return {"killed_rank_from": dict(by),
            "prerun_gave_up": next((e.get("why") for e in ev if e.get("event") == "standby_prerun"), None)}


def table(summary: dict[str, Any]) -> str:
    meta = summary["meta"]
    lines = ["# Frameworks: Lightning and the Hugging Face Trainer, by how the script is written", "",
             f"Machine: {st.machine_line(meta['machine'])}.", "", f"Command: `{meta['command']}`", "",
             f"{meta['nproc']} rank(s), model size {meta['size']}, made on the {meta.get('build', 'cpu')}; "
             f"{meta['faults']} faults per job. Seconds; median "
             "(min-max) over the faults. \"vs none\": the row's mean steady step over the `none` row's (same "
             "framework, same fault kind, same invocation).", ""]
    for fw, jobs in summary["frameworks"].items():
        lines += [f"## {fw}", "", "| row | fault | faults | fault -> first step | -> entered again | -> training "
                  "(restored) | first step | retrained | restored_from | steady step | vs none | build | "
                  "killed rank from |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for j in jobs:
            label = f"{j['label']}: {LABELS[j['row']]}"
            if j.get("skipped"):
                lines.append(f"| {label} | {j['kind']} | skipped: {j['skipped']} |" + " |" * 10)
                continue
            got = sum(1 for f in j["faults"] if f["fault_to_first_s"] is not None)
            status = "" if j["ok"] else f" (exit {j['exit_code']}{', timed out' if j['timed_out'] else ''})"
            rf = ", ".join(f"{k} {v}" for k, v in sorted(j["restored_from"].items())) or "-"
            vs = st.fmt(j.get("steady_vs_none"), 3) + "x" if j.get("steady_vs_none") else "-"
            from_ = ", ".join(f"{k} {v}" for k, v in sorted((j.get("killed_rank_from") or {}).items())) or "-"
            if j.get("prerun_gave_up"):
                from_ += f" (not run ahead: {j['prerun_gave_up']})"
            lines.append(f"| {label} | {j['kind']} | {got}/{j['faults_expected']}{status} | "
                         f"{st.fmt_spread(j['fault_to_first_s'])} | {st.fmt(j['to_enter_s']['median'])} | "
                         f"{st.fmt(j['to_state_s']['median'])} | {st.fmt(j['first_step_s']['median'])} | "
                         f"{','.join(str(x) for x in j['retrained']) or '-'} | {rf} | "
                         f"{st.fmt(j['steady_step_s'], 4)} | {vs} | {st.fmt(j.get('build_s'), 2)} | "
                         f"{from_ if j['kind'] == 'kill' else '-'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def write(summary: dict[str, Any], out: Path) -> None:
    for jobs in summary["frameworks"].values():
        for j in jobs:
            if j.get("skipped"):
                continue
            base = next((o for o in jobs if not o.get("skipped") and o["label"] == "none" and o["kind"] == j["kind"]),
                        None)
            j["steady_vs_none"] = (j["steady_step_s"] / base["steady_step_s"]
                                   if base and base.get("steady_step_s") and j.get("steady_step_s") else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "table.md").write_text(table(summary))


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = st.OneLineParser(prog="frameworks.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="lightning,hf")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--kinds", default="raise,kill")
    ap.add_argument("--size", default="tiny", choices=("tiny", "0.6b"))
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--fault-every", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tail", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--loader-workers", type=int, default=2)
    ap.add_argument("--build", default="cpu", choices=("cpu", "device"),
                    help="where the worker makes the module: on the host (moved by the framework) or on the GPU")
    ap.add_argument("--kill-gap", type=float, default=1.0)
    ap.add_argument("--arm-timeout", type=float, default=30.0)
    ap.add_argument("--no-standby", default="", help="rows whose SIGKILL job also runs with --standby-workers 0 "
                    "(e.g. outside)")
    ap.add_argument("--standby-prerun", default="auto", choices=("auto", "off"),
                    help="what the SIGKILL jobs' standbys do: run the script ahead to the wrapped function (auto), or "
                    "wait before it (off)")
    ap.add_argument("--torchrun-kinds", default="raise", help="fault kinds of the torchrun row (every worker "
                    "restarts either way)")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for name, allowed in (("frameworks", ("lightning", "hf")), ("rows", ROWS), ("kinds", ("raise", "kill", "none")),
                          ("torchrun_kinds", ("raise", "kill", "none"))):
        items = [x for x in getattr(a, name).split(",") if x]
        if not items or any(x not in allowed for x in items):
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)!r}: pick from {','.join(allowed)}")
        setattr(a, name, items)
    a.no_standby = [x for x in a.no_standby.split(",") if x]
    a.step_sleep = 0.0
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    (out / "jobs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary: dict[str, Any] = {
        "meta": {"command": " ".join(["python", "scripts/bench/frameworks.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
                 "machine": st.machine(), "size": a.size, "nproc": a.nproc, "faults": a.faults,
                 "build": a.build, "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "frameworks": {fw: [] for fw in a.frameworks}}
    try:
        for fw in a.frameworks:
            for kind in a.kinds:
                plan = [(row, True) for row in a.rows if row != "torchrun" or kind in a.torchrun_kinds]
                if kind == "kill":   # a standby serves only a killed rank
                    plan += [(row, False) for row in a.no_standby if row in a.rows and row != "torchrun"]
                for row, standby in plan:
                    label = row if standby else f"{row}-nostandby"
                    jobs = summary["frameworks"][fw]
                    if a.budget is not None and time.time() - t0 > a.budget:
                        jobs.append({"row": row, "label": label, "kind": kind, "skipped": "the --budget was spent"})
                        continue
                    jobdir = out / "jobs" / f"{fw}-{label}-{kind}"
                    if jobdir.exists():
                        shutil.rmtree(jobdir)

                    def argv_of(o: Path, logs: Path, fw: str = fw, row: str = row, kind: str = kind,
                                standby: bool = standby) -> list[str]:
                        return command(fw, row, kind, a, o, logs, standby)
                    res = st.run_job(row, kind, fw, a, jobdir, command=argv_of,
                                     gated=kind == "kill" and row != "torchrun")
                    res.update(label=label, build_s=construction(jobdir), **served(jobdir))
                    jobs.append(res)
                    write(summary, out)
    finally:
        summary["meta"]["total_s"] = round(time.time() - t0, 1)
        write(summary, out)
    print((out / "table.md").read_text())
    ran = [j for jobs in summary["frameworks"].values() for j in jobs if not j.get("skipped")]
    return 0 if ran and all(j["ok"] for j in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
