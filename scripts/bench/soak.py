"""Chaos soak: a 2-node job (2 ranks each, CPU, gloo) on this machine under a seeded random schedule of mixed
faults for N minutes, under hyperpodrun and then under torchrun + torch.save checkpoints on the same schedule.

Each node runs in its own pid and mount namespaces with a private /dev/shm (as root, `unshare`; see
scripts/bench/soak_jobs.py), so a node's loss takes its agent, its workers and its shared memory at once. The
faults (scripts/bench/soak_faults.py): exceptions, a rank's MemoryError, SIGKILL of a rank, SIGSTOP hangs, a node
lost whole and replaced, a second fault during a recovery round, the standalone coordinator killed and started
again, a rotten snapshot slot, a full log filesystem - a fault every --mean-interval seconds on average (2/3 to
4/3 of it), each after the job recovered from the one before.

What it checks and reports (DIR/soak.json, DIR/soak.md, DIR/soak.png):
  - every fault recovered (every rank entered training again and completed a step) or ended the job with a
    documented exit code (docs/exit-codes.md) - none silently; a kind a system has no such part for is
    skipped there, and said so
  - the final state: each rank's parameters and optimizer state bitwise equal to a fault-free replay of the
    same number of steps (hyperpodrun; the world size never changes)
  - goodput: the steps of the final state times the median step time, over the wall time from the first
    entry to the last step (time lost to recoveries and to steps done twice is not goodput)
  - recovery time per fault kind (median, p95, max): fault -> every rank completed a step after re-entering
    training (the coordinator: fault -> every agent has it back, outage included)
  - threads, descriptors and RSS of the agents and of the ranks' processes, and each node's /dev/shm use,
    sampled every --sample-s and checked flat (soak_procs.flatness); nothing of the job left running or in
    /dev/shm after it

    sudo .venv/bin/python scripts/bench/soak.py --minutes 60 --seed 1 --mean-interval 30 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import soak_faults  # noqa: E402
import soak_jobs  # noqa: E402
import soak_procs  # noqa: E402
from recovery import records  # noqa: E402

#: exit codes docs/exit-codes.md gives a meaning (the job ended on purpose, with a reason said)
DOCUMENTED = {1, 2, 74, 75, 76, 77, 78, 79, 80, 81, 82} | {128 + s for s in range(1, 32)}


def sample(job: Any) -> list[dict[str, Any]]:
    """One sample of each agent, each rank's process and each node's /dev/shm (hyperpodrun's job)."""
    t, out = time.time(), []
    for n, node in job.nodes.items():
        inits = soak_procs.children(node.proc.pid)
        if not inits:
            continue
        agents = soak_procs.children(inits[0])
        use = soak_procs.usage(agents[0]) if agents else None
        if use:
            out.append({"t": t, "role": f"agent{n}", "pid": agents[0], **use})
        out.append({"t": t, "role": f"shm{n}", "pid": inits[0], "shm": soak_procs.shm_used(inits[0])})
    for r in range(soak_jobs.RANKS):
        try:
            pid = job.rank_pid(r)
        except Exception:   # between processes (a replacement starting)
            continue
        use = soak_procs.usage(pid)
        if use:
            out.append({"t": t, "role": f"rank{r}", "pid": pid, **use})
    return out


class Soak:
    """Runs one system's job through the schedule."""

    def __init__(self, job: Any, a: argparse.Namespace, sampling: bool):
        self.job, self.a, self.sampling = job, a, sampling
        self.samples: list[dict[str, Any]] = []
        self.next_sample = 0.0

    def tick(self) -> None:
        if self.sampling and time.time() >= self.next_sample:
            self.samples += sample(self.job)
            self.next_sample = time.time() + self.a.sample_s

    def pause_until(self, t: float) -> bool:
        """Until wall time t, sampling and watching the job; False if the job ended meanwhile."""
        while time.time() < t:
            self.tick()
            if self.job.ended():
                return False
            time.sleep(min(0.2, max(0.0, t - time.time())))
        return True

    def await_recovery(self, rec: dict[str, Any]) -> None:
        deadline = time.time() + self.a.fault_deadline
        while True:
            self.tick()
            if rec["kind"] == "coordinator":
                at = self.job.coordinator_recovered(rec["t"])
                if at:
                    rec["recovered_at"] = at
                    return
            elif self.job.recovered(rec["check_from"]):
                rec["recovered_at"] = time.time()
                return
            ended = self.job.ended()
            if ended:
                rec["ended"] = ended
                return
            if time.time() > deadline:
                rec["timed_out"] = True
                return
            time.sleep(0.1)

    def run(self, sched: list[dict[str, Any]]) -> dict[str, Any]:
        job, a = self.job, self.a
        begun = time.time() + a.start_timeout
        while job.min_step() < 1 and not job.ended() and time.time() < begun:
            time.sleep(0.2)
        if "spare" in a.kinds.split(",") and not job.ended():   # the hot spare waits from the start
            job.start_spare()
        t0 = time.time()
        self.recovered_at = t0
        faults: list[dict[str, Any]] = []
        for f in sched:
            at = max(t0 + f["offset"], self.recovered_at + a.min_gap)
            if at > t0 + a.minutes * 60:   # the same wall time for every system: what a slower one did not reach
                faults += [{"i": g["i"], "kind": g["kind"], "rank": g["rank"], "skipped": "not reached: the run's "
                            "time was over"} for g in sched[f["i"]:]]
                break
            if not self.pause_until(at):
                break
            try:
                rec = soak_faults.inject(job, f)
            except NotImplementedError as exc:
                faults.append({"i": f["i"], "kind": f["kind"], "rank": f["rank"], "skipped": str(exc)})
                continue
            except Exception as exc:   # the harness could not do it (e.g. the rank had no process then)
                faults.append({"i": f["i"], "kind": f["kind"], "rank": f["rank"], "t": time.time(),
                               "not_done": f"{type(exc).__name__}: {exc}"})
                continue
            rec["i"], rec["offset"] = f["i"], round(rec["t"] - t0, 2)
            self.await_recovery(rec)
            soak_faults.after_recovery(job, rec)
            if rec["kind"] == "rot" and hasattr(job, "events"):   # the rotten copy was found, not restored
                rec["corruption_found"] = any("SnapshotCorrupt" in str(e.get("root_cause"))
                                              for e in job.events("fault", rec["t"]))
            faults.append(rec)
            print(f"{job.system:12s} fault {f['i']:3d} {f['kind']:11s} rank {f['rank']} at {rec['offset']:7.1f}s: "
                  + (f"recovered in {rec['recovered_at'] - rec['t']:.2f}s" if "recovered_at" in rec else
                     f"ended the job {rec['ended']}" if "ended" in rec else "NOT recovered in time"), flush=True)
            if "recovered_at" not in rec:
                break
            self.recovered_at = time.time()
        if faults and "recovered_at" in faults[-1] or not faults:
            self.pause_until(t0 + a.minutes * 60)
        stop_at = job.stop()
        codes = job.wait_end(a.end_timeout)
        return {"system": job.system, "t0": t0, "stop_at": stop_at, "exit_codes": codes, "faults": faults,
                "samples": self.samples, "spare_exits": getattr(job, "spare_exits", [])}


def steps_and_goodput(out: Path, res: dict[str, Any]) -> None:
    """Per-fault recovery time and steps redone, and goodput, from the workers' records (soak_worker.py)."""
    steps, entries = records(out, "steps"), records(out, "entries")
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for s in sorted(steps, key=lambda s: s["t"]):
        by_rank.setdefault(s["rank"], []).append(s)
    for rec in res["faults"]:
        if "recovered_at" not in rec:
            continue
        if rec["kind"] == "coordinator":
            rec["recovery_s"] = rec["recovered_at"] - rec["t"]
            rec["steps_redone"] = 0
            continue
        firsts, starts = [], []
        for r, mine in by_rank.items():
            again = [e for e in entries if e["rank"] == r and rec["check_from"] < e["t"] <= rec["recovered_at"] + 1]
            if not again:
                continue
            last = max(again, key=lambda e: e["t"])
            starts.append(last["start"])
            after = next((s["t"] for s in mine if s["t"] > last["t"]), None)
            if after is not None:
                firsts.append(after)
        rec["recovery_s"] = (max(firsts) - rec["t"]) if len(firsts) == len(by_rank) else None
        done = [s["step"] for s in steps if s["t"] <= rec["t"]]
        rec["steps_redone"] = max(0, max(done, default=0) - min(starts)) if starts else None
    gaps = [b["t"] - a["t"] for mine in by_rank.values() for a, b in zip(mine, mine[1:])
            if b["step"] == a["step"] + 1 and b["gen"] == a["gen"]]
    step_s = statistics.median(gaps) if gaps else None
    t_start = min((e["t"] for e in entries), default=None)
    t_end = max((s["t"] for s in steps), default=None)
    final = min((max(s["step"] for s in mine) for mine in by_rank.values()), default=0)
    res["step_s"] = step_s
    res["steps_final"] = final
    res["steps_done"] = len(steps) // max(1, len(by_rank))
    res["wall_s"] = (t_end - t_start) if t_start and t_end else None
    res["goodput"] = final * step_s / res["wall_s"] if step_s and res["wall_s"] else None
    res["lanes"] = {r: [(s["t"], s["step"], s["gen"]) for s in mine] for r, mine in by_rank.items()}


def verdict(f: dict[str, Any]) -> str:
    if "skipped" in f:
        return f["skipped"] if f["skipped"].startswith("not reached") else "skipped: " + f["skipped"]
    if "not_done" in f:
        return "not done by the harness: " + f["not_done"]
    if "recovered_at" in f:
        return "recovered"
    if "ended" in f:
        codes = [c for c in f["ended"].values() if c is not None]
        known = all(c in DOCUMENTED for c in codes if c)
        return f"ended the job with {codes} ({'documented' if known else 'UNDOCUMENTED'})"
    return "NOT handled: no recovery within the deadline"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def per_kind(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in res["faults"]:
        k = out.setdefault(f["kind"], {"faults": 0, "recovered": 0, "skipped": 0, "not_reached": 0, "times": []})
        late = f.get("skipped", "").startswith("not reached")
        k["faults"] += 1
        k["skipped"] += "skipped" in f and not late
        k["not_reached"] += late
        k["recovered"] += "recovered_at" in f
        if f.get("recovery_s") is not None:
            k["times"].append(f["recovery_s"])
    for k in out.values():
        t = k.pop("times")
        k.update({"median_s": statistics.median(t), "p95_s": pct(t, 0.95), "max_s": max(t)} if t else {})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None, help="how long each system's job runs under faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="directory for soak.json, soak.md and soak.png")
    ap.add_argument("--mean-interval", type=float, default=30.0, help="mean seconds between faults")
    ap.add_argument("--kinds", default=",".join(soak_faults.KINDS))
    ap.add_argument("--systems", default="hyperpodrun,torchrun")
    ap.add_argument("--step-sleep", type=float, default=0.1, help="seconds each step sleeps after its work")
    ap.add_argument("--hang-timeout", type=float, default=15.0, help="hyperpodrun --progress-timeout; torchrun: the "
                    "collectives' timeout (its only way to find a hung rank)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun: a torch.save checkpoint every N steps")
    ap.add_argument("--min-gap", type=float, default=5.0, help="seconds of training between a recovery and the "
                    "next fault (a system that recovers slowly gets its faults later, not back to back)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of training before the first fault")
    ap.add_argument("--fault-deadline", type=float, default=240.0, help="a fault not recovered by then fails")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--log-fs-mb", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--end-timeout", type=float, default=300.0)
    ap.add_argument("--keep", action="store_true", help="keep the jobs' directories (outputs, logs) in DIR/soak-*")
    ap.add_argument("--report-only", action="store_true", help="only make soak.json, soak.md and soak.png again "
                    "from DIR/soak-raw.json (the resources judged again by this version's rules)")
    a = ap.parse_args(argv)
    if a.report_only:
        return report_again(Path(a.out), a)
    kinds = tuple(a.kinds.split(","))
    bad = [k for k in kinds if k not in soak_faults.KINDS]
    if bad or a.minutes is None or a.minutes <= 0 or a.mean_interval <= 0:
        ap.error(f"unknown fault kind {bad[0]!r}" if bad else "--minutes (required) and --mean-interval must be > 0")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("soak.py: needs root and unshare (each node in its own pid and mount namespaces)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sched = soak_faults.schedule(a.seed, a.minutes, a.mean_interval, kinds, a.warmup)
    env = {"STEP_SLEEP": str(a.step_sleep), "HANG_TIMEOUT": str(a.hang_timeout), "CKPT_EVERY": str(a.ckpt_every)}
    flags = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "5", "--node-timeout", "5", "--progress-timeout",
             str(a.hang_timeout), "--inprocess-timeout", "60", "--replace-timeout", "120"]
    shm_before = set(os.listdir("/dev/shm"))
    results: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=str(out) if a.keep else None))
    try:
        for system in a.systems.split(","):
            tmp = work / system
            tmp.mkdir()
            job: Any = None
            try:
                job = (soak_jobs.HprJob(tmp, env, flags, a.log_fs_mb) if system == "hyperpodrun"
                       else soak_jobs.TorchrunJob(tmp, env, max_restarts=len(sched) * 2 + 10))
                res = Soak(job, a, sampling=system == "hyperpodrun").run(sched)
                if any(c != 0 for c in res["exit_codes"].values()):
                    res["describe"] = job.describe()[-8000:]
                job.stop_coordinator()
                try:   # the job's processes (found by the launcher's tag in their environment) all end
                    soak_jobs.wait_until(lambda: not job.launcher.leftovers(), 30, message="leftovers gone")
                except AssertionError:
                    pass
                res["leftovers"] = soak_jobs.describe_pids(job.launcher.leftovers())
            finally:
                if job is not None:
                    job.shutdown()
                    job.unmount(keep=a.keep)
            steps_and_goodput(job.out, res)
            if system == "hyperpodrun":
                import soak_report
                res["exact"] = soak_report.replay_and_compare(work, job.out, res["stop_at"], env)
                res["flat"] = soak_procs.flatness(res["samples"], a.minutes * 60, a.warmup + 30)
            results.append(res)
    finally:
        shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    import soak_report
    meta = {"command": "soak.py " + " ".join(argv if argv is not None else sys.argv[1:]), "seed": a.seed,
            "minutes": a.minutes, "mean_interval_s": a.mean_interval, "kinds": kinds, "schedule": sched,
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}, torch {__import__('torch').__version__})",
            "shm_left": shm_left}
    (out / "soak-raw.json").write_text(json.dumps({"meta": meta, "results": results}, default=str))   # report fails
    ok = soak_report.write(out, meta, results, per_kind, verdict)
    return 0 if ok else 1


def report_again(out: Path, a: argparse.Namespace) -> int:
    import soak_report
    raw = json.loads((out / "soak-raw.json").read_text())
    meta, results = raw["meta"], raw["results"]
    for r in results:
        r["exit_codes"] = {int(k): v for k, v in r["exit_codes"].items()}
        r["lanes"] = {int(k): v for k, v in r.get("lanes", {}).items()}
        if r.get("samples"):
            r["flat"] = soak_procs.flatness(r["samples"], meta["minutes"] * 60, a.warmup + 30)
    meta["command"] += f"  (report made again: soak.py --report-only --out {a.out})"
    return 0 if soak_report.write(out, meta, results, per_kind, verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
