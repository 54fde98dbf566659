"""CheckpointlessCallback with a real Lightning Trainer (DDP on gloo, 4 ranks, MMAPDataModule), written the
way the product note writes Tier 4: recovered runs end bitwise equal to the fault-free run and every rank
trains on the same batches, with mid-epoch faults, gradient accumulation, offload and checksums."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from test_checkpoint import events, launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "lightning_worker.py")

SEED = int(os.environ.get("HYPERPODRUN_TEST_SEED", random.randrange(1 << 30)))
print(f"test_lightning: HYPERPODRUN_TEST_SEED={SEED}")
_rng = random.Random(SEED)


def run_job(tmp_path, name: str, env_extra: dict, timeout: float = 300) -> tuple[int, str, str]:
    return launch(tmp_path, name, WORKER, {"CACHE_DIR": str(tmp_path / "cache"), **env_extra}, timeout,
                  inprocess_timeout=90)


def batches(out: str, rank: int) -> dict[int, str]:
    """Batch number -> digest of the batch trained on (the last time it was trained on, after a restart)."""
    seen: dict[int, str] = {}
    with open(os.path.join(out, f"batches{rank}.txt")) as f:
        for line in f:
            n, digest = line.split()[:2]
            seen[int(n)] = digest
    return seen


def assert_same(ref: str, got: str, info: str) -> None:
    for rank in range(4):
        a = torch.load(os.path.join(ref, f"rank{rank}.pt"))
        b = torch.load(os.path.join(got, f"rank{rank}.pt"))
        assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]), info
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"rank {rank}: parameter {k} differs\n{info}"
        for pid, st in a["opt"]["state"].items():
            for n, v in st.items():
                if torch.is_tensor(v):
                    assert torch.equal(v, b["opt"]["state"][pid][n]), f"rank {rank}: optimizer {pid}.{n} differs"
        assert batches(ref, rank) == batches(got, rank), f"rank {rank} trained on other batches\n{info}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(accum: str, steps: str, **data: str) -> str:
        key = "-".join([accum, steps, *(f"{k}={v}" for k, v in sorted(data.items()))])
        if key not in cache:
            tmp = tmp_path_factory.mktemp(f"ref-lightning-{accum}-{steps}")
            rc, out, err = run_job(tmp, "ref", {"ACCUM": accum, "STEPS": steps, **data})
            assert rc == 0, err[-3000:]
            cache[key] = out
        return cache[key]
    return get


# 8 batches per rank and epoch: STEPS optimizer steps cross epoch boundaries; faults land mid-epoch
CASES = [
    # SIGKILL in training_step, then (generation 1) an exception between backward and the optimizer step
    ("1", "20", lambda s1, s2: f"kill:{_rng.randrange(4)}:{s1}:top;raise:{_rng.randrange(4)}:{s2}:prestep:1", {}),
    # gradient accumulation (4 optimizer steps per epoch), offloaded and checksummed snapshots: an exception
    # in training_step (on a micro-batch that does not step), then SIGKILL before an optimizer step
    ("2", "12", lambda s1, s2: f"raise:{_rng.randrange(4)}:{s1}:top;kill:{_rng.randrange(4)}:{s2}:prestep:1",
     {"OFFLOAD": "1", "CHECKSUM": "1"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("accum,steps,faults,extra", CASES, ids=["kill-then-raise", "accumulate-offload"])
def test_lightning_run_recovers_bitwise_exact(tmp_path, reference, accum, steps, faults, extra):
    # from step 2: a fault at step 1 can come while a survivor is still sealing its first snapshot, and then
    # the job rightly starts again from the beginning (nothing was committed by every rank)
    s1 = _rng.randrange(2, int(steps) // 2)
    s2 = _rng.randrange(s1 + 1, int(steps) - 1)
    spec = faults(s1, s2)
    rc, out, err = run_job(tmp_path, "faulty", {"ACCUM": accum, "STEPS": steps, "FAULTS": spec, **extra})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    restored = [e for e in events(tmp_path, "faulty") if e["event"] == "state_restored"]
    assert len(restored) == 2 and all(e["lost_steps"] <= 1 for e in restored), info
    # restored at the fault's step, or one later when the other ranks completed that step (a replica has it);
    # the first fault (at the top of a step) may also interrupt a survivor sealing that step: then one earlier
    assert restored[0]["step"] in (s1 - 1, s1, s1 + 1) and restored[1]["step"] in (s2, s2 + 1), info
    assert_same(reference(accum, steps), out, info)


@pytest.mark.slow
@pytest.mark.parametrize("raiser", ["not-rank-0", "rank-0"])
def test_a_module_built_outside_keeps_its_live_state(tmp_path, reference, raiser):
    """The LightningModule built once outside the wrapped function; the Trainer, DDP and the optimizers are made
    again in every generation. An exception between backward and the optimizer step: no rank copies its state
    back from a slot - the module holds the step's values, the new optimizer is given the previous one's state
    tensors - and the run ends bitwise equal to the fault-free one."""
    # rank 0 raising is the hard case: it is a step behind the others, and DDP's construction broadcast (from rank
    # 0) would overwrite the survivors' live values with its older ones before restore() - the callback makes
    # DDP without it in a restart generation
    rank, step = (0 if raiser == "rank-0" else _rng.randrange(1, 4)), _rng.randrange(3, 9)
    spec = f"raise:{rank}:{step}:prestep"
    # the raise waits until the others have saved the step (FAULT_AFTER_PEERS_SAVED): a restart that catches a
    # survivor between its optimizer step and that save makes the job restore the step before, and that survivor
    # then rightly copies it back from its slot (seen under load, in CI) - a timing, not what this test is about
    rc, out, err = run_job(tmp_path, "outside", {"STEPS": "12", "FAULTS": spec, "MODEL_OUTSIDE": "1",
                                                 "FAULT_AFTER_PEERS_SAVED": "1"})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    how = {}
    for r in range(4):
        with open(os.path.join(out, f"restores.rank{r}")) as f:
            how[r] = dict(line.split() for line in f)
    # the others completed the step (the raise comes after the gradient all-reduce): the raising rank gets that
    # step from a replica's live tensors - no copy from a slot, and nothing trained again
    assert all(how[r]["1"] in ("live", "replica") for r in range(4)), f"{how}\n{info}"
    assert sum(how[r]["1"] == "live" for r in range(4)) >= 1, f"{how}\n{info}"
    restored = [e for e in events(tmp_path, "outside") if e["event"] == "state_restored"]
    assert len(restored) == 1 and restored[0]["step"] == step + 1, f"{restored}\n{info}"
    assert restored[0]["lost_steps"] == 0, f"{restored}\n{info}"
    # the failed fit's teardown left the module where it was (Lightning moves it to host memory; the next fit
    # would move it back): only the last generation's normal end moved it
    for r in range(4):
        with open(os.path.join(out, f"cpu_calls.rank{r}")) as f:
            assert f.read().split() == ["1"], f"rank {r}: module.cpu() called in these generations\n{info}"
    assert_same(reference("1", "12"), out, info)


@pytest.mark.slow
def test_default_sampler_and_a_dataset_drawn_at_setup_resume_exactly(tmp_path, reference):
    """What most Lightning scripts write: `DataLoader(shuffle=True)` with the DistributedSampler Lightning puts
    in, over a dataset drawn from the global RNG in train_dataloader() (Lightning's RandomDataset style).
    A SIGKILL mid-epoch: the job finishes (no DataStateLostError past the cache window), every rank trains
    on the batches of the fault-free run, and the end state is bitwise equal."""
    data = {"SAMPLER": "default", "DATA": "drawn"}
    step = _rng.choice([s for s in range(3, 17) if s % 8])   # 8 batches per epoch: never at an epoch start
    spec = f"kill:{_rng.randrange(4)}:{step}:top"
    rc, out, err = run_job(tmp_path, "default", {"ACCUM": "1", "STEPS": "20", "FAULTS": spec, **data})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    assert "DataStateLostError" not in err, info
    restored = [e for e in events(tmp_path, "default") if e["event"] == "state_restored"]
    assert len(restored) == 1, info
    ref = reference("1", "20", **data)
    assert_same(ref, out, info)
    shards = [set(batches(ref, r).values()) for r in range(4)]
    assert all(not (shards[a] & shards[b]) for a in range(4) for b in range(a)), \
        "ranks trained on the same batches: Lightning's DistributedSampler was not put in"
    cache = tmp_path / "cache"
    left = list(cache.rglob("*")) if cache.exists() else []
    assert not left, f"the MMAP cache was left behind: {left}"


def test_callback_is_a_lightning_callback_and_checks_its_arguments():
    import lightning.pytorch as pl
    from hyperpodrun import CheckpointlessCallback, CheckpointManager
    cb = CheckpointlessCallback(checkpoint_manager=CheckpointManager())
    assert isinstance(cb, pl.Callback) and isinstance(cb, CheckpointlessCallback)
    with pytest.raises(TypeError, match="needs the CheckpointManager"):
        CheckpointlessCallback(checkpoint_manager=object())
    with pytest.raises(ValueError, match="save_every"):
        CheckpointlessCallback(checkpoint_manager=CheckpointManager(), save_every=0)


def test_importing_hyperpodrun_does_not_import_lightning():
    code = ("import sys, hyperpodrun; from hyperpodrun import CheckpointManager, HPWrapper, MMAPDataModule; "
            "print([m for m in ('lightning', 'pytorch_lightning') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
