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


def make_certs(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by that CA, and a second
    CA that signed nothing of these -> their paths (PEM) by name."""
    import datetime
    import ipaddress
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label: str, cert: x509.Certificate, key: Any) -> None:
        (directory / f"{label}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{label}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{label}.key").chmod(0o600)
        paths[label], paths[label + "_key"] = str(directory / f"{label}.pem"), str(directory / f"{label}.key")

    def issue(cn: str, key: Any, issuer: x509.Name, signer: Any, ca: bool, usage: Any = None,
              san: Any = None) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    for label in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        write(label, issue(f"test {label}", key, name(f"test {label}"), key, True), key)
    ca_key = serialization.load_pem_private_key(Path(paths["ca_key"]).read_bytes(), None)
    ca_name = name("test ca")
    for label, usage in (("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                         ("client", [ExtendedKeyUsageOID.CLIENT_AUTH])):
        key = ec.generate_private_key(ec.SECP256R1())
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        write(label, issue(f"test {label}", key, ca_name, ca_key, False, usage, san), key)
    return paths


class Member:
    def __init__(self, name: str, client: int, peer: int, data: Path, tls: Optional[dict[str, str]] = None) -> None:
        self.name, self.client, self.peer, self.data, self.tls = name, client, peer, data, tls
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client}"

    def status(self) -> Optional[dict[str, Any]]:
        """The member's status (its id, the leader's id), or None when it does not answer."""
        try:
            if self.tls:
                import requests
                got = requests.post(self.url + "/v3/maintenance/status", json={}, timeout=1, verify=self.tls["ca"],
                                    cert=(self.tls["client"], self.tls["client_key"]))
                return dict(got.json())
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

    def __init__(self, tmp: Path, size: int = 3, tls: Optional[dict[str, str]] = None) -> None:
        self.tmp = tmp
        self.tls = tls       # make_certs(): clients must then show a certificate the CA signed
        self.members = [Member(f"m{i}", free_port(), free_port(), tmp / f"etcd-m{i}", tls) for i in range(size)]
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
                     "--logger", "zap", *self._tls_flags()], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wait_until(lambda: self.leader() is not None, timeout, interval=0.05,
                   message=f"an etcd leader (log: {self.log})")
        return self

    def _tls_flags(self) -> list[str]:
        if not self.tls:
            return []
        return ["--cert-file", self.tls["server"], "--key-file", self.tls["server_key"], "--client-cert-auth",
                "--trusted-ca-file", self.tls["ca"]]

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
