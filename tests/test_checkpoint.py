"""CheckpointManager: recovered runs end bitwise equal to fault-free runs (CPU, 4 ranks), corrupt snapshots
are never used, lost state ends the job with exit code 75 or recovers from the disk fallback."""
from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import assert_same_ckpt_state as assert_same
from inprocess_helpers import STANDBY   # HYPERPODRUN_TEST_STANDBY_WORKERS=N: the jobs run with standbys on

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "ckpt_worker.py")
HYPERPODRUN = os.path.join(os.path.dirname(sys.executable), "hyperpodrun")


def run_job(tmp_path, name: str, mode: str, faults: str = "", extra_env: dict | None = None,
            timeout: float = 240, nproc: int = 4) -> tuple[int, str, str]:
    return launch(tmp_path, name, WORKER, {"MODE": mode, "FAULTS": faults, "STEPS": "10", "DIM": "64",
                                           **(extra_env or {})}, timeout, nproc=nproc)


def launch(tmp_path, name: str, worker: str, worker_env: dict, timeout: float = 240,
           inprocess_timeout: int = 60, flags: tuple = (), started=None, nproc: int = 4) -> tuple[int, str, str]:
    """Run `worker` on `nproc` ranks (4) under `hyperpodrun --inprocess-restart` with OUT_DIR=tmp_path/name:
    (exit code, OUT_DIR, the agent's stderr)."""
    out = tmp_path / name
    out.mkdir()
    env = dict(os.environ, OUT_DIR=str(out), HYPERPODRUN_SHM_DIR=str(tmp_path / "shm"), **worker_env)
    cmd = [HYPERPODRUN, "--nproc-per-node", str(nproc), "--inprocess-restart", "--heartbeat-interval", "0.5",
           "--heartbeat-timeout", "10", "--inprocess-timeout", str(inprocess_timeout),
           "--log-dir", str(tmp_path / f"logs-{name}"), "--rdzv-id", name, *(flags or STANDBY), worker]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if started is not None:   # the test acts on the running job (e.g. kills the agent)
        started(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"job {name} timed out:\n{stderr.decode()[-3000:]}")
    return proc.returncode, str(out), stderr.decode()


def worker_lines(tmp_path, name: str, words: tuple = ("restor", "slot", "snapshot", "sent", "rank")) -> str:
    """The lines of every rank's log files that name one of `words`: what a failed assertion shows besides the
    agent's stderr (which says what the agent saw, not how each rank planned its restore)."""
    run_dir = tmp_path / f"logs-{name}" / name
    out = []
    for f in sorted(run_dir.glob("attempt_*/rank_*/*")):
        if f.is_file():
            out += [f"{f.parent.name}: {line}" for line in f.read_text(errors="replace").splitlines()
                    if any(w in line for w in words)]
    return "\n".join(out[-60:])


