"""Security of what a job exposes: peer-copy receivers, store servers, signed coordination records, log files.

An attacker is another local user (`setpriv` to nobody, when the tests run as root) or a process that can
reach the job's ports but does not know the job secret.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import free_port, read_events, wait_until, write_script
from proc_sockets import LISTEN, tcp_sockets
from hyperpodrun import auth, safe_fs
from hyperpodrun.agent.coordination.job_state import Coordinator, SignedRecords
from hyperpodrun.agent.observe.events import EventLog
from hyperpodrun.agent.coordination.rendezvous import agree_secret
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.errors import RendezvousError
from hyperpodrun.state.restore.peer_copy import PeerCopies

IS_ROOT = os.geteuid() == 0
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
needs_root = pytest.mark.skipif(not IS_ROOT, reason="acting as another user needs root (setpriv --reuid)")
SECRET = "s3cret-for-tests-" + "x" * 32


def as_nobody(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run Python `code` as uid/gid 65534 (the system python: the test venv may not be readable by nobody)."""
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def shared_tmp():
    """A world-writable sticky directory like /tmp that another user can reach (pytest's tmp_path cannot)."""
    path = tempfile.mkdtemp(prefix="hpr-sec-", dir="/tmp")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ peer copies
class _Store:
    """The two calls PeerCopies makes on a worker store."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def wait(self, keys, timeout) -> None:
        assert all(k in self.data for k in keys)


def _receiver(tmp_path: Path, key: bytes) -> tuple[PeerCopies, Path, tuple[str, int]]:
    """Rank 2 of 4 (2 per node): it keeps rank 0's copies, and only rank 0's."""
    base = Path(safe_fs.private_tree(str(tmp_path / "shm"), "hyperpodrun-0", "run"))
    rx = PeerCopies(str(base), rank=2, world=4, local_world=2, key=key, run_id="run")
    store = _Store()
    rx.serve(store, "127.0.0.1")
    host, port = store.get("hyperpodrun/peer-copy/2").decode().rsplit(":", 1)
    return rx, base, (host, int(port))


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc")
def test_peer_copy_receiver_refuses_connections_without_the_job_key(tmp_path):
    """Another user sends a header and a payload straight away; a client with a key derived from another
    secret does the handshake: both are refused, nothing is written, and the receiver listens on the
    address the job uses (loopback here), not on every interface."""
    key = auth.derive(b"the-job-secret-0123456789", "worker")
    rx, base, addr = _receiver(tmp_path, key)
    assert addr[0] == "127.0.0.1" and rx._server.getsockname()[0] == "127.0.0.1"
    attacker = """
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
try:
    s.sendall(struct.pack("<iqq", 0, 1, 1 << 20) + b"A" * (1 << 20))
    s.recv(1)
except OSError:
    pass
