"""The durable tier against a real S3-protocol server on loopback (moto's server mode, started here): a job
SIGKILLed whole after its second fallback checkpoint comes back by itself from S3 and ends bitwise equal to the
fault-free run; the checkpoint loads with plain torch.distributed.checkpoint at 2 ranks without hyperpodrun; a
stopped object server never holds up the training, and a restore never takes a partial or corrupt checkpoint;
a store that cannot work ends the job at start with exit 2 and one line."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import (SCRIPTS, TORCHRUN, Launcher, assert_same_ckpt_state, free_port, read_events,
                      wait_until, write_script)

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

WORKER = str(SCRIPTS / "ckpt_worker.py")
RANKS = 3
BUCKET = "ckpt"
CREDS = {"AWS_ACCESS_KEY_ID": "hyperpodrun-test", "AWS_SECRET_ACCESS_KEY": "hyperpodrun-test",
         "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's S3 server on 127.0.0.1 in its own session; `auth`: it checks credentials (refuses every key)."""

    def __init__(self, launcher: Launcher, auth: bool = False) -> None:
        self.port = free_port()
        self.env = {**CREDS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}
        server_env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}
        self.proc = launcher.start([], cmd=[sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                            str(self.port)], env=server_env)
        self.client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                   aws_access_key_id="hyperpodrun-test", aws_secret_access_key="hyperpodrun-test")
        if not auth:
            wait_until(self._make_bucket, 30, 0.05, "the S3 server answers")

    def _make_bucket(self) -> bool:
        try:
            self.client.create_bucket(Bucket=BUCKET)
        except Exception:
            return False
        return True

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", ())]

    def complete_steps(self, prefix: str) -> list[int]:
        return sorted(int(k.split("/")[-2].split("_")[1]) for k in self.keys(prefix) if k.endswith("/manifest.json"))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("s3"))
    try:
        yield S3Server(launcher)
    finally:
        launcher.cleanup()


def job(tmp_path: Path, name: str) -> list[str]:
    """The hyperpodrun command line of a 3-rank ckpt_worker job (the same each time it is started again)."""
    return ["--nproc-per-node", str(RANKS), "--inprocess-restart", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", "10", "--log-dir", str(tmp_path / f"logs-{name}"), "--rdzv-id", name,
            "--standby-workers", "0", WORKER]


def worker_env(tmp_path: Path, out: Path, extra: dict) -> dict:
    out.mkdir(exist_ok=True)
    return {"OUT_DIR": str(out), "HYPERPODRUN_SHM_DIR": str(tmp_path / "shm"), "MODE": "allreduce", "DIM": "64",
            "STEPS": "12", **extra}


def events_of(tmp_path: Path, name: str) -> list[dict]:
    return read_events(tmp_path / f"logs-{name}")


def test_whole_job_killed_resumes_from_s3_bitwise_and_loads_with_plain_dcp(tmp_path, launcher, s3):
    ref_out = tmp_path / "ref"
    res = launcher.run(job(tmp_path, "ref"), log_dir=False, timeout=180,
                       env=worker_env(tmp_path, ref_out, {"DUMP_PARAMS": "1"}))
    assert res.rc == 0, res

    url = f"s3://{BUCKET}/wholejob"
    out = tmp_path / "run"
    env = worker_env(tmp_path, out, {**s3.env, "FALLBACK_DIR": url, "FALLBACK_EVERY": "3", "STEP_SLEEP": "0.25"})
    first = launcher.start(job(tmp_path, "run"), log_dir=False, env=env)
    wait_until(lambda: len(s3.complete_steps("wholejob/")) >= 2 or first.popen.poll() is not None, 120, 0.05,
               "the second durable checkpoint")
    os.killpg(first.pid, signal.SIGKILL)          # the agent (its reaper then ends every worker)
    first.popen.wait(timeout=10)
    wait_until(lambda: not launcher.leftovers(), 30, 0.05, "every process of the killed job is gone")
    shutil.rmtree(tmp_path / "shm")               # its shared memory is gone with it
    newest = max(s3.complete_steps("wholejob/"))
    assert 6 <= newest < 12, newest
    local = tmp_path / "downloaded"                # as `aws s3 cp --recursive` would
    local.mkdir()
    for key in s3.keys(f"wholejob/step_{newest:012d}/"):
        s3.client.download_file(BUCKET, key, str(local / key.rsplit("/", 1)[1]))

    again = launcher.start(job(tmp_path, "run"), log_dir=False, env=env).wait(180)
    assert again.rc == 0, again
    where = f"{url}/step_{newest:012d}"
    restored = [e for e in events_of(tmp_path, "run") if e["event"] == "state_restored"]
    assert restored and restored[-1]["source"] == "disk" and restored[-1]["step"] == newest, restored
    assert restored[-1]["location"] == where
    assert sum(where in line for line in again.err.splitlines()) == 1, again.err[-3000:]   # one console line
    assert_same_ckpt_state(ref_out, out, ranks=RANKS)

    # the same checkpoint (downloaded before the job went on: retention keeps the newest 2), loads with plain DCP
    # at 2 ranks
    load = write_script(tmp_path, "load_dcp.py", LOAD_WITH_DCP)
    res = launcher.run([str(load), str(local), str(ref_out / f"params.step{newest}.pt")], timeout=120,
                       cmd=[TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())])
    assert res.rc == 0, res
    assert res.out.count("loaded equal") == 2, res


