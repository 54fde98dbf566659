"""GPU health with real jobs on CPU (issue 6 acceptance): gloo workers, synthetic NVML events through
`hyperpodrun inject --kind nvml-xid|gpu-lost`, which take the same path in the agent as events its NVML monitor
reads. There is no NVML here, so `--health-check auto` runs without a monitor and the node's GPUs are the ones
CUDA_VISIBLE_DEVICES names (or one per local rank)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperpodrun.agent.health.nvml_backend import probe_nvml
from conftest import HYPERPODRUN, read_events, script
from inprocess_helpers import FAST, Job, assert_only_replaced, events_named, pids, records
from hyperpodrun.errors import EXIT_NO_USABLE_GPU, EXIT_USAGE, EXIT_WORKER_UNHEALTHY

GPU_TRAIN = script("gpu_train.py")


def inject(job: Job, rank: int, kind: str, *extra: str) -> str:
    job.agent_file()
    res = job.launcher.run(["inject", str(job.log_dir), "--rank", str(rank), "--kind", kind, *extra],
                           cmd=[HYPERPODRUN], timeout=40)
    assert res.rc == 0, f"inject failed: {res}\n{job.describe()}"
    return res.out


def cvds(out: Path, rank: int) -> list[tuple[int, str]]:
    """(pid, CUDA_VISIBLE_DEVICES) of every process that held `rank` (written by gpu_train.py)."""
    path = Path(out) / f"cvd{rank}.jsonl"
    return [(r["pid"], r["cvd"]) for r in map(json.loads, path.read_text().splitlines())]


def test_fatal_xid_moves_only_that_rank_to_the_spare_gpu_and_a_warning_changes_nothing(launcher, out_dir):
    """5 GPUs for 4 ranks: GPU 4 is a spare. XID 13 on rank 1's GPU (an application error) is logged and the
    ranks keep training untouched; then XID 79 (fallen off the bus): rank 1 alone is replaced in-process (the
    others keep their pids), on GPU 4 (CUDA_VISIBLE_DEVICES lists it at position 1 and leaves GPU 1 out), and
    the job finishes. The final report counts both events."""
    job = Job(launcher, out_dir, FAST, nproc=4, train=GPU_TRAIN, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"})
    job.wait_step(range(4), step=10)
    assert "XID 13 on GPU 1 (rank 1)" in inject(job, 1, "nvml-xid", "--xid", "13")
    warned = job.wait_event("gpu_event", xid=13)
    assert warned["action"] == "warn" and warned["rank"] == 1 and "application error" in warned["msg"]
    after = {r: max(x["step"] for x in records(out_dir, r) if x["ev"] == "step") for r in range(4)}
    job.wait_step(range(4), step=max(after.values()) + 20)          # everyone trains on past the warning
    assert not events_named(job.log_dir, "fault") and not events_named(job.log_dir, "restart_signal"), job.describe()

    inject(job, 1, "nvml-xid", "--xid", "79")
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {1}, info=info)
    faults = events_named(job.log_dir, "fault")
    assert len(faults) == 1 and faults[0]["rank"] == 1 and "XID 79" in faults[0]["root_cause"], info
    assert [e["rank"] for e in events_named(job.log_dir, "respawn")] == [1], info
    assert not events_named(job.log_dir, "restart_begin"), "no process-level restart expected\n" + info
    remap = events_named(job.log_dir, "gpu_remap")
    assert len(remap) == 1 and remap[0]["rank"] == 1 and remap[0]["gpu"] == 4 and remap[0]["from_gpu"] == 1, info
    new_pid = pids(out_dir, 1)[1]
    assert cvds(out_dir, 1) == [(pids(out_dir, 1)[0], "0,1,2,3,4"), (new_pid, "0,4,2,3")], info
    summary = events_named(job.log_dir, "gpu_summary")
    assert len(summary) == 1 and summary[0]["counts"] == {"xid 13": 1, "xid 79": 1}, info


def test_fatal_xid_without_a_spare_replaces_only_that_rank_on_its_gpu(launcher, out_dir):
    """4 ranks, one GPU each, no spare: XID 48 (double-bit ECC) on rank 1's GPU replaces rank 1 alone, on the
    same GPU (now suspect), the others restart in-process and the job finishes."""
    job = Job(launcher, out_dir, FAST, nproc=4, train=GPU_TRAIN)
    job.wait_step(range(4), step=10)
    inject(job, 1, "nvml-xid", "--xid", "48")
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {1}, info=info)
    faults = events_named(job.log_dir, "gpu_fault")
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["action"] == "rank", info
    assert "now suspect" in faults[0]["msg"], info
    assert not events_named(job.log_dir, "no_usable_gpu") and not events_named(job.log_dir, "gpu_remap"), info


def test_gpu_lost_without_a_spare_ends_the_node_with_76(launcher, out_dir):
    """Two ranks, two GPUs (one per local rank without CUDA_VISIBLE_DEVICES): rank 1's GPU is declared lost;
    no spare, so the node stops its workers and exits 76, and the event log names the GPU and the rank. Without
    NVML, --health-check auto says so in one info line and goes on."""
    job = Job(launcher, out_dir, FAST, nproc=2, train=GPU_TRAIN)
    job.wait_step(range(2), step=10)
    inject(job, 1, "gpu-lost")
    res = job.result()
    info = job.describe()
    assert res.rc == EXIT_NO_USABLE_GPU, info
    bad = events_named(job.log_dir, "no_usable_gpu")
    assert len(bad) == 1 and bad[0]["rank"] == 1 and bad[0]["gpu"] == 1, info
    assert "GPU 1" in bad[0]["msg"] and "rank 1" in bad[0]["msg"] and "exit code 76" in bad[0]["msg"], info
    failed = events_named(job.log_dir, "job_failed")
    assert len(failed) == 1 and "no usable GPU" in failed[0]["msg"], info
    assert not events_named(job.log_dir, "respawn"), info
    if probe_nvml() is not None:          # (on a machine with NVML the monitor runs instead)
        lines = [ln for ln in res.err.splitlines() if "GPU health: NVML not available" in ln]
        assert len(lines) == 1, res.err
        assert "Traceback" not in res.err


def test_fatal_xid_without_inprocess_restart_is_a_process_level_restart(launcher, out_dir):
    """No --inprocess-restart: a fatal XID on rank 1's GPU fails rank 1; with --max-restarts 1 every worker is
    started again, rank 1 on the spare GPU 2, and the job finishes."""
    job = Job(launcher, out_dir, ["--max-restarts", "1"], ["--steps", "5"], nproc=2, train=GPU_TRAIN,
              env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    job.wait_step(range(2), step=10)
    inject(job, 1, "nvml-xid", "--xid", "79")
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert [e["generation"] for e in events_named(job.log_dir, "restart_begin")] == [1], info
    assert "XID 79" in events_named(job.log_dir, "restart_begin")[0]["root_cause"], info
    for rank in range(2):
        assert len(pids(out_dir, rank)) == 2, info
    assert [c for _, c in cvds(out_dir, 0)] == ["0,1,2", "0,2"], info
    assert [c for _, c in cvds(out_dir, 1)] == ["0,1,2", "0,2"], info


def test_failed_health_check_replaces_only_that_process(launcher, out_dir):
    """An exception in rank 2 restarts every rank in-process; rank 1's health check then fails (as
    CudaHealthCheck, HPWrapper's default, does on a sticky CUDA error): it exits 74 and a fresh process takes
    rank 1; ranks 0 and 2 keep theirs and the job finishes."""
    job = Job(launcher, out_dir, FAST, ["--raise-rank", "2", "--raise-step", "8"], nproc=3, train=GPU_TRAIN,
              env={"HPR_FAIL_HEALTH_RANK": "1"})
    res = job.result()
    info = job.describe()
    assert res.rc == 0, info
    assert_only_replaced(out_dir, {1}, ranks=range(3), info=info)
    exits = [e for e in events_named(job.log_dir, "worker_exit", rank=1) if e["exit_code"] == EXIT_WORKER_UNHEALTHY]
    assert len(exits) == 1, info
    assert [e["generation"] for e in events_named(job.log_dir, "go")] == [1], info


@pytest.mark.parametrize("how", ["flag", "env"])
def test_health_check_nvml_without_nvml_is_a_usage_error(launcher, tmp_path, how):
    if probe_nvml() is None:
        pytest.skip("NVML works on this machine")
    train = tmp_path / "train.py"
    train.write_text("raise SystemExit('must not run')\n")
    args, env = (["--health-check", "nvml"], None) if how == "flag" else ([], {"HYPERPODRUN_HEALTH_CHECK": "nvml"})
    res = launcher.run([*args, str(train)], env=env, timeout=60)
    assert res.rc == EXIT_USAGE, res
    assert "--health-check nvml: NVML" in res.err and "--health-check auto" in res.err, res
    assert "Traceback" not in res.err and not read_events(launcher.log_dir), res


def test_inject_gpu_kinds_usage_errors(launcher, tmp_path):
    for args, needle in ((["--kind", "nvml-xid"], "needs --xid"),
                         (["--kind", "gpu-lost", "--step", "3"], "--step does not apply"),
                         (["--kind", "raise", "--xid", "79"], "--xid only goes with")):
        res = launcher.run(["inject", str(tmp_path), "--rank", "0", *args], cmd=[HYPERPODRUN], timeout=30)
        assert res.rc == EXIT_USAGE and needle in res.err, res
