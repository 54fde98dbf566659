#!/usr/bin/env python3
"""GPU health on a GPU machine (2 GPUs, NVML): the monitor against the real devices, its CPU cost, and injected XIDs
in NCCL jobs under `hyperpodrun --inprocess-restart`.

    python3 scripts/bench/gpu/gpu_health.py [OUT_DIR]          (default: $OUT, else bench-out)

Needs `hyperpodrun` next to this Python or on PATH, the repository importable (it adds its own root), torch with
CUDA and nvidia-ml-py. Writes OUT_DIR/gpu_health.json (every measurement and check; "ok" is true when all checks
passed) and OUT_DIR/gpu_health.md; each job's event log and output are kept under OUT_DIR/jobs/<step>/. Every
step has a deadline and the whole run stops starting new steps after GPU_HEALTH_BUDGET_S (default 170) seconds.

Steps:
 monitor   NVML loads, lists the GPUs, and every GPU is registered for XID events; the cost of one poll.
 map       a 2-rank NCCL job: the agent registers XID events on every GPU, and maps each rank by the UUID the rank
           reports, which is the GPU torch shows that worker. rank_xid (same job): XID 94 (contained ECC error:
           replace the process, keep the GPU) injected on rank 1's GPU: only rank 1 is replaced, rank 0 keeps its
           pid (in-process restart), the job finishes.
 cpu       two idle agents (`--health-check nvml` vs `none`, workers `sleep`) side by side for 20 s, then one
           monitor thread of this process at a time (polling every 5 s, the default, and every 1 s), 10 s each,
           in % of one core.
 no_spare  a 2-rank job, fatal XID 79 on rank 1's GPU: no spare GPU, so rank 1 alone is replaced on its GPU
           (now suspect); then the GPU is declared lost: the node exits 76 and the event log names the GPU (UUID)
           and rank 1.
 spare     a 1-rank job on the 2-GPU node (the other GPU is a spare), fatal XID 79 on rank 0's GPU: the rank is
           started again on the spare (CUDA_VISIBLE_DEVICES = its UUID; the new process sees and reports that GPU)
           and the job finishes.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]   # hyperpodrun itself: installed, or from gpu_env.sh's PYTHONPATH

from _common import find_launcher  # noqa: E402
from hyperpodrun.agent.health.nvml_backend import load_nvml  # noqa: E402
from hyperpodrun.agent.health.nvml_monitor import NvmlMonitor  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "bench-out")).resolve()
WORKER = HERE.parent / "workers" / "gpu_health_worker.py"
T0 = time.monotonic()
BUDGET = float(os.environ.get("GPU_HEALTH_BUDGET_S", "170"))
CLK = os.sysconf("SC_CLK_TCK")
FAST = ["--inprocess-restart", "--health-check", "nvml", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "10",
        "--inprocess-timeout", "90", "--shutdown-timeout", "10"]
RESULT: dict[str, Any] = {"checks": {}, "steps": {}, "errors": {}}


class StepFailed(Exception):
    pass


def check(name: str, ok: bool, detail: Any = None) -> bool:
    RESULT["checks"][name] = {"ok": bool(ok), **({"detail": detail} if detail is not None else {})}
    print(f"[gpu_health] {'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail is not None else ""),
          flush=True)
    return bool(ok)


def remaining() -> float:
    """Seconds left of the whole run's budget (every wait is cut to it, so the run ends on time)."""
    return max(1.0, T0 + BUDGET + 5 - time.monotonic())


def same(a: Any, b: Any) -> bool:
    """Two GPU UUIDs are the same GPU (NVML and torch may differ in case)."""
    return isinstance(a, str) and isinstance(b, str) and a.lower() == b.lower()


def cpu_s(stat_path: str) -> float:
    """utime + stime of a process or thread, in seconds (/proc/.../stat)."""
    with open(stat_path) as fh:
        rest = fh.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK


def save() -> None:
    RESULT["elapsed_s"] = round(time.monotonic() - T0, 1)
    RESULT["ok"] = bool(RESULT["checks"]) and all(c["ok"] for c in RESULT["checks"].values()) \
        and not RESULT["errors"]
    (OUT / "gpu_health.json").write_text(json.dumps(RESULT, indent=1, default=str))


