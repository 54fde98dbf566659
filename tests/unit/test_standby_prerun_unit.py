"""Standby pre-run's pure parts (agent/workers/prerun.py, hyperpodrun/runtime/park.py): the environment a standby
runs the script ahead with, when it may become a rank, the pool's memory of a give-up, the replay of what the
script printed ahead, and - in a child process - the watch that gives up at a rank's variable and the promotion
at the park."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

from hyperpodrun.agent.workers import prerun
from hyperpodrun.env import RANK_BOUND_VARS
from hyperpodrun.runtime import park

WORKER_ENV = {"RANK": "5", "LOCAL_RANK": "1", "HYPERPODRUN_LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
              "GROUP_RANK": "1", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
              "TORCHELASTIC_ERROR_FILE": "/logs/attempt_2/rank_5/error.json", "HYPERPODRUN_GENERATION": "2",
              "HYPERPODRUN_CONTROL": "ipc:///x", "HYPERPODRUN_NODE_RANK": "1", "TORCHELASTIC_RUN_ID": "job",
              "HYPERPODRUN_RUN_DIR": "/logs/job", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_a_standby_runs_ahead_with_its_slot_and_the_job_but_no_rank():
    ahead = prerun.ahead_env(WORKER_ENV)
    assert not set(RANK_BOUND_VARS) & ahead.keys()
    # its slot's and the job's: what a script's top may read
    for name in ("LOCAL_RANK", "HYPERPODRUN_LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "HYPERPODRUN_RUN_DIR",
                 "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        assert ahead[name] == WORKER_ENV[name]
    assert "RANK" in RANK_BOUND_VARS and "LOCAL_RANK" not in RANK_BOUND_VARS


def test_a_parked_standby_becomes_any_rank_of_its_slot_whose_environment_is_the_one_it_ran_with():
    ahead = prerun.ahead_env(WORKER_ENV)
    other_rank = dict(WORKER_ENV, RANK="1", ROLE_RANK="1", WORLD_SIZE="6", MASTER_PORT="1234",
                      HYPERPODRUN_GENERATION="7", TORCHELASTIC_RESTART_COUNT="7")
    assert prerun.mismatch(ahead, WORKER_ENV) is None
    assert prerun.mismatch(ahead, other_rank) is None   # the rank's variables are given at the promotion
    moved = prerun.mismatch(ahead, dict(WORKER_ENV, CUDA_VISIBLE_DEVICES="7"))   # a GPU map moved the rank
    assert moved is not None and "CUDA_VISIBLE_DEVICES" in moved
    added = prerun.mismatch(ahead, dict(WORKER_ENV, NEW_SETTING="1"))
    assert added is not None and "NEW_SETTING" in added
    gone = {k: v for k, v in WORKER_ENV.items() if k != "OMP_NUM_THREADS"}
    assert "OMP_NUM_THREADS" in (prerun.mismatch(ahead, gone) or "")
    many = prerun.mismatch(ahead, {k: v + "x" for k, v in WORKER_ENV.items()})
    assert many is not None and "more)" in many


def test_the_first_give_up_is_said_once_and_turns_pre_run_off():
    state = prerun.PrerunState(enabled=True)
    assert state.on
    message, level = state.give_up("it read RANK before its HPWrapper function (at train.py:3)")
    assert level == logging.INFO and "train.py:3" in message and "--standby-prerun" in message
    assert not state.on
    _, level = state.give_up("another reason")
    assert level == logging.DEBUG and state.gave_up is not None and "train.py:3" in state.gave_up
    assert not prerun.PrerunState(enabled=False).on


def test_what_the_script_printed_ahead_is_replayed_up_to_a_limit():
    mem = os.memfd_create("test")
    os.write(mem, b"line one\nline two\n")
    r, w = os.pipe()
    try:
        assert park.replay(mem, w) == len(b"line one\nline two\n")
        assert os.read(r, 1000) == b"line one\nline two\n"
        os.write(mem, b"x" * 100)
        park.replay(mem, w, limit=10)
        got = os.read(r, 1000)
        assert got.startswith(b"line one\n") and b"108 more bytes" in got
    finally:
        for fd in (mem, r, w):
            os.close(fd)


def test_nothing_parks_outside_a_standby():
    assert not park.prerunning() and not park.promoted()
    park.park("main")   # returns at once in a rank, a test, a plain python process


CHILD = textwrap.dedent("""
    import json, os, socket, sys
    from hyperpodrun.runtime import park
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    from hyperpodrun.env import RANK_BOUND_VARS
    for name in RANK_BOUND_VARS:
        os.environ.pop(name, None)
    sys.stdout.flush()
    mem = os.memfd_create("out")
    os.dup2(mem, 1)

    base = dict(os.environ)                # what the agent gave the standby to run the script with

    def await_rank(extra):
        theirs.send(json.dumps({"ready": True, **extra}).encode())
        env = dict(base, RANK="3", MASTER_PORT="4321")
        return {"argv": ["x"], "env": env, "cwd": os.getcwd()}, [os.dup(w), os.dup(2)]

    park.arm(park.Prerun(theirs, await_rank, base, os.getcwd(), {1: mem}))
    print("printed ahead", flush=True)
    os.environ["KEPT"] = "script"          # the script's own setting at its top stays
    ACTION
    park.park("main")
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "4321", os.environ
    print("as the rank", flush=True)
    os.close(1)
    report = json.loads(ours.recv(1000))
    sys.stderr.write(json.dumps({"report": report, "kept": os.environ["KEPT"], "promoted": park.promoted(),
                                 "out": os.read(r, 1000).decode()}))
