"""The worker environment contract: torchrun's variables with torchrun's values, plus documented ones of ours."""
from __future__ import annotations

import json
import os
import socket
from importlib.metadata import version

import pytest

import hyperpodrun.env as env_module
from conftest import TORCHRUN, free_port, script, the_run_dir

# Every variable hyperpodrun adds to a worker's environment beyond torchrun's, and what it means. A new
# variable in hyperpodrun/env.py must be added here (and to the README's "Worker environment").
DOCUMENTED_OURS = {
    "HYPERPODRUN_CONTROL": "ipc:// endpoint of the agent's control server (in-process restart)",
    "HYPERPODRUN_RUN_DIR": "the run's log directory, <log-dir>/<run-id>",
    "HYPERPODRUN_GENERATION": "restart generation this process was started in",
    "HYPERPODRUN_INPROCESS": "'1' under --inprocess-restart",
    "HYPERPODRUN_NODE_RANK": "this node's rank (torchrun's GROUP_RANK)",
    "HYPERPODRUN_HOST": "host name used in log prefixes and failure reports",
    "HYPERPODRUN_HEARTBEAT_INTERVAL": "seconds between heartbeats (in-process restart)",
    "HYPERPODRUN_AGENT_PID": "pid of the hyperpodrun agent",
    "HYPERPODRUN_ROOTLESS": "'1': the workers' store is hosted by the agent, a fresh one per generation",
    "HYPERPODRUN_JOB_KEY": "hex of the workers' key (derived from the job secret): authenticates peer copies",
    "HYPERPODRUN_LOCAL_RANK": "the real local rank (LOCAL_RANK is 0 under --virtual-local-rank)",
    "PYTHONUNBUFFERED": "'1' unless the user set it, so worker lines reach the per-rank files at once",
    "GLOO_SOCKET_IFNAME": "'lo' on one node unless the user set it: gloo listens on loopback only",
    "NCCL_SOCKET_IFNAME": "'lo' on one node unless the user set it: NCCL's bootstrap sockets on loopback only",
    "PYTHONPATH": "hyperpodrun's boot folder first (the roll call in init_process_group), then the user's",
}

# torchrun variables whose values legitimately differ between two launches: ports, paths and run ids
VARYING = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# hyperpodrun follows torchrun 2.13, whose MASTER_ADDR rule for one node differs from older torchruns'
if not version("torch").startswith("2.13."):
    VARYING.add("MASTER_ADDR")


def _single_node_master(theirs: str) -> str:
    """Our MASTER_ADDR on one node, given torchrun's: the workers' store listens on loopback only (README,
    Security), so a name that does not resolve to one loopback address here becomes 127.0.0.1."""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(theirs, None, socket.AF_INET)}
    except OSError:
        addrs = set()
    return theirs if len(addrs) == 1 and next(iter(addrs)).startswith("127.") else "127.0.0.1"


def _envs(directory):
    return {int(name[4:-5]): json.load(open(os.path.join(directory, name)))
            for name in os.listdir(directory) if name.startswith("env_") and name.endswith(".json")}


def test_documented_list_matches_env_module():
    """The list above and hyperpodrun/env.py name the same variables of ours."""
    defined = {value for name, value in vars(env_module).items()
               if name.startswith("HYPERPODRUN_") and isinstance(value, str)}
    documented = {name for name in DOCUMENTED_OURS if name.startswith("HYPERPODRUN_")}
    assert defined == documented
    with open(env_module.__file__) as fh:
        source = fh.read()
    for name in DOCUMENTED_OURS:
        assert f'"{name}"' in source, f"{name} is documented in the test but not set in hyperpodrun/env.py"


@pytest.mark.parametrize("form", ["default", "standalone", "master-port", "virtual-local-rank",
                                  "virtual_local_rank+CUDA_VISIBLE_DEVICES"])
