"""CheckpointlessTrainerCallback with a real Hugging Face Trainer (tiny Llama from a LlamaConfig, synthetic tokens,
DDP on gloo): recovered runs log the same loss at every step, end with the same `train_loss`, global step and
parameters (bitwise) as the fault-free run and train on the same batches - SIGKILL and exceptions, gradient
accumulation, 2 and 4 ranks. The same script runs unchanged under torchrun and plain python, and HF's own disk
checkpoints are the fallback tier when memory has nothing."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from conftest import HYPERPODRUN, TORCHRUN, free_port
from test_checkpoint import events

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "hf_trainer_worker.py")

SEED = int(os.environ.get("HYPERPODRUN_TEST_SEED", random.randrange(1 << 30)))
print(f"test_hf_trainer: HYPERPODRUN_TEST_SEED={SEED}")
_rng = random.Random(SEED)

# 5 micro-batches per rank and epoch. A: every step logged. B: gradient accumulation (optimizer steps of 2, 2 and
# 1 micro-batches per epoch) and a log every 3 steps, so the loss accumulated since the last log crosses restores.
CONFIGS = {"A": (4, {"STEPS": "8", "ACCUM": "1", "LOG_EVERY": "1"}),
           "B": (2, {"STEPS": "7", "ACCUM": "2", "LOG_EVERY": "3"})}


def _run(cmd: list[str], out, env_extra: dict, timeout: float) -> tuple[int, str, str]:
    out.mkdir()
    env = dict(os.environ, OUT_DIR=str(out), HYPERPODRUN_SHM_DIR=str(out.parent / "shm"), **env_extra)
    if cmd[0] == sys.executable:   # plain python: no launcher's environment
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{cmd[0]} timed out:\n{stderr.decode()[-3000:]}")
    return proc.returncode, str(out), stderr.decode()


def hyperpodrun(tmp_path, name: str, nproc: int, env_extra: dict, timeout: float = 180) -> tuple[int, str, str]:
    cmd = [HYPERPODRUN, "--nproc-per-node", str(nproc), "--inprocess-restart", "--heartbeat-interval", "0.5",
           "--heartbeat-timeout", "10", "--inprocess-timeout", "60", "--log-dir", str(tmp_path / f"logs-{name}"),
           "--rdzv-id", name, WORKER]
    return _run(cmd, tmp_path / name, env_extra, timeout)


def torchrun(tmp_path, name: str, nproc: int, env_extra: dict, timeout: float = 120) -> tuple[int, str, str]:
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), WORKER]
    return _run(cmd, tmp_path / name, env_extra, timeout)


def plain(tmp_path, name: str, env_extra: dict, timeout: float = 120) -> tuple[int, str, str]:
    return _run([sys.executable, WORKER], tmp_path / name, env_extra, timeout)


def result(out: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"rank{rank}.pt"))


def trained(out: str, rank: int) -> dict[str, str]:
    """`step.micro` -> digest of the micro-batch trained there (the last time: after a restore)."""
    seen: dict[str, str] = {}
    with open(os.path.join(out, f"batches{rank}.txt")) as f:
        for line in f:
            key, digest, _gen = line.split()
            seen[key] = digest
    return seen


def logged(out: str, rank: int) -> dict[int, dict]:
    """Global step -> what on_log received at that step (the last time: after a restore); training logs only."""
    seen: dict[int, dict] = {}
    with open(os.path.join(out, f"logs{rank}.txt")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec["logs"]:
                seen[rec["step"]] = rec["logs"]
    return seen


def assert_same(ref: str, got: str, nproc: int, info: str) -> None:
    for rank in range(nproc):
        a, b = result(ref, rank), result(got, rank)
        assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"]), info
        assert a["train_loss"] == b["train_loss"], f"rank {rank}: train_loss {b['train_loss']} != {a['train_loss']}"
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"rank {rank}: parameter {k} differs\n{info}"
        for pid, st in a["opt"]["state"].items():
            for n, v in st.items():
                assert torch.equal(v, b["opt"]["state"][pid][n]), f"rank {rank}: optimizer {pid}.{n} differs"
        assert a["log_history"] == b["log_history"], f"rank {rank}: log_history differs\n{info}"
        assert logged(ref, rank) == logged(got, rank), f"rank {rank}: logged losses differ\n{info}"
        assert trained(ref, rank) == trained(got, rank), f"rank {rank} trained on other batches\n{info}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Fault-free runs, one per configuration: A under hyperpodrun, B under torchrun (the same script unchanged:
    the recovered B runs under hyperpodrun must end bitwise equal to it)."""
    cache: dict[str, str] = {}

    def get(config: str) -> str:
        if config not in cache:
            nproc, env = CONFIGS[config]
            tmp = tmp_path_factory.mktemp(f"ref-hf-{config}")
            launch = hyperpodrun if config == "A" else torchrun
            rc, out, err = launch(tmp, "ref", nproc, env)
            assert rc == 0, err[-3000:]
            res = result(out, 0)
            assert res["global_step"] == int(env["STEPS"]) and res["restored_step"] is None
            steps = int(env["STEPS"])
            assert sorted(logged(out, 0)) == [s for s in range(1, steps + 1) if s % int(env["LOG_EVERY"]) == 0]
            cache[config] = out
        return cache[config]
    return get