LOAD_WITH_DCP = """
import sys
import torch, torch.nn as nn, torch.distributed as dist
import torch.distributed.checkpoint as dcp
assert "hyperpodrun" not in sys.modules
dist.init_process_group("gloo")
DIM = 64
torch.manual_seed(123)            # other values than the checkpoint's
model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, 4 * DIM), nn.GELU(),
                      nn.Linear(4 * DIM, DIM), nn.GELU(), nn.Linear(DIM, 1))
sd = {"model": model.state_dict()}
dcp.load(sd, checkpoint_id=sys.argv[1])
model.load_state_dict(sd["model"])
want = torch.load(sys.argv[2])
assert "hyperpodrun" not in sys.modules
for k, v in model.state_dict().items():
    assert torch.equal(v, want[k]), k
meta = dcp.FileSystemReader(sys.argv[1]).read_metadata()
assert "opt.state.0.exp_avg" in meta.state_dict_metadata, sorted(meta.state_dict_metadata)[:20]
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: loaded equal", flush=True)
dist.destroy_process_group()
"""


def test_stopped_store_never_holds_up_training_and_restore_skips_partial_and_corrupt(tmp_path, launcher, s3):
    url = f"s3://{BUCKET}/stalled"
    out = tmp_path / "run"
    env = worker_env(tmp_path, out, {**s3.env, "FALLBACK_DIR": url, "FALLBACK_EVERY": "2", "STEP_SLEEP": "0.2",
                                     "STEPS": "14", "HYPERPODRUN_DURABLE_TIMEOUT_S": "1"})
    proc = launcher.start(job(tmp_path, "stall"), log_dir=False, env=env)
    # two complete checkpoints first: the restore below needs an older one to fall back to
    wait_until(lambda: len(s3.complete_steps("stalled/")) >= 2 or proc.popen.poll() is not None, 120, 0.05,
               "two durable checkpoints")
    os.kill(s3.proc.pid, signal.SIGSTOP)           # the object server stops answering, mid-upload or not
    try:
        def progress(rank: int) -> int:
            try:
                return int((out / f"progress.rank{rank}").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return -1
        # every rank trains to its last step while the server is stopped: no step waits for the store
        wait_until(lambda: all(progress(r) == 14 for r in range(RANKS)), 120, 0.05, "training to the end")
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)
    res = proc.wait(180)
    assert res.rc == 0, res
    notes = [e for e in events_of(tmp_path, "stall") if e["event"] == "durable_checkpoint"]
    assert any(e["outcome"] in ("failed", "skipped") for e in notes), notes
    assert any(e["outcome"] == "written" for e in notes), notes

    # a restore never takes a checkpoint without its manifest (a newer copy of the newest one, less its manifest),
    # nor one of whose objects does not match its description (the newest one, a byte of rank 1's object
    # flipped): the next older complete one
    complete = s3.complete_steps("stalled/")
    assert len(complete) >= 2, complete
    newest, good = complete[-1], complete[-2]
    for key in s3.keys(f"stalled/step_{newest:012d}/"):
        name = key.rsplit("/", 1)[1]
        body = s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        if name != "manifest.json":
            s3.client.put_object(Bucket=BUCKET, Key=f"stalled/step_{newest + 100:012d}/{name}", Body=body)
        if name == "__1_0.distcp":
            s3.client.put_object(Bucket=BUCKET, Key=key, Body=body[:100] + bytes([body[100] ^ 0xFF]) + body[101:])
    shutil.rmtree(tmp_path / "shm")
    env2 = {**env, "STEPS": str(good + 1), "STEP_SLEEP": "0"}
    res = launcher.start(job(tmp_path, "stall2"), log_dir=False, env=env2).wait(180)
    assert res.rc == 0, res
    restored = [e for e in events_of(tmp_path, "stall2") if e["event"] == "state_restored"]
    assert restored and restored[0]["step"] == good and restored[0]["source"] == "disk", restored