""")


def _child(action: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.replace("ACTION", action)], capture_output=True, text=True,
                          timeout=120)


def test_a_parked_standby_is_promoted_with_the_rank_and_its_output_replayed():
    done = _child("pass")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stderr)
    assert got["report"]["prerun"]["function"] == "main" and got["promoted"]
    assert got["out"] == "printed ahead\nas the rank\n"   # ahead of what it prints as the rank
    assert got["kept"] == "script"


GIVE_UP = textwrap.dedent("""
    import json, os, socket, sys
    from hyperpodrun.env import RANK_BOUND_VARS
    from hyperpodrun.runtime import park
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:                                # the agent's end: what the standby said, how it exited
        theirs.close()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status), "said": json.loads(ours.recv(1000))}))
        sys.exit(0)
    ours.close()
    for name in RANK_BOUND_VARS:
        os.environ.pop(name, None)
    park.arm(park.Prerun(theirs, lambda extra: None, dict(os.environ), os.getcwd(), {}))
    ACTION
    raise SystemExit(3)                    # not reached: the standby gave up
""")


def test_a_look_at_a_rank_variable_before_the_park_gives_up_and_says_where():
    for action in ('os.environ.get("RANK")', '"WORLD_SIZE" in os.environ', 'os.getenv("MASTER_ADDR", "x")',
                   'os.environ["HYPERPODRUN_GENERATION"] = "1"', 'os.environ.setdefault("RANK", "0")',
                   'os.environb.get(b"MASTER_PORT")', 'os.environ.get("LOCAL_RANK"); os.environ.get("RANK")',
                   'import torch.distributed as dist; dist.init_process_group("gloo", rank=0, world_size=1, '
                   'store=dist.HashStore())'):
        done = subprocess.run([sys.executable, "-c", GIVE_UP.replace("ACTION", action)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, (action, done.stderr)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        why = got["said"]["prerun_gave_up"]
        assert got["exit"] == 0 and "before its HPWrapper function" in why and "(at <string>:" in why, (action, got)


def test_what_a_script_may_do_at_its_top_does_not_give_up():
    code = GIVE_UP.replace("ACTION", 'os.environ.get("LOCAL_RANK"); os.environ.copy(); dict(os.environ); '
                           'os.environ["MY_SETTING"] = "1"; print("fine")').replace(
        "raise SystemExit(3)", "theirs.send(b'{\"prerun_gave_up\": \"none\"}'); os._exit(0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["said"]["prerun_gave_up"] == "none", done.stdout


# ------------------------------------------------------------------------------------------ the pool
class _Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, int, dict]] = []

    def emit(self, event: str, message: str = "", *, level: int = logging.INFO, **fields: object) -> dict:
        self.got.append((event, level, dict(fields, msg=message)))
        return {}

    def named(self, event: str) -> list[tuple[str, int, dict]]:
        return [e for e in self.got if e[0] == event]


class _Spawner:
    """Forks `sleep` processes as standbys; keeps the standby's end of each socket to speak for it."""

    def __init__(self) -> None:
        self.forks: list[dict] = []

    def check_ready(self) -> bool:
        return True

    def fork_standby(self, slot: int, slot_dir: object = None, cuda_visible: object = None,
                     prerun: object = None) -> tuple:
        import socket
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.forks.append({"slot": slot, "prerun": prerun, "proc": proc, "end": theirs})
        return proc.pid, ours


