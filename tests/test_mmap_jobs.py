"""MMAP data cache in real hyperpodrun jobs (4 gloo workers, CPU): after an in-process restart, the respawn
of a SIGKILLed rank and a process-level restart, every rank sees the same bytes at every step as a bare
DataLoader without faults (computed here), and reads its first batch after the restart from the cache; node-level sharing keeps one
copy per data shard; a size cap too small for a batch degrades with a warning; nothing is left behind.

The worker is tests/scripts/mmap_worker.py (a hash per (rank, step) of the consumed batch)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "scripts" / "mmap_worker.py")
HYPERPODRUN = os.path.join(os.path.dirname(sys.executable), "hyperpodrun")
STEPS = 24
INPROCESS = ["--inprocess-restart", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "10",
             "--inprocess-timeout", "60"]
WINDOW = 4 + 2   # PREFETCH + LOOKBACK of the worker's defaults


def run_job(tmp_path: Path, name: str, launch: list[str], *, nproc: int = 4, timeout: float = 150,
            **env: str) -> tuple[int, Path, Path, str]:
    out, cache = tmp_path / name / "out", tmp_path / name / "cache"
    out.mkdir(parents=True)
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PET_", "HYPERPODRUN_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    full_env.update(OUT_DIR=str(out), CACHE_DIR=str(cache), STEPS=str(STEPS),
                    HYPERPODRUN_SHM_DIR=str(tmp_path / name / "shm"), **env)
    cmd = [HYPERPODRUN, "--nproc-per-node", str(nproc), *launch, "--log-dir", str(tmp_path / name / "logs"), WORKER]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"job {name} timed out:\n{stderr.decode()[-4000:]}")
    return proc.returncode, out, cache, stderr.decode()


def records(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def leftovers(cache: Path) -> list[str]:
    return [str(p) for p in cache.rglob("*")] if cache.exists() else []


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], str]:
    """(rank, step) -> hash of the batch a bare DataLoader yields, epoch after epoch, without any fault."""
    sys.path.insert(0, str(HERE / "scripts"))
    import hashlib
    import mmap_worker
    ref = {}
    for rank in range(4):
        dl, step, epoch = mmap_worker.data_loader(rank), 0, 0
        while step < STEPS:
            dl.sampler.set_epoch(epoch)
            for batch in dl:
                ref[(rank, step)] = mmap_worker.digest(batch, hashlib.sha256()).hexdigest()
                step += 1
            epoch += 1
    assert len(ref) >= 4 * STEPS
    assert all(ref[(r, s)] == ref[(r ^ 1, s)] for r in range(4) for s in range(STEPS)), "shards are rank // 2"
    assert ref[(0, 0)] != ref[(2, 0)] and ref[(0, 0)] != ref[(0, 8)]
    return ref


def check_against(reference: dict, out: Path, *, generations: set[int], info: str) -> list[dict]:
    """Every batch every rank saw equals the fault-free one; each rank ended all steps; after every restart
    the first batch came from the cache. Returns every record."""
    every = []
    for rank in range(4):
        recs = records(out, rank)
        every += [dict(r, rank=rank) for r in recs]
        batches = [r for r in recs if r["ev"] == "batch"]
        assert all(r["src"] == "cached" for r in batches), f"rank {rank} read directly: {batches}\n{info}"
        wrong = [(r["step"], r["it"]) for r in batches if r["h"] != reference[(rank, r["step"])]]
        assert not wrong, f"rank {rank}: batches differ from the fault-free run at (step, generation) {wrong}\n{info}"
        done = [r for r in recs if r["ev"] == "done"]
        assert done, f"rank {rank} never finished\n{info}"
        last = done[-1]["it"]
        assert sorted(r["step"] for r in batches if r["it"] == last and r["pid"] == done[-1]["pid"])[-1] == STEPS - 1
        assert {r["it"] for r in batches} == generations, f"rank {rank}: generations {({r['it'] for r in batches})}"
        for entry in (r for r in recs if r["ev"] == "enter" and r["start"] > 0):
            first = next(r for r in batches if r["pid"] == entry["pid"] and r["it"] == entry["it"])
            assert first["step"] == entry["start"], f"rank {rank}: resumed at {first['step']}, restored {entry['start']}"
            assert first["src"] == "cached", f"rank {rank}: first batch after the restart not from the cache\n{info}"
    restarted = [r for r in every if r["ev"] == "enter" and r["start"] > 0]
    assert restarted, f"no rank resumed at a restored step\n{info}"
    return every


@pytest.mark.slow
def test_inprocess_restart_and_respawned_rank_resume_from_the_cache(tmp_path, reference):
    # an exception in rank 1 at step 6 (in-process restart of everyone), then SIGKILL of rank 2 at step 14
    # in generation 1 (rank 2 is respawned, the others restart in-process)
    rc, out, cache, err = run_job(tmp_path, "faults", INPROCESS, FAULTS="raise:1:6;kill:2:14:1", WORKERS="1")
    assert rc == 0, err[-4000:]
    every = check_against(reference, out, generations={0, 1, 2}, info=err[-3000:])
    rank2_pids = {r["pid"] for r in every if r["rank"] == 2 and r["ev"] == "batch"}
    assert len(rank2_pids) == 2, "rank 2 was not respawned"
    for done in (r for r in every if r["ev"] == "done"):
        # the last producer started behind the cached batches (by index): it did not read them again
        start = next(r["start"] for r in every if r["ev"] == "enter" and r["pid"] == done["pid"] and r["it"] == 2)
        assert done["seeks"] and done["seeks"][0][1] == "index" and done["seeks"][0][0] > start, (done, start)
        assert done["max_files"] <= WINDOW
    assert leftovers(cache) == []


@pytest.mark.slow
def test_process_level_restart_resumes_from_the_files_of_the_dead_workers(tmp_path, reference):
    rc, out, cache, err = run_job(tmp_path, "plain", ["--max-restarts", "1"], FAULTS="kill:3:10")
    assert rc == 0, err[-4000:]
    every = check_against(reference, out, generations={0, 1}, info=err[-3000:])
    assert len({r["pid"] for r in every if r["ev"] == "batch"}) == 8, "not every rank was restarted"
    assert leftovers(cache) == []


@pytest.mark.slow
def test_shared_group_one_producer_per_shard_survives_a_killed_member(tmp_path, reference):
    rc, out, cache, err = run_job(tmp_path, "shared", INPROCESS, SHARE="1", FAULTS="kill:0:10;raise:3:12:1")
    assert rc == 0, err[-4000:]
    every = check_against(reference, out, generations={0, 1, 2}, info=err[-3000:])
    done = {r["rank"]: r for r in every if r["ev"] == "done"}
    for pair in ((0, 1), (2, 3)):
        owners = [rank for rank in pair if done[rank]["owner"]]
        assert len(owners) == 1, f"shard {pair}: producers in ranks {owners}, want exactly one"
    assert max(r["groups"] for r in done.values()) == 2, "one group (one copy) per shard on the node"
    assert all(r["max_files"] <= WINDOW for r in done.values())
    assert leftovers(cache) == []


@pytest.mark.slow
def test_size_cap_smaller_than_a_batch_finishes_with_the_warning(tmp_path, reference):
    rc, out, cache, err = run_job(tmp_path, "cap", INPROCESS, nproc=2, MAX_BYTES="100", FAULTS="raise:1:6")
    assert rc == 0, err[-4000:]
    for rank in range(2):
        batches = [r for r in records(out, rank) if r["ev"] == "batch"]
        assert {r["step"] for r in batches} == set(range(STEPS))
        assert all(r["h"] == reference[(rank, r["step"])] for r in batches), f"rank {rank}: a wrong batch"
        assert all(r["src"] == "direct" for r in batches)
    assert err.count("MMAP data cache off") == 2, "one warning per worker process"
    assert "max_bytes=100" in err and "SIGBUS" not in err
    assert leftovers(cache) == []