class Job:
    """One hyperpodrun job of gpu_health_worker.py, in its own session, output and logs under OUT/jobs/<name>."""

    def __init__(self, name: str, hpr_args: list[str], worker_args: list[str] = ()) -> None:
        self.dir = OUT / "jobs" / name
        self.log = self.dir / "logs"
        self.out = self.dir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.hpr = find_launcher("hyperpodrun")
        argv = [self.hpr, "--log-dir", str(self.log), *hpr_args, str(WORKER), "--out", str(self.out), *worker_args]
        (self.dir / "cmd.txt").write_text(" ".join(argv) + "\n")
        self.err = open(self.dir / "output.txt", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.err, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(glob.glob(str(self.log / "*" / "*.events.jsonl"))):
            with open(path) as fh:
                out += [json.loads(line) for line in fh if line.strip().endswith("}")]
        return out

    def named(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == name and all(e.get(k) == v for k, v in match.items())]

    def records(self, rank: int, ev: Optional[str] = None) -> list[dict[str, Any]]:
        path = self.out / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        recs = [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]
        return [r for r in recs if ev is None or r["ev"] == ev]

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        end = time.monotonic() + min(timeout, remaining())
        while True:
            value = pred()
            if value:
                return value
            if self.p.poll() is not None:
                raise StepFailed(f"the job ended (rc={self.p.returncode}) before: {what}")
            if time.monotonic() > end:
                raise StepFailed(f"not within {timeout:g}s: {what}")
            time.sleep(0.1)

    def steps_reached(self, ranks: range, step: int) -> bool:
        return all(any(r["step"] >= step for r in self.records(k, "step")) for k in ranks)

    def inject(self, rank: int, *args: str) -> str:
        res = subprocess.run([self.hpr, "inject", str(self.log), "--rank", str(rank), *args, "--timeout", "20"],
                             capture_output=True, text=True, timeout=40)
        if res.returncode != 0:
            raise StepFailed(f"inject {args} failed (rc {res.returncode}): {res.stderr.strip()[-500:]}")
        return res.stdout.strip()

    def finish(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout=min(timeout, remaining()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise StepFailed(f"the job did not end within {timeout:g}s")

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except OSError:
            pass
        self.p.wait()


def run_step(name: str, need_s: float, fn: Callable[[], None]) -> None:
    left = BUDGET - (time.monotonic() - T0)
    if left < need_s:
        RESULT["errors"][name] = f"skipped: {left:.0f}s of the time budget left, the step needs ~{need_s:.0f}s"
        print(f"[gpu_health] SKIP {name}: out of time", flush=True)
        save()
        return
    t = time.monotonic()
    print(f"[gpu_health] == {name}", flush=True)
    try:
        fn()
    except Exception as exc:
        RESULT["errors"][name] = f"{type(exc).__name__}: {exc}"
        RESULT["steps"].setdefault(name, {})["traceback"] = traceback.format_exc()[-3000:]
        print(f"[gpu_health] ERROR in {name}: {exc}", flush=True)
    RESULT["steps"].setdefault(name, {})["duration_s"] = round(time.monotonic() - t, 1)
    save()


# ------------------------------------------------------------------------------------------ steps
def step_monitor() -> None:
    t = time.monotonic()
    be = load_nvml()
    init_s = time.monotonic() - t
    devs = be.devices()
    RESULT["devices"] = [{"index": d.index, "uuid": d.uuid, "pci_bus_id": d.pci_bus_id, "name": d.name} for d in devs]
    mon = NvmlMonitor(be, lambda ev: RESULT.setdefault("startup_events", []).append(repr(ev[1])), interval=3600)
    mon.start()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        for d in devs:
            be.ecc_uncorrected(d.index), be.remap_state(d.index), be.clock_event_reasons(d.index)
    poll_ms = (time.perf_counter() - t) / n * 1000
    RESULT["steps"]["monitor"] = {"nvml_init_s": round(init_s, 3), "gpus": len(devs), "xid_registered": mon.registered,
                                  "poll_all_gpus_ms": round(poll_ms, 3),
                                  "signals": {d.index: {"ecc_uncorrected": be.ecc_uncorrected(d.index),
                                                        "remap_pending_failure": be.remap_state(d.index),
                                                        "clock_event_reasons": be.clock_event_reasons(d.index)}
                                              for d in devs}}
    stopped = mon.stop()
    if stopped:
        be.close()
    check("monitor_sees_gpus", len(devs) >= 2, [d.uuid for d in devs])
    check("monitor_registers_xid_on_every_gpu", sorted(mon.registered) == [d.index for d in devs], mon.registered)
    check("monitor_stops", stopped)


def step_map_and_rank_xid() -> None:
    job = Job("map_rank_xid", ["--nproc-per-node", "2", *FAST], ["--cap", "90"])
    try:
        nvml_uuids = {d["index"]: d["uuid"] for d in RESULT.get("devices", [])}
        start = job.wait(lambda: job.named("gpu_health"), 30, "the agent's gpu_health record")[0]
        check("agent_registers_xid_on_every_gpu", start.get("nvml") is True and
              sorted(start.get("xid_registered", [])) == sorted(nvml_uuids), start.get("msg"))
        job.wait(lambda: job.steps_reached(range(2), 10), 90, "both ranks training past step 10")
        maps = job.wait(lambda: (lambda m: m if {0, 1} <= set(m) else None)(
            {e["rank"]: e for e in job.named("gpu_map")}), 30, "both ranks' GPU reports")
        seen = {}
        for r in range(2):
            worker_uuid = job.records(r, "start")[0]["uuid"]
            seen[r] = {"agent_map_uuid": maps[r]["uuid"], "worker_torch_uuid": worker_uuid,
                       "nvml_index": maps[r]["gpu"], "pci_bus_id": maps[r].get("pci_bus_id")}
        RESULT["steps"]["map"] = {"ranks": seen, "startup_mapping": start.get("mapping")}
        check("agent_maps_ranks_by_reported_uuid",
              all(same(s["agent_map_uuid"], s["worker_torch_uuid"]) for s in seen.values())
              and not same(seen[0]["agent_map_uuid"], seen[1]["agent_map_uuid"]), seen)
        before = {r: [x["pid"] for x in job.records(r, "start")] for r in range(2)}
        t_inject = time.time()
        detail = job.inject(1, "--kind", "nvml-xid", "--xid", "94")
        rc = job.finish(120)
        after = {r: [x["pid"] for x in job.records(r, "start")] for r in range(2)}
        done = {r: [(x["pid"], x["it"]) for x in job.records(r, "done")] for r in range(2)}
        go = job.named("go")
        RESULT["steps"]["rank_xid"] = {"inject": detail, "rc": rc, "pids_before": before, "pids_after": after,
                                       "done": done, "downtime_s": go[0].get("downtime_s") if go else None,
                                       "go_after_inject_s": round(go[0]["ts"] - t_inject, 3) if go else None,
                                       "root_cause": go[0].get("root_cause") if go else None,
                                       # the survivors' recovery, default CudaHealthCheck included (74: it failed)
                                       "rank_ready": [{k: e.get(k) for k in ("rank", "abort_s", "finalize_s",
                                                                             "health_s")}
                                                      for e in job.named("rank_ready")],
                                       "worker_exits": [{k: e.get(k) for k in ("rank", "pid", "exit_code")}
                                                        for e in job.named("worker_exit")]}
        check("rank_xid_job_finishes", rc == 0, rc)
        check("rank_xid_replaces_only_rank_1",
              after[0] == before[0] and len(after[0]) == 1 and len(after[1]) == 2 and after[1][0] == before[1][0]
              and done[0] == [(before[0][0], 1)] and done[1] == [(after[1][1], 1)], {"pids": after, "done": done})
        check("rank_xid_root_cause_is_the_xid", bool(go) and "XID 94" in str(go[0].get("root_cause")),
              go[0].get("root_cause") if go else None)
    finally:
        if job.p.poll() is None:
            job.kill()


def step_cpu() -> None:
    """CPU cost, each part alone: NVML makes event sets waiting at the same time spin (measured on H200,
    driver 580: two sets in one process 50 % of a core each, one set 0 %), so the agents are measured with
    no other monitor alive, then one monitor thread at a time with no agent alive."""
    sink: list = []
    hpr = find_launcher("hyperpodrun")
    agents = {}
    for mode in ("nvml", "none"):
        d = OUT / "jobs" / f"cpu_{mode}"
        d.mkdir(parents=True, exist_ok=True)
        fh = open(d / "output.txt", "wb")
        agents[mode] = subprocess.Popen([hpr, "--log-dir", str(d / "logs"), "--nproc-per-node", "2", "--health-check",
                                         mode, "--no-python", "sleep", "120"], stdin=subprocess.DEVNULL, stdout=fh,
                                        stderr=subprocess.STDOUT, start_new_session=True)
    pct: dict = {}
    window = 20.0
    try:
        time.sleep(6)   # agents up, NVML initialised
        paths = {f"agent_{mode}": f"/proc/{p.pid}/stat" for mode, p in agents.items()}
        t1, c1 = time.monotonic(), {k: cpu_s(v) for k, v in paths.items()}
        time.sleep(window)
        t2, c2 = time.monotonic(), {k: cpu_s(v) for k, v in paths.items()}
        pct.update({k: round((c2[k] - c1[k]) / (t2 - t1) * 100, 3) for k in paths})
        pct["agent_monitor_delta"] = round(pct["agent_nvml"] - pct["agent_none"], 3)
    finally:
        for p in agents.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except OSError:
                pass
        for p in agents.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for iv in (5.0, 1.0):
        mon = NvmlMonitor(load_nvml(), sink.append, interval=iv)
        mon.start()
        time.sleep(0.5)
        path = f"/proc/self/task/{mon.native_id}/stat"
        m1, s1 = time.monotonic(), cpu_s(path)
        time.sleep(window / 2)
        pct[f"thread_interval_{int(iv)}s"] = round((cpu_s(path) - s1) / (time.monotonic() - m1) * 100, 3)
        if mon.stop():
            mon.backend.close()
    RESULT["steps"]["cpu"] = {"window_s": window, "percent_of_one_core": pct,
                              "clock_tick_s": 1 / CLK, "events_seen": [repr(e) for e in sink][:20]}
    check("monitor_thread_cpu_at_most_1pct_of_a_core", pct["thread_interval_5s"] <= 1.0, pct)
    check("agent_with_monitor_costs_at_most_1pct_more", pct["agent_monitor_delta"] <= 1.0,
          pct["agent_monitor_delta"])


def step_no_spare() -> None:
    """2 ranks on 2 GPUs (no spare): a fatal XID on GPU 1 replaces only rank 1, on the same GPU, now suspect;
    then GPU 1 is declared lost: the node exits 76 naming the GPU and the rank."""
    job = Job("no_spare", ["--nproc-per-node", "2", *FAST], ["--cap", "60"])
    try:
        job.wait(lambda: job.steps_reached(range(2), 10), 90, "both ranks training past step 10")
        first = job.inject(1, "--kind", "nvml-xid", "--xid", "79")
        job.wait(lambda: len(job.records(1, "start")) >= 2 and job.named("go"), 90, "rank 1 replaced after XID 79")
        fault = job.named("gpu_fault")
        starts = {r: [x["pid"] for x in job.records(r, "start")] for r in range(2)}
        check("fatal_xid_without_spare_replaces_only_rank_1", len(starts[0]) == 1 and len(starts[1]) == 2
              and bool(fault) and fault[0].get("action") == "rank", {"starts": starts, "gpu_fault": fault})
        detail = job.inject(1, "--kind", "gpu-lost")
        rc = job.finish(60)
        bad = job.named("no_usable_gpu")
        RESULT["steps"]["no_spare"] = {"inject_xid": first, "inject_lost": detail, "rc": rc, "starts": starts,
                                       "gpu_fault": fault, "no_usable_gpu": bad}
        uuid1 = job.records(1, "start")[0]["uuid"]
        check("gpu_lost_without_spare_exits_76", rc == 76, rc)
        check("no_usable_gpu_names_gpu_and_rank", len(bad) == 1 and bad[0].get("rank") == 1
              and same(bad[0].get("uuid"), uuid1) and str(bad[0].get("uuid")) in bad[0].get("msg", ""), bad)
    finally:
        if job.p.poll() is None:
            job.kill()


def step_spare() -> None:
    job = Job("spare", ["--nproc-per-node", "1", *FAST], ["--cap", "60"])
    try:
        job.wait(lambda: job.steps_reached(range(1), 10), 90, "rank 0 training past step 10")
        first = job.records(0, "start")[0]
        detail = job.inject(0, "--kind", "nvml-xid", "--xid", "79")
        rc = job.finish(120)
        starts = job.records(0, "start")
        remap = job.named("gpu_remap")
        maps = job.named("gpu_map")
        RESULT["steps"]["spare"] = {"inject": detail, "rc": rc, "starts": starts, "gpu_remap": remap,
                                    "gpu_map": maps, "go": job.named("go")}
        check("spare_job_finishes", rc == 0, rc)
        ok = (len(starts) == 2 and len(remap) == 1 and same(starts[1]["cvd"], remap[0].get("uuid"))
              and same(starts[1]["uuid"], remap[0].get("uuid")) and not same(starts[1]["uuid"], first["uuid"])
              and any(same(m.get("uuid"), starts[1]["uuid"]) and m.get("pid") == starts[1]["pid"] for m in maps))
        check("fatal_xid_moves_the_rank_to_the_spare_gpu", ok, {"before": first.get("uuid"),
                                                                "after": starts[1:] and starts[1].get("uuid")})
    finally:
        if job.p.poll() is None:
            job.kill()


def write_md() -> None:
    r = RESULT
    lines = ["# GPU health (NVML monitor) on " + ", ".join(sorted({d['name'] for d in r.get("devices", [])})), ""]
    mon = r["steps"].get("monitor", {})
    cpu = r["steps"].get("cpu", {}).get("percent_of_one_core", {})
    rx = r["steps"].get("rank_xid", {})
    lines += [f"- NVML init {mon.get('nvml_init_s')} s; {mon.get('gpus')} GPUs; XID events registered on "
              f"{mon.get('xid_registered')}; one poll of every GPU (ECC, row remap, clock reasons): "
              f"{mon.get('poll_all_gpus_ms')} ms",
              f"- CPU, % of one core over {r['steps'].get('cpu', {}).get('window_s')} s: monitor thread polling every "
              f"5 s {cpu.get('thread_interval_5s')}, every 1 s {cpu.get('thread_interval_1s')}; idle agent with "
              f"monitor {cpu.get('agent_nvml')} vs without {cpu.get('agent_none')} (delta "
              f"{cpu.get('agent_monitor_delta')})",
              f"- XID 94 on rank 1's GPU (2 ranks, NCCL, in-process): rc {rx.get('rc')}, pids {rx.get('pids_after')}, "
              f"GO {rx.get('go_after_inject_s')} s after the injection (downtime {rx.get('downtime_s')} s)",
              f"- XID 79 on GPU 1, no spare: rank 1 replaced on its GPU, then GPU 1 lost: rc {r['steps'].get('no_spare', {}).get('rc')}; XID 79 with a spare (1 rank): "
              f"rc {r['steps'].get('spare', {}).get('rc')}", "", "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'pass' if c['ok'] else 'FAIL'} |" for name, c in r["checks"].items()]
    lines += [f"| {name} | ERROR: {err} |" for name, err in r["errors"].items()]
    lines += ["", f"overall: {'ok' if r.get('ok') else 'NOT ok'} ({r.get('elapsed_s')} s)"]
    (OUT / "gpu_health.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        import torch
        RESULT["machine"] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                             "gpus_torch": torch.cuda.device_count()}
    except Exception as exc:
        RESULT["machine"] = {"torch_error": str(exc)}
    try:
        from importlib.metadata import version
        RESULT["machine"]["nvidia_ml_py"] = version("nvidia-ml-py")
    except Exception:
        pass
    run_step("monitor", 5, step_monitor)
    if "monitor" in RESULT["errors"]:
        print("[gpu_health] NVML is not usable here: stopping", flush=True)
    else:
        run_step("map_rank_xid", 45, step_map_and_rank_xid)
        run_step("cpu", 45, step_cpu)
        run_step("no_spare", 40, step_no_spare)
        run_step("spare", 25, step_spare)
    save()
    write_md()
    print((OUT / "gpu_health.md").read_text(), flush=True)
    print(f"[gpu_health] results in {OUT / 'gpu_health.json'}", flush=True)
    return 0 if RESULT["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