def _faults_a() -> tuple[str, list[tuple[int, ...]]]:
    """SIGKILL of a rank at the top of an optimizer step, then (generation 1) an exception in training_step.
    A fault in step s+1 comes after every rank saved step s, unless it interrupted a survivor sealing it."""
    s1 = _rng.randrange(2, 5)
    s2 = _rng.randrange(s1 + 1, 8)
    return f"kill:{_rng.randrange(4)}:{s1}:0;raise:{_rng.randrange(4)}:{s2}:0:1", [(s1 - 1, s1), (s2 - 1, s2)]


def _faults_b() -> tuple[str, list[tuple[int, ...]]]:
    """An exception in training_step in the middle of an accumulation (its second micro-batch: steps that start
    at global step 0 or 1 mod 3 have two), then SIGKILL in the next generation, then an exception after train()
    returned (every rank saved the last step: train() restored there only finishes)."""
    s1 = _rng.choice([3, 4])
    s2 = _rng.randrange(s1 + 1, 7)
    spec = f"raise:{_rng.randrange(2)}:{s1}:1;kill:{_rng.randrange(2)}:{s2}:0:1;raise:{_rng.randrange(2)}:-1:0:2"
    return spec, [(s1 - 1, s1), (s2 - 1, s2), (7,)]


@pytest.mark.slow
@pytest.mark.parametrize("config,faults", [("A", _faults_a), ("B", _faults_b)],
                         ids=["4ranks-kill-then-raise", "2ranks-accumulate-raise-kill-raise-after-train"])
def test_trainer_recovers_bitwise_exact(tmp_path, reference, config, faults):
    nproc, env = CONFIGS[config]
    spec, expected = faults()
    rc, out, err = hyperpodrun(tmp_path, "faulty", nproc, {**env, "FAULTS": spec})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    with open(os.path.join(out, "faults.txt")) as f:
        assert len(f.read().splitlines()) == len(expected), info
    restored = [e for e in events(tmp_path, "faulty") if e["event"] == "state_restored"]
    assert [e["step"] for e in restored if e["source"] == "memory" and e["lost_steps"] <= 1] == \
        [e["step"] for e in restored] and len(restored) == len(expected), info
    assert all(e["step"] in steps for e, steps in zip(restored, expected)), info
    assert_same(reference(config), out, nproc, info)
    assert result(out, 0)["restored_step"] in expected[-1], info


