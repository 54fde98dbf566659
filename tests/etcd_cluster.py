"""Real etcd members on loopback for the etcd backend's tests: one member, or a cluster of three, each on free
ports with its data directory under the test's tmp_path.

Teardown is by pid with SIGKILL: a member that lost its quorum ignores SIGTERM (it waits for its peers to
agree on its leaving). Nothing here looks processes up by name. `unavailable()` says why the tests cannot
run here (no `etcd` on PATH: .ci/run installs Debian's etcd-server package).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from conftest import free_port, wait_until


def unavailable() -> Optional[str]:
    """None when etcd members can be started here, else the reason (for pytest.skip)."""
    if shutil.which("etcd") is None:
        return "etcd is not on PATH (Debian: apt-get install etcd-server; .ci/run installs it)"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "etcd3gw is not installed (pip install 'hyperpodrun[etcd]')"
    return None


def _post(url: str, body: dict[str, Any], timeout: float = 1.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


class Member:
    def __init__(self, name: str, client: int, peer: int, data: Path) -> None:
        self.name, self.client, self.peer, self.data = name, client, peer, data
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client}"

    def status(self) -> Optional[dict[str, Any]]:
        """The member's status (its id, the leader's id), or None when it does not answer."""
        try:
            return _post(self.url + "/v3/maintenance/status", {})
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class EtcdCluster:
    """`size` members on loopback, started together (they find each other through --initial-cluster)."""

    def __init__(self, tmp: Path, size: int = 3) -> None:
        self.tmp = tmp
        self.members = [Member(f"m{i}", free_port(), free_port(), tmp / f"etcd-m{i}") for i in range(size)]
        self.log = tmp / "etcd.log"

    def start(self, timeout: float = 30) -> "EtcdCluster":
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in self.members)
        token = f"hpr-test-{os.getpid()}-{time.monotonic_ns()}"
        with open(self.log, "ab") as log:
            for m in self.members:
                m.proc = subprocess.Popen(
                    ["etcd", "--name", m.name, "--data-dir", str(m.data),
                     "--listen-client-urls", m.url, "--advertise-client-urls", m.url,
                     "--listen-peer-urls", f"http://127.0.0.1:{m.peer}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer}",
                     "--initial-cluster", initial, "--initial-cluster-state", "new",
                     "--initial-cluster-token", token,
                     # a fast election, so that losing the leader costs the tests well under a second
                     "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "error",
                     "--logger", "zap"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wait_until(lambda: self.leader() is not None, timeout, interval=0.05,
                   message=f"an etcd leader (log: {self.log})")
        return self

    @property
    def endpoints(self) -> str:
        """The --rdzv-endpoint of the cluster."""
        return ",".join(f"127.0.0.1:{m.client}" for m in self.members)

    def leader(self) -> Optional[Member]:
        """The member that is the leader now, as the live members agree; None while there is none."""
        for m in self.members:
            if not m.alive():
                continue
            st = m.status()
            if st is None or not st.get("leader") or st.get("leader") == "0":
                continue
            for other in self.members:
                if other.alive():
                    ost = other.status()
                    if ost and ost.get("header", {}).get("member_id") == st["leader"]:
                        return other
        return None

    def make_leader(self, member: Member, timeout: float = 30) -> None:
        """Hand the leadership to `member` (etcd's MoveLeader, asked of the leader now)."""
        def moved() -> bool:
            leader = self.leader()
            if leader is member:
                return True
            st = member.status()
            if leader is not None and st is not None:
                try:
                    _post(leader.url + "/v3/maintenance/transfer-leadership",
                          {"targetID": st["header"]["member_id"]}, timeout=5)
                except OSError:
                    pass    # a leader change under way: asked again
            return self.leader() is member
        wait_until(moved, timeout, interval=0.1, message=f"etcd member {member.name} the leader")

    def stop(self) -> None:
        """SIGKILL every member by pid (see the module docstring)."""
        for m in self.members:
            m.kill()


def single(tmp: Path) -> EtcdCluster:
    return EtcdCluster(tmp, 1).start()