"""
    if IS_ROOT:
        res = as_nobody(attacker, addr[0], str(addr[1]))
    else:
        res = subprocess.run([sys.executable, "-c", attacker, addr[0], str(addr[1])], capture_output=True,
                             text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    with socket.create_connection(addr, timeout=10) as s:
        with pytest.raises(auth.AuthError):
            auth.client_handshake(s, auth.derive(auth.derive(b"another-secret-0123456789", "worker"),
                                                 "peer-copy"), b"peer-copy/run/2")
    wait_until(lambda: rx._refusals >= 2, 10, message="both connections refused")
    assert _files_under(base) == []


def _authenticated(addr, key: bytes) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(addr, timeout=10)
    return s, auth.client_handshake(s, auth.derive(key, "peer-copy"), b"peer-copy/run/2")


def _send(s: socket.socket, session: bytes, seq: int, src: int, step: int, data: bytes, *, bad_mac=False) -> bytes:
    hdr = struct.pack("<iqq", src, step, len(data))
    mac = auth.message_mac(session, seq)
    mac.update(hdr + data)
    tag = mac.digest() if not bad_mac else bytes(32)
    try:
        s.sendall(hdr + data + tag)
        return s.recv(1)
    except OSError:
        return b""


def test_peer_copy_keeps_only_its_source_rank_within_bounds_as_private_files(tmp_path):
    """The sender rank 0 (same key) gets its copy kept as a 0600 file in a 0700 directory; a copy claiming
    another source rank, one beyond 4x this rank's own snapshot, and one whose MAC does not verify are
    refused and leave nothing behind."""
    key = auth.derive(b"the-job-secret-0123456789", "worker")
    rx, base, addr = _receiver(tmp_path, key)
    own = Path(rx.own_dir)                                        # CheckpointManager's slots of this process
    own.mkdir(mode=0o700)
    (own / "slot0").write_bytes(b"\1" * 4096)                     # this rank's own snapshot: 4 KiB

    # the real sender: PeerCopies of rank 0 (its peer is rank 2)
    tx = PeerCopies(str(tmp_path / "sender"), rank=0, world=4, local_world=2, key=key, run_id="run")
    store = _Store()
    store.set("hyperpodrun/peer-copy/2", f"{addr[0]}:{addr[1]}")
    tx.connect(store, 2)
    blob = tmp_path / "slot1"
    blob.write_bytes(os.urandom(3000))
    tx.send(1, str(blob))
    kept = base / "peer-of-rank0" / "slot1"
    wait_until(kept.exists, 10, message="the copy from rank 0 is kept")
    assert kept.read_bytes() == blob.read_bytes()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700

    s, session = _authenticated(addr, key)
    assert _send(s, session, 0, src=1, step=3, data=b"B" * 100) != b"\1"          # not its source
    s.close()
    s, session = _authenticated(addr, key)
    assert _send(s, session, 0, src=0, step=3, data=b"C" * (4 * 4096 + 1)) != b"\1"  # too large
    s.close()
    s, session = _authenticated(addr, key)
    assert _send(s, session, 0, src=0, step=2, data=b"D" * 100, bad_mac=True) != b"\1"
    s.close()
    wait_until(lambda: rx._refusals >= 3, 10, message="three copies refused")
    assert _files_under(base) == sorted(["peer-of-rank0/slot1", f"{own.name}/slot0"])


# ------------------------------------------------------------------------------------------ signed records
def _store():
    import torch.distributed as dist
    return dist.PrefixStore("hyperpodrun/run/", dist.HashStore())


def test_forged_records_are_ignored_and_reported_once():
    """Unsigned values of the failure record, the generation and the budget are not believed; a claim made
    over a forged occupant still works; each forged name is reported once."""
    store = _store()
    reports: list[str] = []
    coord = Coordinator(store, 2, 3, key=b"k" * 32, run_id="run", node_rank=0, on_forged=reports.append)
    store.set("failed", json.dumps({"exit_code": 42}))
    store.set("gen", "5")
    store.set("restarts_used", "99")
    assert coord.failure() is None and coord.failure() is None
    assert coord.generation() == 0 and coord.restarts_used() == 0
    store.set("restart/1", "someone")
    grant = coord.request_restart(0, FailureInfo(summary="test"))
    assert (grant.generation, grant.started, grant.budget_ok) == (1, True, True)
    assert coord.generation() == 1 and coord.restarts_used() == 1
    # a record signed with another key (another job) or copied to another name is not believed either
    other = SignedRecords(store, b"o" * 32, "run", lambda name: None)
    other.write("failed", json.dumps({"exit_code": 43}))
    assert coord.failure() is None
    store.set("wstore/1", store.get("gen"))           # the signed generation record under another name
    assert coord.worker_store_port(1) is None
    store.add("done/1", 5)                             # a counter bumped from outside: marks decide
    assert coord.done_count(1) == 0
    coord.mark_done(1)
    assert coord.done_count(1) == 1 and store.add("done/1", 0) == 6
    assert sorted(r.split("'")[1] for r in reports) == ["done/1", "failed", "gen", "restart/1", "restarts_used",
                                                        "wstore/1"]
    coord.report_failure(FailureInfo(exit_code=1, summary="real"))
    assert coord.failure() == FailureInfo(exit_code=1, summary="real")


def test_agents_agree_on_one_secret_and_refuse_different_ones():
    store = _store()
    one, warn = agree_secret(store, None, "run", "h:1")
    two, warn2 = agree_secret(store, None, "run", "h:1")
    assert one == two and warn and warn2 and "HYPERPODRUN_JOB_SECRET" in warn and "\n" not in warn
    with pytest.raises(RendezvousError, match="has a job secret"):
        agree_secret(store, b"x" * 20, "run", "h:1")
    store = _store()
    assert agree_secret(store, b"x" * 20, "run", "h:1") == (b"x" * 20, "")
    assert agree_secret(store, b"x" * 20, "run", "h:1") == (b"x" * 20, "")
    assert b"x" * 20 not in store.get("auth")
    with pytest.raises(RendezvousError, match="differs"):
        agree_secret(store, b"y" * 20, "run", "h:1")
    with pytest.raises(RendezvousError, match="was not"):
        agree_secret(store, None, "run", "h:1")


# ------------------------------------------------------------------------------------------ real jobs
WAITER = """
import os, sys, time, json, pathlib
out = pathlib.Path(sys.argv[1])
env = {k: os.environ.get(k) for k in ("HYPERPODRUN_JOB_KEY", "HYPERPODRUN_JOB_SECRET", "MASTER_ADDR",
                                      "HYPERPODRUN_CONTROL")}