def _pool(per_slot: int = 1, nproc: int = 1):
    from types import SimpleNamespace

    from hyperpodrun.agent.workers.standby import StandbyPool
    reaped: list[tuple[str, int]] = []
    sup = SimpleNamespace(track_extra=lambda pid: None, untrack_extra=lambda pid: None,
                          reaper=SimpleNamespace(add=lambda sid: reaped.append(("add", sid)),
                                                 remove=lambda sid: reaped.append(("del", sid))),
                          adopt=lambda lr, rank, gen, process, source: ("adopted", rank, process.pid, source))
    spawner, events = _Spawner(), _Events()
    spec = {"argv": ["train.py"], "env": prerun.ahead_env(WORKER_ENV), "cwd": "/"}
    pool = StandbyPool(sup, events, SimpleNamespace(spawner=spawner), per_slot, nproc,  # type: ignore[arg-type]
                       {"CUDA_VISIBLE_DEVICES": WORKER_ENV["CUDA_VISIBLE_DEVICES"]},
                       prerun_for=lambda lr: spec)
    return pool, spawner, events, reaped


def _req(env: dict):
    from hyperpodrun.agent.ports import SpawnRequest
    return SpawnRequest(local_rank=0, rank=int(env["RANK"]), generation=1, argv=["python", "-u", "train.py"],
                        env=env, stdout=None, stderr=None)


def _reap(fork: dict) -> None:
    fork["proc"].kill()
    fork["proc"].wait()


def test_a_give_up_is_said_once_is_no_lost_standby_and_the_next_standby_waits_before_the_script():
    pool, spawner, events, reaped = _pool()
    try:
        pool.poll()
        first = spawner.forks[0]
        assert first["prerun"]["env"] == prerun.ahead_env(WORKER_ENV) and ("add", first["proc"].pid) in reaped
        first["end"].send(json.dumps({"prerun_gave_up": "it read RANK before its HPWrapper function (at t.py:1)"})
                          .encode())
        first["end"].close()
        first["proc"].terminate()
        first["proc"].wait()   # it exits (poll reads its last words after the exit, as a fast exit would leave them)
        pool.poll()
        said = events.named("standby_prerun")
        assert len(said) == 1 and said[0][1] == logging.INFO and "t.py:1" in said[0][2]["why"], events.got
        assert not events.named("standby_lost")
        assert ("del", first["proc"].pid) in reaped
        assert len(spawner.forks) == 2 and spawner.forks[1]["prerun"] is None   # replaced at once, waiting before
    finally:
        for fork in spawner.forks:
            _reap(fork)


def test_a_parked_standby_serves_a_rank_of_its_slot_only_with_the_environment_it_ran_with():
    pool, spawner, events, reaped = _pool()
    try:
        pool.poll()
        first = spawner.forks[0]
        first["end"].send(json.dumps({"ready": True, "prerun": {"function": "main", "prerun_s": 1.5}}).encode())
        pool.poll()
        ready = events.named("standby_ready")
        assert ready and ready[0][2]["prerun"] and "run ahead to main" in ready[0][2]["msg"]
        moved = pool.spawn(_req(dict(WORKER_ENV, OMP_NUM_THREADS="8")))
        assert moved is None and "OMP_NUM_THREADS" in events.named("standby_unused")[-1][2]["why"]
        first["proc"].wait()   # killed with its process group, not handed a rank
        assert ("del", first["proc"].pid) in reaped
        pool.poll()            # its replacement runs the script ahead again
        second = spawner.forks[1]
        assert second["prerun"] is not None
        second["end"].send(json.dumps({"ready": True, "prerun": {"function": "main", "prerun_s": 1.0}}).encode())
        pool.poll()
        second["end"].send(b'{"ok": true}')   # its answer to the rank it is sent (read after the send)
        got = pool.spawn(_req(dict(WORKER_ENV, RANK="2", MASTER_PORT="999", HYPERPODRUN_GENERATION="1")))
        assert got == ("adopted", 2, second["proc"].pid, "standby")
        import socket
        task, fds, _, _ = socket.recv_fds(second["end"], 1 << 20, 2)
        for fd in fds:
            os.close(fd)
        assert json.loads(task)["env"]["RANK"] == "2"
        assert ("del", second["proc"].pid) not in reaped   # the supervisor's worker now
    finally:
        for fork in spawner.forks:
            _reap(fork)


def test_a_library_that_reads_a_rank_variable_is_named_with_the_script_line_that_called_it(tmp_path):
    (tmp_path / "somelib.py").write_text("import os\n\n\ndef rank():\n    return os.environ.get('RANK')\n")
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport somelib\n\nsomelib.rank()\n")
    action = f"import runpy; sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", GIVE_UP.replace("ACTION", action)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    why = json.loads(done.stdout.strip().splitlines()[-1])["said"]["prerun_gave_up"]
    assert f"somelib.py:5, from {script}:5)" in why, why