def events(tmp_path, name: str) -> list[dict]:
    run_dir = tmp_path / f"logs-{name}" / name
    recs = []
    for f in run_dir.glob("*.events.jsonl"):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Fault-free runs, one per mode, computed on first use."""
    cache: dict[str, str] = {}

    def get(mode: str) -> str:
        if mode not in cache:
            tmp = tmp_path_factory.mktemp(f"ref-{mode}")
            rc, out, err = run_job(tmp, "ref", mode)
            assert rc == 0, err[-3000:]
            cache[mode] = out
        return cache[mode]
    return get


# Faults at a random rank and step (the seed is printed; HYPERPODRUN_TEST_SEED repeats a run). Each case
# is two successive faults: the second fires in generation 1, after the first recovery.
SEED = int(os.environ.get("HYPERPODRUN_TEST_SEED", random.randrange(1 << 30)))
print(f"test_checkpoint: HYPERPODRUN_TEST_SEED={SEED}")
_rng = random.Random(SEED)


def _two_faults(first: str, second: str) -> str:
    (k1, w1), (k2, w2) = first.split("@"), second.split("@")
    s1 = _rng.randrange(1, 5)
    s2 = _rng.randrange(s1 + 1, 9)
    return f"{k1}:{_rng.randrange(4)}:{s1}:{w1};{k2}:{_rng.randrange(4)}:{s2}:{w2}:1"


CASES = [
    # hand-written all-reduce loop, DDP (gradient all-reduce in its comm hook), FSDP2 (DTensor shards;
    # "allreduce" = inside backward while gradient reduce-scatters are in flight), DDP with a ZeRO-1
    # sharded optimizer (ZeroRedundancyOptimizer)
    (mode, _two_faults(*pair), extra)
    for mode in ("allreduce", "ddp", "fsdp2", "zero")
    for pair, extra in ((("kill@top", "raise@allreduce"), ""),            # SIGKILL, then exception in the collective
                        (("raise@prestep", "kill@top"), "checksum+offload"))  # between backward and step, then SIGKILL
]


def test_warm_respawned_rank_recovers_bitwise_exact(tmp_path, reference):
    """A SIGKILLed DDP rank forked from the warm spawner (the fault waits until it is ready): the forked
    process restores and trains on to the same bits as the run without the fault."""
    import threading
    gate = tmp_path / "gate"
    stop = threading.Event()

    def open_gate() -> None:
        end = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < end:
            try:
                ready = any(e["event"] == "warm_ready" for e in events(tmp_path, "warm"))
            except ValueError:   # a line being written
                ready = False
            if ready:
                gate.touch()
                return
            stop.wait(0.05)
    opener = threading.Thread(target=open_gate, daemon=True)
    opener.start()
    try:
        rc, out, err = run_job(tmp_path, "warm", "ddp", "kill:2:4:top", extra_env={"FAULT_GATE": str(gate)})
    finally:
        stop.set()
        opener.join()
    assert rc == 0, err[-3000:]
    respawn = [e for e in events(tmp_path, "warm") if e["event"] == "respawn"]
    assert [(e["rank"], e["warm"]) for e in respawn] == [(2, True)], err[-3000:]
    assert_same(reference("ddp"), out)


@pytest.mark.slow
@pytest.mark.parametrize("mode,faults,extra", CASES)
def test_recovered_run_is_bitwise_equal(tmp_path, reference, mode, faults, extra):
    rc, out, err = run_job(tmp_path, "faulty", mode, faults,
                           extra_env={"CHECKSUM": "1", "OFFLOAD": "1"} if extra else None)
    assert rc == 0, f"FAULTS={faults} seed={SEED}\n" + err[-3000:]
    assert_same(reference(mode), out)
    restored = [e for e in events(tmp_path, "faulty") if e["event"] == "state_restored"]
    assert restored, "no state_restored event in the agent log"
    assert all(e["lost_steps"] <= 1 for e in restored)
    assert all(e["step"] > 0 for e in restored), "a restart went back to step 0"


def test_corrupt_snapshot_is_detected_and_never_used(tmp_path, monkeypatch):
    from hyperpodrun import CheckpointManager
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "corrupt-test")
    monkeypatch.setenv("RANK", "0")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cm = CheckpointManager(enable_checksum=True, shm_dir=str(tmp_path))
    cm.save(1, {"model": model, "opt": opt})
    saved_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    cm.save(2, {"model": model, "opt": opt})
    from hyperpodrun.state.slots import snapshot_io
    slot = next(p for p in (os.path.join(cm.slot_dir(), f"slot{i}") for i in (0, 1))
                if snapshot_io.header(open(p, "rb").read(), p)[0] == 2)
    data = bytearray(open(slot, "rb").read())
    data[snapshot_io.data_end(data, slot) - 10] ^= 0xFF   # flip one byte of the payload
    open(slot, "wb").write(bytes(data))
    # a new process (a replacement) knows nothing of these slots: it checks them, skips step 2, restores step 1
    fresh = torch.nn.Linear(4, 4)
    step = CheckpointManager(shm_dir=str(tmp_path)).restore(
        {"model": fresh, "opt": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    assert step == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved_at_1[k])
    # this process still holds step 2's tensors (unchanged since): objects built again get them from there -
    # and never from the slot, which was written after it was sealed (so it is checked, and skipped)
    again = torch.nn.Linear(4, 4)
    assert cm.restore({"model": again, "opt": torch.optim.SGD(again.parameters(), lr=0.1)}) == 2
    assert cm.restored_from == "live" and torch.equal(again.weight, model.weight)
    model.weight.data.add_(1.0)                   # and once those change too, step 1 from its slot
    again = torch.nn.Linear(4, 4)
    assert cm.restore({"model": again, "opt": torch.optim.SGD(again.parameters(), lr=0.1)}) == 1
    assert cm.restored_from == "shm" and torch.equal(again.weight, saved_at_1["weight"])


@pytest.mark.slow
def test_a_killed_ranks_rotten_slot_is_caught_after_its_copy_and_the_round_retried(tmp_path, reference):
    """A replacement sums its predecessor's newest slot beside copying out of it (not before): a slot whose
    byte went bad after it was sealed is caught when the copy is done, removed, and the generation fails like
    any exception; the next round restores without it (from a DDP replica), and the end is bitwise exact."""
    rc, out, err = run_job(tmp_path, "rot", "ddp", "rot-kill:1:5:top", extra_env={"LOG_INFO": "1"})
    assert rc == 0, err[-3000:] + "\n--- the ranks' logs:\n" + worker_lines(tmp_path, "rot")
    rotted = int(open(os.path.join(out, "rotted.rank1")).read())
    assert "checksum mismatch" in err and "the slot was removed" in err, err[-3000:]
    got = restores(out)
    assert max(got[1]) >= 2, f"the round with the rotten slot was not retried: {got}"
    restored = [e for e in events(tmp_path, "rot") if e["event"] == "state_restored"]
    assert restored and restored[-1]["step"] == rotted, restored
    assert_same(reference("ddp"), out)


@pytest.mark.slow
def test_state_lost_ends_with_documented_code_never_step_zero(tmp_path):
    rc, out, err = run_job(tmp_path, "lost", "allreduce", "wipe-kill:2:4:top")
    assert rc == 75, err[-3000:]
    assert "survives nowhere" in err
    entries = open(os.path.join(out, "entries.rank0")).read().split()
    assert entries[:2] == ["0", "0"] and len(entries) == 3, f"a rank restarted training: {entries}"


@pytest.mark.slow
def test_state_lost_recovers_from_disk_fallback(tmp_path, reference):
    rc, out, err = run_job(tmp_path, "fallback", "allreduce", "wipe-kill:2:4:top",
                           extra_env={"FALLBACK_DIR": str(tmp_path / "fallback")})
    assert rc == 0, err[-3000:]
    restored = [e for e in events(tmp_path, "fallback") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "disk"
    assert_same(reference("allreduce"), out)


@pytest.mark.slow
def test_model_built_outside_the_wrapped_function(tmp_path, reference):
    """Survivors keep their model and optimizer objects across the re-entry; restore rewinds them."""
    rc, out, err = run_job(tmp_path, "outside", "allreduce", _two_faults("raise@prestep", "kill@top"),
                           extra_env={"BUILD_OUTSIDE": "1"})
    assert rc == 0, err[-3000:]
    assert_same(reference("allreduce"), out)


def restores(out: str, ranks: int = 4) -> dict[int, dict[int, str]]:
    """rank -> generation -> how the rank got its state there (CheckpointManager.restored_from)."""
    got: dict[int, dict[int, str]] = {}
    for rank in range(ranks):
        with open(os.path.join(out, f"restores.rank{rank}")) as fh:
            for line in fh:
                gen, _start, how = line.split()
                got.setdefault(rank, {})[int(gen)] = how
    return got


def vias(out: str) -> dict[int, dict[int, str]]:
    """rank -> generation -> how a replica peer sent the rank its state (CheckpointManager.restored_via)."""
    got: dict[int, dict[int, str]] = {}
    for rank in range(4):
        with open(os.path.join(out, f"via.rank{rank}")) as fh:
            for line in fh:
                gen, via = line.split()
                got.setdefault(rank, {})[int(gen)] = via
    return got


@pytest.mark.slow
def test_survivors_keep_their_own_state_unless_it_moved_past_the_restored_step(tmp_path, reference):
    """Model and optimizer built outside the re-executed function, so survivors keep them. Generation 0: an
    exception between backward and the optimizer step - the raising rank's state is still at the committed
    step, it keeps it (nothing copied back). Generation 1: an exception right after an optimizer step, before
    its save - that rank went past the committed step and must copy it back. Generation 2: a SIGKILL - its
    replacement copies its state from shared memory.
    The end state is bitwise the fault-free run's in every case."""
    r1, r2, r3 = _rng.randrange(4), _rng.randrange(4), _rng.randrange(4)
    s1 = _rng.randrange(1, 4)
    s2 = _rng.randrange(s1 + 1, 7)
    s3 = _rng.randrange(s2 + 1, 9)
    faults = f"raise:{r1}:{s1}:prestep;raise:{r2}:{s2}:poststep:1;kill:{r3}:{s3}:top:2"
    # each fault fires once every other rank has saved the step it comes in: otherwise a peer that the restart
    # catches between its optimizer step and that save rightly makes the job restore the step before, and the
    # raising rank must then copy back too (seen under load, in CI)
    rc, out, err = run_job(tmp_path, "live", "allreduce", faults,
                           extra_env={"BUILD_OUTSIDE": "1", "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02"})
    info = f"FAULTS={faults} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    assert_same(reference("allreduce"), out)
    how = restores(out)
    assert how[r1][1] == "live", f"rank {r1} raised before its optimizer step but copied its state back: {how}\n{info}"
    assert how[r2][2] == "shm", f"rank {r2} had stepped past the committed step but kept its state: {how}\n{info}"
    assert how[r3][3] == "shm", f"the replacement of rank {r3} did not load its snapshot: {how}\n{info}"
    # the survivors of the SIGKILL keep or copy depending on where each was: one interrupted before its
    # optimizer step keeps its state; one that had stepped copies back; and where the victim died before its
    # newest save was sealed, the committed step is one back for everybody (a timing, not a rule)
    assert all(how[r][3] in ("live", "shm") for r in range(4)), f"{how}\n{info}"