(out / f"started_{os.environ['RANK']}.json").write_text(json.dumps(env))
while not (out / "release").exists():
    time.sleep(0.05)
"""


def _listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on (from /proc)."""
    return [f"{s['addr']}:{s['port']}" for s in tcp_sockets(pid) if s["state"] == LISTEN]


def _is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def test_single_node_store_listens_on_loopback_only(launcher, tmp_path, out_dir):
    """While a job runs, every TCP socket its agent listens on (the workers' store) is on loopback, and the
    workers' MASTER_ADDR leads there; the control socket is 0600 in a 0700 directory; the workers get the
    workers' key, not the job secret."""
    waiter = write_script(tmp_path, "waiter.py", WAITER)
    proc = launcher.start(["--nproc-per-node", "2", "--inprocess-restart", waiter, out_dir],
                          env={auth.SECRET_ENV: SECRET})
    wait_until(lambda: len(list(out_dir.glob("started_*.json"))) == 2, 60, message="workers started")
    listening = _listening(proc.pid)
    control = json.loads((out_dir / "started_0.json").read_text())["HYPERPODRUN_CONTROL"].removeprefix("ipc://")
    modes = (stat.S_IMODE(os.stat(control).st_mode), stat.S_IMODE(os.stat(os.path.dirname(control)).st_mode))
    (out_dir / "release").touch()
    assert proc.wait(60).rc == 0
    assert listening, "the agent listens on no TCP socket (the workers' store?)"
    assert all(_is_loopback(a) for a in listening), listening
    assert modes == (0o600, 0o700), modes
    for rank in (0, 1):
        env = json.loads((out_dir / f"started_{rank}.json").read_text())
        assert env["HYPERPODRUN_JOB_SECRET"] is None
        assert env["HYPERPODRUN_JOB_KEY"] == auth.derive(SECRET.encode(), "worker").hex()
        assert {ai[4][0] for ai in socket.getaddrinfo(env["MASTER_ADDR"], None, socket.AF_INET)} == {"127.0.0.1"}


def _two_node_job(launcher, tmp_path, out_dir, env, run_id):
    waiter = write_script(tmp_path, "waiter.py", WAITER)
    port = free_port()
    jobs = [launcher.start(["--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port",
                            str(port), "--rdzv-id", run_id, "--nproc-per-node", "1", waiter, out_dir],
                           env=env, log_dir=tmp_path / f"logs{n}") for n in (0, 1)]
    wait_until(lambda: len(list(out_dir.glob("started_*.json"))) == 2, 60, message="workers of both nodes started")
    return jobs, port


def test_forged_failure_record_does_not_end_a_two_node_job(launcher, tmp_path, out_dir):
    """Another process without the secret sets the failure record (and the generation) in the coordination
    store: both agents ignore it, say so once in their event log, and the job ends 0."""
    jobs, port = _two_node_job(launcher, tmp_path, out_dir, {auth.SECRET_ENV: SECRET}, "forge")
    forger = f"""
import datetime, json, torch.distributed as dist
s = dist.PrefixStore("hyperpodrun/forge/", dist.TCPStore("127.0.0.1", {port}, is_master=False,
                                                          timeout=datetime.timedelta(seconds=20)))
s.set("failed", json.dumps({{"exit_code": 42, "host": "evil", "summary": "forged", "rank": 0}}))
s.set("gen", "7")
"""
    subprocess.run([sys.executable, "-c", forger], check=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                               if k != auth.SECRET_ENV})

    def forged_seen(n):
        return {e["msg"].split("'")[1] for e in read_events(tmp_path / f"logs{n}") if e["event"] == "forged_record"}
    for n in (0, 1):
        wait_until(lambda: forged_seen(n) == {"failed", "gen"}, 30, message=f"node {n} ignored the forged records")
    (out_dir / "release").touch()
    results = [job.wait(60) for job in jobs]
    assert [r.rc for r in results] == [0, 0], results
    for n in (0, 1):
        events = read_events(tmp_path / f"logs{n}")
        assert not [e for e in events if e["event"] in ("job_failed_remote", "restart_remote", "insecure")], events
        assert len([e for e in events if e["event"] == "forged_record"]) == 2