NO_BOTO3 = "raise ImportError(\"No module named 'boto3'\")\n"


@pytest.mark.parametrize("case", ["missing-bucket", "wrong-credentials", "missing-extra", "bad-url"])
def test_a_store_that_cannot_work_ends_the_job_at_start_with_one_line(tmp_path, launcher, s3, case):
    env = worker_env(tmp_path, tmp_path / "out", {**s3.env, "FALLBACK_DIR": f"s3://{BUCKET}/start"})
    if case == "missing-bucket":
        env["FALLBACK_DIR"] = "s3://no-such-bucket/run"
        want = "bucket 'no-such-bucket' does not exist"
    elif case == "wrong-credentials":
        env.update(S3Server(launcher, auth=True).env)
        want = "the store refused these credentials"
    elif case == "missing-extra":
        shim = tmp_path / "shim" / "boto3"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text(NO_BOTO3)
        env["PYTHONPATH"] = str(tmp_path / "shim")
        want = "pip install 'hyperpodrun[s3]'"
    else:
        env["FALLBACK_DIR"] = "s3:/ckpt/run"
        want = "only s3://bucket/prefix URLs and directories are supported"
    res = launcher.run(["--nproc-per-node", "1", "--log-dir", str(tmp_path / "logs"), WORKER], log_dir=False,
                       env=env, cwd=tmp_path, timeout=120)
    assert res.rc == 2, res
    lines = [ln for ln in res.err.splitlines() if "hyperpodrun: " in ln and "Error: " in ln]
    assert len(lines) == 1 and want in lines[0], res
    assert "Traceback" not in res.err, res
    assert not (tmp_path / "s3:").exists()


ROUND_TRIP = """
import os, sys, torch
from hyperpodrun import CheckpointManager
url, shm = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
big = torch.nn.Linear(2600, 2600, bias=False)          # 27 MB of parameters: a multipart upload on S3
opt = torch.optim.Adam(big.parameters())
big(torch.ones(1, 2600)).sum().backward()
opt.step()
state = {"model": big, "opt": opt, "note": {"epoch": 3, "names": ("a", "b")}}
os.environ["HYPERPODRUN_SHM_DIR"] = shm + "/a"
cm = CheckpointManager(fallback_dir=url)
cm.save(1, state)
cm.wait()
want = {k: v.clone() for k, v in big.state_dict().items()}
with torch.no_grad():
    big.weight.zero_()
os.environ["HYPERPODRUN_SHM_DIR"] = shm + "/b"           # a new process's view: no memory, only the store
fresh = {"model": big, "opt": opt, "note": None}
again = CheckpointManager(fallback_dir=url)
assert again.restore(fresh) == 1 and again.restored_from == "disk", again.restored_from
assert torch.equal(big.weight, want["weight"]) and fresh["note"] == {"epoch": 3, "names": ("a", "b")}
print("round trip ok")
"""


@pytest.mark.parametrize("where", ["s3", "dir"])
def test_a_state_larger_than_one_upload_part_round_trips(tmp_path, launcher, s3, where):
    """One plain process (no launcher): the state goes to the store in more than one part and comes back equal."""
    url = f"s3://{BUCKET}/roundtrip" if where == "s3" else str(tmp_path / "ckpt")
    path = write_script(tmp_path, "roundtrip.py", ROUND_TRIP)
    res = launcher.run([str(path), url, str(tmp_path / "shm")], cmd=[sys.executable], env=s3.env, timeout=120)
    assert res.rc == 0 and "round trip ok" in res.out, res
    if where == "s3":
        assert s3.keys("roundtrip/step_000000000001/manifest.json")
    else:
        mode = os.stat(tmp_path / "ckpt" / "step_000000000001").st_mode & 0o777
        assert mode == 0o700 and os.stat(tmp_path / "ckpt" / "step_000000000001" / "__0_0.distcp").st_mode & 0o777 \
            == 0o600