def _oldest_transformers() -> dict:
    """The environment that makes a worker import the oldest supported transformers (scripts/_venv.sh installs it
    into the virtual environment, beside the newest)."""
    from hyperpodrun.integrations.transformers import TESTED
    path = os.path.join(sys.prefix, "oldest-transformers")
    if not os.path.isdir(os.path.join(path, f"transformers-{TESTED[0]}.dist-info")):
        pytest.fail(f"transformers {TESTED[0]} is not in {path}: run the tests with scripts/test.sh, which installs it")
    return {"PYTHONPATH": os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH", "")) if p)}


@pytest.mark.slow
def test_the_oldest_supported_transformers_recovers_bitwise_exact_too(tmp_path):
    """The same script and faults on transformers 5.17 (what a GPU image ships; it lacks `_initial_global_step`):
    an exception mid-accumulation, a SIGKILL, an exception after train() returned - bitwise equal to the
    fault-free run on that version, every step restored from memory."""
    from hyperpodrun.integrations.transformers import TESTED
    nproc, env = CONFIGS["B"]
    env = {**env, **_oldest_transformers()}
    rc, ref, err = torchrun(tmp_path, "ref-oldest", nproc, env)
    assert rc == 0, err[-3000:]
    assert result(ref, 0)["transformers"] == TESTED[0]
    spec, expected = _faults_b()
    rc, out, err = hyperpodrun(tmp_path, "faulty-oldest", nproc, {**env, "FAULTS": spec})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    assert result(out, 0)["transformers"] == TESTED[0], info
    restored = [e for e in events(tmp_path, "faulty-oldest") if e["event"] == "state_restored"]
    assert [e["source"] for e in restored] == ["memory"] * len(expected), info
    assert_same(ref, out, nproc, info)


def test_the_newest_supported_transformers_is_the_one_installed():
    """The test extra installs the newest 5.x; the callback says which it is tested with."""
    import transformers

    from hyperpodrun.integrations.transformers import TESTED
    assert transformers.__version__ == TESTED[-1], "update TESTED (and the README) to the transformers tested"


@pytest.mark.slow
def test_a_model_built_outside_keeps_its_live_state(tmp_path, reference):
    """The model built once outside the wrapped function; the Trainer, its optimizer and DDP are made again in
    every generation. An exception in training_step: no rank copies its state back (the model holds the step's
    values, the new optimizer is given the previous one's state tensors), nothing is trained again, and the run
    ends bitwise equal to the fault-free one."""
    nproc, env = CONFIGS["A"]
    rank, step = _rng.randrange(4), _rng.randrange(2, 7)
    spec = f"raise:{rank}:{step}:0"
    rc, out, err = hyperpodrun(tmp_path, "outside", nproc, {**env, "FAULTS": spec, "MODEL_OUTSIDE": "1"})
    info = f"FAULTS={spec} seed={SEED}\n{err[-3000:]}"
    assert rc == 0, info
    how = {}
    for r in range(nproc):
        with open(os.path.join(out, f"restores.rank{r}")) as f:
            how[r] = dict(line.split() for line in f)
    assert all(how[r]["1"] == "live" for r in range(nproc)), f"{how}\n{info}"
    restored = [e for e in events(tmp_path, "outside") if e["event"] == "state_restored"]
    assert len(restored) == 1 and restored[0]["lost_steps"] == 0, f"{restored}\n{info}"
    assert_same(reference("A"), out, nproc, info)


@pytest.mark.slow
def test_process_level_restart_resumes_from_local_snapshots(tmp_path, reference):
    """Without --inprocess-restart HPWrapper only calls the function: an exception mid-accumulation ends the
    workers, the launcher starts them again (--max-restarts), and the new processes restore from the snapshots
    the old ones left in shared memory - bitwise equal to the fault-free torchrun run."""
    nproc, env = CONFIGS["B"]
    step = _rng.choice([3, 4])
    cmd = [HYPERPODRUN, "--nproc-per-node", str(nproc), "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
           "--rdzv-id", "restarted", WORKER]
    rc, out, err = _run(cmd, tmp_path / "restarted", {**env, "FAULTS": f"raise:{_rng.randrange(2)}:{step}:1"}, 180)
    info = f"step {step} seed={SEED}\n{err[-3000:]}"
    assert rc == 0 and "process-level restart 1/1" in err, info
    assert result(out, 0)["restored_step"] in (step - 1, step), info
    assert_same(reference("B"), out, nproc, info)


@pytest.mark.slow
def test_plain_python_and_hf_disk_checkpoints_as_fallback(tmp_path):
    """Plain python runs the script unchanged (snapshots are local and go at exit). A second process resuming
    from HF's disk checkpoint of step 3 (memory has nothing: a new process) ends bitwise equal to the first."""
    rc, first, err = plain(tmp_path, "first", {"SAVE_STEPS": "3"})
    assert rc == 0, err[-3000:]
    a = result(first, 0)
    assert a["global_step"] == 8 and a["restored_step"] is None
    assert not list((tmp_path / "shm").rglob("slot*")), "snapshots left after exit"
    rc, second, err = plain(tmp_path, "second", {"SAVE_STEPS": "3", "HF_DIR": os.path.join(first, "hf"),
                                                 "RESUME": "checkpoint-3"})
    assert rc == 0, err[-3000:]
    b = result(second, 0)
    assert b["global_step"] == 8 and b["restored_step"] is None, "memory should have had nothing"
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), f"parameter {k} differs after the disk resume"
    assert [e for e in a["log_history"] if "loss" in e] == [e for e in b["log_history"] if "loss" in e]
    assert sorted(logged(second, 0)) == [4, 5, 6, 7, 8]
    # HF's semantics after a disk resume: train_loss averages the steps this call trained
    losses = [logged(second, 0)[s]["loss"] for s in range(4, 9)]
    assert b["train_loss"] == pytest.approx(sum(losses) / 5, rel=1e-12)