def test_two_nodes_without_a_secret_warn_once_and_listen_on_the_job_address(launcher, tmp_path, out_dir):
    """No secret on either node: each agent says once what the ports then trust; the store host listens on
    the address the job uses (127.0.0.1 here), not on every interface."""
    jobs, _ = _two_node_job(launcher, tmp_path, out_dir, {}, "nosecret")
    listening = _listening(jobs[0].pid)
    (out_dir / "release").touch()
    assert [job.wait(60).rc for job in jobs] == [0, 0]
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
    for n in (0, 1):
        warnings = [e for e in read_events(tmp_path / f"logs{n}") if e["event"] == "insecure"]
        assert len(warnings) == 1 and "--job-secret-file" in warnings[0]["msg"], warnings


# ------------------------------------------------------------------------------------------ log files
@needs_root
def test_default_log_dir_created_by_another_user_is_refused(launcher, shared_tmp, tmp_path):
    """Another user pre-creates the default log base with a symlink to a root-owned 0600 file: the job
    refuses with one line (exit 2) and the file is untouched."""
    target = tmp_path / "secret.txt"
    target.write_text("root only\n")
    target.chmod(0o600)
    res = as_nobody(f"""
import os
base = os.path.join({str(shared_tmp)!r}, "hyperpodrun-logs-0")
os.mkdir(base, 0o777); os.chmod(base, 0o777)
os.mkdir(os.path.join(base, "run1"), 0o777); os.chmod(os.path.join(base, "run1"), 0o777)
os.symlink({str(target)!r}, os.path.join(base, "run1", "node0.events.jsonl"))
""")
    assert res.returncode == 0, res.stderr
    ok = write_script(tmp_path, "ok.py", "pass\n")
    res = launcher.run(["--rdzv-id", "run1", ok], log_dir=False,
                       env={"TMPDIR": str(shared_tmp)}, timeout=60)
    assert res.rc == 2 and "Traceback" not in res.err, res
    error = [ln for ln in res.err.splitlines() if ln.strip()][-1]
    assert error.startswith("Error: ") and "hyperpodrun-logs-0" in error and "uid 65534" in error, res.err
    assert target.read_text() == "root only\n"


@needs_root
def test_run_dir_planted_in_a_shared_log_dir_is_never_written_through(launcher, shared_tmp, tmp_path):
    """--log-dir is a shared directory; another user created <log-dir>/<run-id> with the event log a
    symlink to a root-owned 0600 file: the job refuses that run directory and writes nothing through it."""
    target = tmp_path / "secret.txt"
    target.write_text("root only\n")
    target.chmod(0o600)
    res = as_nobody(f"""
import os
run = os.path.join({str(shared_tmp)!r}, "run2")
os.mkdir(run, 0o777); os.chmod(run, 0o777)
os.symlink({str(target)!r}, os.path.join(run, "node0.events.jsonl"))
""")
    assert res.returncode == 0, res.stderr
    ok = write_script(tmp_path, "ok.py", "pass\n")
    res = launcher.run(["--rdzv-id", "run2", ok], log_dir=shared_tmp, timeout=60)
    assert res.rc != 0 and "Traceback" not in res.err and "uid 65534" in res.err, res
    assert target.read_text() == "root only\n"


def test_event_log_is_never_opened_through_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep\n")
    os.symlink(target, tmp_path / "node0.events.jsonl")
    with pytest.raises(safe_fs.UnsafePathError, match="symlink"):
        EventLog("h").open(str(tmp_path / "node0.events.jsonl"), 0)
    assert target.read_text() == "keep\n"
    log = EventLog("h")
    log.open(str(tmp_path / "node1.events.jsonl"), 1)
    log.emit("x", "y")
    log.close()
    assert stat.S_IMODE((tmp_path / "node1.events.jsonl").stat().st_mode) == 0o600


def test_listen_addresses():
    """One node: the workers dial a name only when it leads to the loopback address the store listens on.
    Several nodes: a loopback rendezvous listens there; --local-addr wins when it is an address of ours."""
    from hyperpodrun import netaddr
    assert netaddr.single_node_master("localhost") == "localhost"
    assert netaddr.single_node_master("no-such-host.invalid") == "127.0.0.1"
    assert netaddr.single_node_master("192.0.2.200") == "127.0.0.1"       # not loopback (TEST-NET-1)
    assert netaddr.single_node_bind("localhost") == "127.0.0.1"
    assert netaddr.multi_node_bind("127.0.0.1") == "127.0.0.1"
    assert netaddr.multi_node_bind("192.0.2.200", local_addr="127.0.0.1") == "127.0.0.1"
    with netaddr.listen_socket("127.0.0.1", 0) as s:
        assert s.getsockname()[0] == "127.0.0.1"