@pytest.mark.slow
def test_an_exception_while_the_last_save_is_still_copying_keeps_that_step(tmp_path, reference):
    """enable_offload=True with a state large enough that its background copy is still running when the rank
    raises at the top of the next step: that snapshot's data was final, so it is kept - the raising rank
    restores nothing (its own objects are at that step) and no step is trained twice; the end state is
    bitwise the fault-free run's."""
    rank, step = _rng.randrange(4), _rng.randrange(3, 8)
    faults = f"raise:{rank}:{step}:top"
    # only the raising rank holds the large state; it raises once every other rank has saved that step (so the
    # step is theirs too), while its own copy - 512 MiB - is still running
    rc, out, err = run_job(tmp_path, "inflight", "allreduce", faults,
                           extra_env={"BUILD_OUTSIDE": "1", "OFFLOAD": "1", "BIG_MB": "512", "BIG_RANK": str(rank),
                                      "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.001"})
    info = f"FAULTS={faults} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    assert_same(reference("allreduce"), out)
    how = restores(out)
    assert how[rank][1] == "live", f"rank {rank} copied back the state it had just saved: {how}\n{info}"
    entries = open(os.path.join(out, f"entries.rank{rank}")).read().split("\n")
    assert entries[1].split()[:2] == ["1", str(step)], f"the step in the last save was lost: {entries}\n{info}"