def test_worker_env_matches_torchrun(launcher, tmp_path, form):
    """Same script under `hyperpodrun --nproc-per-node 4` and `torchrun --nproc-per-node 4` (also with
    --standalone, --master-port, --virtual-local-rank with and without a CUDA_VISIBLE_DEVICES of the user's):
    every torchrun variable is there with torchrun's value, apart from ports, paths and run ids; ours are
    documented."""
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "torchrun"
    ours_dir.mkdir()
    theirs_dir.mkdir()
    flags = {"default": [], "standalone": ["--standalone"], "master-port": ["--master-port", str(free_port())],
             "virtual-local-rank": ["--virtual-local-rank"]}.get(form, ["--virtual_local_rank"])
    user = {"CUDA_VISIBLE_DEVICES": "6,GPU-1a2b, 2,0"} if "CUDA" in form else {}
    ours = launcher.start(["--nproc-per-node", "4", *flags, script("dump_env.py"), ours_dir], env=user)
    theirs = launcher.start(["--nproc-per-node", "4", *flags, script("dump_env.py"), theirs_dir], cmd=[TORCHRUN],
                            env=user)
    res_ours, res_theirs = ours.wait(60), theirs.wait(60)
    assert res_ours.rc == 0, res_ours
    assert res_theirs.rc == 0, res_theirs
    ours_env, theirs_env = _envs(ours_dir), _envs(theirs_dir)
    assert sorted(ours_env) == sorted(theirs_env) == [0, 1, 2, 3]
    base = launcher.env()
    run_dir = the_run_dir(launcher.log_dir)

    for rank in range(4):
        o, t = ours_env[rank], theirs_env[rank]
        torchrun_vars = {k for k in t if base.get(k) != t[k]}   # what torchrun set or changed
        assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"} <= torchrun_vars
        missing = sorted(set(t) - set(o))
        assert not missing, f"rank {rank}: torchrun sets {missing}, hyperpodrun does not"
        if "MASTER_ADDR" not in VARYING:
            assert o["MASTER_ADDR"] == _single_node_master(t["MASTER_ADDR"]), (o["MASTER_ADDR"], t["MASTER_ADDR"])
        different = {k: (o[k], t[k]) for k in sorted(set(t) - VARYING - {"MASTER_ADDR"}) if o[k] != t[k]}
        assert not different, f"rank {rank}: values differ from torchrun's (ours, torchrun's): {different}"
        assert o["OMP_NUM_THREADS"] == t["OMP_NUM_THREADS"] == "1"
        # the varying ones still have torchrun's form
        assert o["MASTER_PORT"].isdigit() and 0 < int(o["MASTER_PORT"]) < 65536
        assert o["TORCHELASTIC_RUN_ID"] and o["TORCHELASTIC_RUN_ID"] == os.path.basename(run_dir)
        assert os.path.basename(o["TORCHELASTIC_ERROR_FILE"]) == os.path.basename(t["TORCHELASTIC_ERROR_FILE"])
        assert o["TORCHELASTIC_ERROR_FILE"].startswith(str(run_dir) + os.sep)

        extra = sorted(set(o) - set(t))
        undocumented = [k for k in extra if k not in DOCUMENTED_OURS]
        assert not undocumented, f"rank {rank}: undocumented variables added by hyperpodrun: {undocumented}"
        assert o["HYPERPODRUN_RUN_DIR"] == str(run_dir)
        assert o["HYPERPODRUN_GENERATION"] == o["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert o["HYPERPODRUN_NODE_RANK"] == o["GROUP_RANK"] == "0"
        assert o["HYPERPODRUN_AGENT_PID"] == str(ours.pid)
        assert o["HYPERPODRUN_HOST"] == socket.gethostname()
        assert o["HYPERPODRUN_LOCAL_RANK"] == str(rank)
        if "virtual" in form:   # torchrun's values are compared above; spelt out here
            assert o["LOCAL_RANK"] == "0"
            assert o["CUDA_VISIBLE_DEVICES"] == (["6", "GPU-1a2b", "2", "0"][rank] if user else str(rank))
    # all ranks share one run id, one store, one world
    for key in ("TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        assert len({ours_env[r][key] for r in range(4)}) == 1, key


def test_in_process_restart_sets_its_nccl_defaults_and_keeps_a_users_own_value(launcher, tmp_path):
    """Under --inprocess-restart every worker gets hyperpodrun's NCCL settings (README, Worker environment),
    except one the user set, which is kept - with one warning naming what hyperpodrun would have set."""
    out = tmp_path / "env"
    out.mkdir()
    proc = launcher.start(["--nproc-per-node", "2", "--inprocess-restart", script("dump_env.py"), out],
                          env={"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    res = proc.wait(60)
    assert res.rc == 0, res
    for rank, env in _envs(out).items():
        expected = {**env_module.INPROCESS_NCCL_DEFAULTS, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
        assert {k: env.get(k) for k in expected} == expected, rank
    warned = [line for line in res.err.splitlines() if "TORCH_NCCL_DUMP_ON_TIMEOUT=1 is set" in line]
    assert len(warned) == 1 and "would set TORCH_NCCL_DUMP_ON_TIMEOUT=0" in warned[0], res.err