def test_training_arguments_before_the_wrapper_are_refused(tmp_path):
    """TrainingArguments at module level creates the process group before HPWrapper: a restart could not create
    it again (a respawned rank would hang), so the job ends at once with one line saying what to move."""
    rc, out, err = hyperpodrun(tmp_path, "early", 2, {"EARLY_ARGS": "1", "STEPS": "2"}, timeout=120)
    assert rc != 0 and "SetupOrderError" in err and "move that call into the wrapped function" in err, err[-3000:]
    assert not os.path.exists(os.path.join(out, "rank0.pt"))


def test_callback_checks_arguments_and_the_trainer_internals(monkeypatch):
    from transformers import TrainerCallback
    from hyperpodrun import CheckpointManager
    from hyperpodrun.errors import MissingDependencyError, SetupOrderError
    from hyperpodrun.integrations import transformers as hf
    cb = hf.CheckpointlessTrainerCallback(checkpoint_manager=CheckpointManager())
    assert isinstance(cb, TrainerCallback)
    with pytest.raises(TypeError, match="needs the CheckpointManager"):
        hf.CheckpointlessTrainerCallback(checkpoint_manager=object())
    with pytest.raises(ValueError, match="save_every"):
        hf.CheckpointlessTrainerCallback(checkpoint_manager=CheckpointManager(), save_every=0)
    with pytest.raises(MissingDependencyError, match=r"lacks .*_run_epoch\(\)"):
        hf._check_internals(object())
    with pytest.raises(MissingDependencyError, match="no transformers.Trainer runs this callback"):
        cb.on_train_begin(None, None, None)
    import hyperpodrun.runtime.torch_state as ts
    import hyperpodrun.runtime.wrapper as wrapper
    monkeypatch.setattr(ts, "_group_before_wrapper", True)
    monkeypatch.setattr(wrapper, "inprocess_enabled", lambda: True)
    with pytest.raises(SetupOrderError, match="TrainingArguments"):
        hf.CheckpointlessTrainerCallback(checkpoint_manager=CheckpointManager())


def test_transformers_stays_optional():
    code = ("import sys, hyperpodrun; from hyperpodrun import CheckpointManager, HPWrapper; import hyperpodrun.integrations; "
            "print('transformers' in sys.modules); sys.modules['transformers'] = None\n"
            "try:\n    import hyperpodrun.integrations.transformers\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and lines[0] == "False", res.stdout + res.stderr
    assert lines[1].startswith("MissingDependencyError") and "pip install" in lines[1], res.stdout