@pytest.mark.slow
def test_rank_that_lost_its_snapshots_gets_them_from_a_ddp_replica(tmp_path, reference):
    """DDP replicates over its process group: a rank whose shared memory is gone recovers from a peer.
    The rank goes once every peer has saved step 4 (FAULT_AFTER_PEERS_SAVED): otherwise a peer that the restart
    catches between its optimizer step and that save rightly makes the job restore step 3 (seen under load)."""
    rc, out, err = run_job(tmp_path, "replica", "ddp", "wipe-kill:2:4:top",
                           extra_env={"CHECKSUM": "1", "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02"})
    assert rc == 0, err[-3000:]
    restored = [e for e in events(tmp_path, "replica") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4
    assert_same(reference("ddp"), out)
    # the survivors build their DDP modules again in the re-executed function, but their managers still hold
    # the previous generation's tensors at step 4: the new objects get them on the device (nothing read from a
    # slot), and the donor sends them as they are
    how, via = restores(out), vias(out)
    assert how[2][1] == "replica" and via[2][1] == "live", f"{how} {via}"
    assert all(how[r][1] == "live" and via[r][1] == "None" for r in (0, 1, 3)), f"{how} {via}"


@pytest.mark.slow
def test_rank_killed_with_its_snapshots_comes_back_from_the_other_optimizer_instance(tmp_path, reference):
    """num_distributed_optimizer_instances=2 over 4 ranks (gloo): gradients all-reduced over every rank, the
    Adam state sharded within instances {0,1} and {2,3}, so ranks 1 and 3 hold the same shard. Rank 1 is
    SIGKILLed together with its snapshots (as when its node's memory goes): its replacement gets its state
    from rank 3, the other ranks keep their processes, and every rank ends bitwise equal to the fault-free run."""
    rc, out, err = run_job(tmp_path, "instances", "instances", "wipe-kill:1:4:top",
                           extra_env={"INSTANCES": "2", "CHECKSUM": "1", "FAULT_AFTER_PEERS_SAVED": "1",
                                      "STEP_SLEEP": "0.02"})
    assert rc == 0, err[-3000:] + worker_lines(tmp_path, "instances")
    restored = [e for e in events(tmp_path, "instances") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4, restored
    ref = reference("instances")
    assert_same(ref, out)
    how = restores(out)
    assert how[1][1] == "replica" and all(how[r][1] != "replica" for r in (0, 2, 3)), how
    # the shards really differ between positions and match across instances (what the replica map relies on)
    shard = {r: torch.load(os.path.join(ref, f"rank{r}.pt"))["opt"] for r in range(4)}
    assert set(shard[1]) == set(shard[3]) and set(shard[0]) == set(shard[2]) and set(shard[0]) != set(shard[1])
    for r in (0, 2, 3):   # a survivor kept its process: one pid in every generation
        pids = {line.split()[2] for line in open(os.path.join(out, f"entries.rank{r}")).read().splitlines()}
        assert len(pids) == 1, f"rank {r} was restarted: {pids}"


@pytest.mark.slow
def test_a_pipeline_rank_killed_with_its_snapshots_comes_back_from_its_own_stage(tmp_path, reference):
    """2 pipeline stages x 2 data-parallel ranks with 2 optimizer instances, in Megatron's order (rank = dp +
    2 * stage; CheckpointManager(pipeline_model_parallel_size=2)): rank 1's replica is rank 0, in its own
    stage, world / (PP * N) = 1 rank on - not rank 3, of the other stage, which the map paired it with when it
    ignored the pipeline. Rank 1 is SIGKILLed together with its snapshots; it comes back with rank 0's state and
    every rank ends bitwise equal to the fault-free run."""
    rc, out, err = run_job(tmp_path, "pipeline", "pipeline", "wipe-kill:1:4:top",
                           extra_env={"FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02"})
    assert rc == 0, err[-3000:] + worker_lines(tmp_path, "pipeline")
    restored = [e for e in events(tmp_path, "pipeline") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4, restored
    assert_same(reference("pipeline"), out)
    how = restores(out)
    assert how[1][1] == "replica" and all(how[r][1] != "replica" for r in (0, 2, 3)), how


@pytest.mark.slow
def test_a_checkpoint_taken_under_another_layout_is_refused_in_one_line(tmp_path):
    """A job with 2 optimizer instances completes, leaving fallback checkpoints; the same job started again with
    another rank order would restore them into another rank's part of the model: every rank refuses with one
    line naming both layouts, and the job ends with exit code 2 before any step."""
    fallback = str(tmp_path / "fallback")
    rc, _out, err = run_job(tmp_path, "first", "instances", extra_env={"FALLBACK_DIR": fallback,
                                                                         "FALLBACK_EVERY": "5"})
    assert rc == 0, err[-3000:]
    rc, out, err = run_job(tmp_path, "again", "instances", extra_env={"FALLBACK_DIR": fallback,
                                                                        "RANK_ORDER": "tp-cp-pp-ep-dp"})
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and "taken under another parallel layout" in err, err[-3000:]
    assert "order=tp-cp-ep-dp-pp) than this job's (world=4 tp=1 pp=1 cp=1 instances=2 order=tp-cp-pp-ep-dp)" in err
    assert not os.path.exists(os.path.join(out, "rank0.pt"))


@pytest.mark.slow
def test_three_optimizer_instances_survive_two_losses_of_the_same_shard(tmp_path):
    """num_distributed_optimizer_instances=3 over 6 ranks: ranks 0, 2 and 4 hold the same shard. Ranks 0 and 2
    lose their snapshots and die at the same moment (with 2 instances that loses the shard: exit 75, see
    test_rank_and_its_replica_lost_together_end_with_exit_75); rank 4's copy brings both back, bitwise."""
    env = {"INSTANCES": "3"}
    rc, ref, err = run_job(tmp_path, "ref3", "instances", extra_env=env, nproc=6)
    assert rc == 0, err[-3000:]
    rc, out, err = run_job(tmp_path, "three", "instances", "wipe-kill:0:4:top;wipe-kill:2:4:top",
                           extra_env={**env, "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02"}, nproc=6)
    assert rc == 0, err[-3000:] + worker_lines(tmp_path, "three")
    restored = [e for e in events(tmp_path, "three") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4, restored
    assert_same(ref, out, ranks=6)
    how = restores(out, ranks=6)
    assert how[0][1] == how[2][1] == "replica" and all(how[r][1] != "replica" for r in (1, 3, 4, 5)), how


@pytest.mark.slow
@pytest.mark.parametrize("reuse_live,sent", [("1", "live"), ("0", "slot")])
def test_rank_that_lost_its_snapshots_gets_a_survivors_live_tensors(tmp_path, reference, reuse_live, sent):
    """Explicit replica group {0,1,2,3} over the hand-written all-reduce loop (every rank holds the same
    state), objects built outside the re-executed function: the survivors' objects are still at step 4 when
    rank 2 goes with its snapshots, so its donor (rank 0) sends its live tensors (metadata in safe_codec, the
    tensors over the process group) - no slot is read or decoded on either side. With reuse_live=False the
    donor keeps no live state and sends its slot's bytes. Either way the receiver holds step 4 in its own slot
    again: killed once more before its next save (generation 1), its replacement loads it from there. Both
    end bitwise equal to the fault-free run."""
    rc, out, err = run_job(tmp_path, f"stream{reuse_live}", "allreduce", "wipe-kill:2:4:top;kill:2:4:top:1",
                           extra_env={"BUILD_OUTSIDE": "1", "REPLICAS": "0,1,2,3", "REUSE_LIVE": reuse_live,
                                      "CHECKSUM": "1", "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02"})
    assert rc == 0, err[-3000:]
    restored = [e for e in events(tmp_path, f"stream{reuse_live}") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4, restored
    assert_same(reference("allreduce"), out)
    how, via = restores(out), vias(out)
    assert how[2][1] == "replica" and via[2][1] == sent, f"{how} {via}"
    assert all(how[r][1] == ("live" if sent == "live" else "shm") for r in (0, 1, 3)), f"{how} {via}"
    assert how[2][2] == "shm" and via[2][2] == "None", f"the receiver did not keep step 4: {how} {via}"


@pytest.mark.slow
def test_rank_and_its_replica_lost_together_end_with_exit_75(tmp_path):
    """Explicit replica groups {0,2},{1,3}: losing 0 and 2 at once loses that state; no fallback -> 75."""
    rc, out, err = run_job(tmp_path, "pairlost", "allreduce", "wipe-kill:0:4:top;wipe-kill:2:4:top",
                           extra_env={"REPLICAS": "0,2/1,3"})
    assert rc == 75, err[-3000:]
    assert "rank(s) [0, 2]" in err and "survives nowhere" in err
    entries = open(os.path.join(out, "entries.rank1")).read().split()
    assert entries[:2] == ["0", "0"] and len(entries) == 3, f"a rank restarted training: {entries}"


def test_bad_arguments_get_clear_errors(tmp_path):
    from hyperpodrun import CheckpointManager
    cm = CheckpointManager(shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"step must be .* int >= 0"):
        cm.save(-1, {})
    with pytest.raises(ValueError, match=r"step must be"):
        cm.save("3", {})
    with pytest.raises(TypeError, match="state must be a dict"):
        cm.save(1, [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="fallback_dir"):
        CheckpointManager(fallback_every=10)
    cm.save(torch.tensor(2), {"n": 5})                  # a 0-d tensor step is an int
    assert cm.restore({"n": 0}) == 2


Pair = collections.namedtuple("Pair", "a b")


def test_plain_values_come_back_as_independent_copies(tmp_path, monkeypatch):
    """Values (nested containers, namedtuples, tensors) are restored as they were saved, and their tensors do
    not alias the slot file, which the next saves rewrite."""
    from hyperpodrun import CheckpointManager
    monkeypatch.setenv("RANK", "0")
    cm = CheckpointManager(shm_dir=str(tmp_path), enable_checksum=True)
    cm.save(1, {"v": Pair(torch.arange(4.0), [7, (8, torch.ones(3))])})
    state = {"v": None}
    assert cm.restore(state) == 1
    v = state["v"]
    assert isinstance(v, Pair) and v.b[0] == 7 and v.b[1][0] == 8
    assert torch.equal(v.a, torch.arange(4.0)) and torch.equal(v.b[1][1], torch.ones(3))
    cm.save(3, {"v": Pair(torch.full((4,), -1.0), [0, (0, torch.zeros(3))])})   # rewrites slot 1 in place
    assert torch.equal(v.a, torch.arange(4.0)) and torch.equal(v.b[1][1], torch.ones(3))


def test_replica_layout_is_validated():
    from hyperpodrun import CheckpointManager
    from hyperpodrun.state.restore.replicas import ReplicaLayoutError, instance_groups, validate_groups
    assert instance_groups(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ReplicaLayoutError, match="does not divide"):
        instance_groups(6, 4)
    with pytest.raises(ReplicaLayoutError, match="twice"):
        validate_groups([[0, 1], [1, 2]], 4)
    with pytest.raises(ReplicaLayoutError, match="world has 4"):
        validate_groups([[0, 7]], 4)
    with pytest.raises(ValueError, match="not both"):
        CheckpointManager(replica_groups=[[0, 1]], num_distributed_optimizer_instances=2)


@pytest.mark.slow
def test_node_loss_recovers_from_the_copy_on_another_node(tmp_path, reference):
    """2 nodes x 2 ranks, each node with its own shared memory: rank 0 dies together with its node's
    snapshots; its slot copy on node 1 (rank 2) brings it back, and the run ends bitwise as without fault."""
    from conftest import free_port
    port = free_port()
    out = tmp_path / "twonode"
    out.mkdir()
    procs = []
    for node in (0, 1):
        env = dict(os.environ, MODE="allreduce", OUT_DIR=str(out), FAULTS="wipe-kill:0:5:top", STEPS="10",
                   DIM="64", HYPERPODRUN_SHM_DIR=str(tmp_path / f"shm-node{node}"))
        cmd = [HYPERPODRUN, "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--nproc-per-node", "2", "--inprocess-restart", "--heartbeat-interval",
               "0.5", "--heartbeat-timeout", "10", "--inprocess-timeout", "60", "--log-dir",
               str(tmp_path / f"logs{node}"), "--rdzv-id", "twonode", WORKER]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            errs.append(err.decode())
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(e[-3000:] for e in errs)
    recs = []
    for f in (tmp_path / "logs0" / "twonode").glob("*.events.jsonl"):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    restored = [e for e in recs if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "peer" and restored[0]["step"] >= 4, restored
    assert_same(reference("allreduce"), str(out))


def _without_numpy(tmp_path) -> dict:
    """Environment under which no process of the job (agent, workers, standbys) can import numpy: a
    sitecustomize on PYTHONPATH puts a finder first on sys.meta_path that refuses it."""
    hide = tmp_path / "no-numpy"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.abc, importlib.machinery, sys\n"
        "class _Refuse(importlib.abc.Loader):\n"
        "    def create_module(self, spec):\n"
        "        raise ModuleNotFoundError(f'No module named {spec.name!r} (hidden by the test)', name=spec.name)\n"
        "    def exec_module(self, module):\n"
        "        pass\n"
        "class _NoNumpy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy' or name.startswith('numpy.'):\n"
        "            return importlib.machinery.ModuleSpec(name, _Refuse())\n"
        "        return None\n"
        "sys.meta_path.insert(0, _NoNumpy())\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.slow
def test_a_node_loss_with_replicas_finishes_exactly_without_numpy(tmp_path, reference):
    """Ranks 2 and 3 lose their snapshots together (as when their node goes) with replica groups {0,2},{1,3},
    and numpy cannot be imported anywhere in the job: their replicas stream them their state (no .numpy() on
    the way) and the run ends bitwise equal to the fault-free run."""
    rc, out, err = run_job(tmp_path, "nonumpy", "allreduce", "wipe-kill:2:4:top;wipe-kill:3:4:top",
                           extra_env={"REPLICAS": "0,2/1,3", "FAULT_AFTER_PEERS_SAVED": "1", "STEP_SLEEP": "0.02",
                                      **_without_numpy(tmp_path)})
    assert rc == 0, err[-3000:]
    restored = [e for e in events(tmp_path, "nonumpy") if e["event"] == "state_restored"]
    assert restored and restored[0]["source"] == "replica" and restored[0]["step"] == 4, restored
    how = restores(out)
    assert how[2][1] == how[3][1] == "replica", how
    assert_same(reference("allreduce"), out)


@pytest.mark.slow
def test_an_outsiders_newer_step_in_the_restore_inventory_is_refused(tmp_path, reference):
    """After an exception on rank 0 at step 4, rank 1's seat sends an inventory claiming step 1000000 without
    the workers' key (FORGE_INVENTORY): every rank refuses it, the plan would send rank 1 its state from a
    replica, but nothing goes to a rank without the MAC - the round is tried again, and the next one restores
    the true step. No rank ever restores step 1000000, and the run ends bitwise equal to the fault-free run."""
    rc, out, err = run_job(tmp_path, "forged", "allreduce", "raise:0:4:top",
                           extra_env={"REPLICAS": "0,1,2,3", "FORGE_INVENTORY": "1:1", "STEP_SLEEP": "0.02",
                                      **_without_numpy(tmp_path)})
    assert rc == 0, err[-3000:]
    recs = events(tmp_path, "forged")
    restored = [e for e in recs if e["event"] == "state_restored"]
    assert restored and all(e["step"] <= 4 for e in restored), restored
    assert "rank 1 sent a restore inventory without the job's MAC" in err, err[-3000:]
    assert "rank(s) [1] would be sent state" in err, err[-3000:]
    starts = {int(line.split()[1]) for r in range(4) for line in open(os.path.join(out, f"entries.rank{r}"))}
    assert max(starts) <= 4, starts
    assert_same(reference("allreduce"), out)


def test_after_a_restore_to_an_older_step_the_abandoned_newer_slot_goes_first(tmp_path, monkeypatch):
    """A rank that sealed step 5 while a peer had only step 4: the job restores step 4. Its slot of step 5 is
    the abandoned history - the next snapshot must overwrite it, never the slot of step 4 (else, when a second
    fault comes before every rank has sealed the new step 5, no step is held by every rank: StateLostError,
    seen with FSDP2 under load), and no later restore may plan with the old step 5."""
    from hyperpodrun import CheckpointManager
    from hyperpodrun.state import restoring as checkpoint   # where restore() finds its gather
    from hyperpodrun.state.restore import restore_plan
    from hyperpodrun.state.slots import snapshot_io
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abandoned-test")
    monkeypatch.setenv("RANK", "0")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt}
    cm = CheckpointManager(shm_dir=str(tmp_path))
    values = {}
    for step in (4, 5):
        with torch.no_grad():
            model.weight.add_(1.0)
        cm.save(step, state)
        values[step] = model.weight.detach().clone()
    cm.wait()
    peer = {"shm": [3, 4], "disk": [], "latest": 4, "copies": {}, "never_committed": False, "live": None, "at": 4}

    def gather_with_a_peer(mine, channel):       # a second rank that never sealed step 5
        return restore_plan.Gathered([mine, peer], {})
    monkeypatch.setattr(checkpoint, "gather", gather_with_a_peer)
    fresh = torch.nn.Linear(4, 4)
    state = {"model": fresh, "opt": torch.optim.SGD(fresh.parameters(), lr=0.1)}
    assert cm.restore(state) == 4 and cm.restored_from == "shm"
    assert torch.equal(fresh.weight, values[4])

    def held() -> dict[int, str]:
        return {snapshot_io.header(open(p, "rb").read(), p)[0]: p
                for p in (os.path.join(cm.slot_dir(), f"slot{i}") for i in (0, 1)) if os.path.exists(p)}
    assert set(held()) == {4}, "the slot of the abandoned step 5 is still offered"
    with torch.no_grad():
        fresh.weight.add_(2.0)                    # step 5 again, another history
    cm.save(5, state)
    cm.wait()
    assert set(held()) == {4, 5}, "the new step 5 overwrote the slot of the restored step 4"
    # the peer sealed neither: a second fault restores step 4 again, from the slot kept
    again = torch.nn.Linear(4, 4)
    assert cm.restore({"model": again, "opt": torch.optim.SGD(again.parameters(), lr=0.1)}) == 4
    assert torch.equal(again.weight, values[4])
