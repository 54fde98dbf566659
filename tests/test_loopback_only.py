"""One node means loopback (issue 33, item 4): where the host name resolves to a routable address (as on many
clusters), gloo listened there - one port per worker on the network - although every peer is on this host.
The agent now gives a single-node job's workers GLOO_SOCKET_IFNAME=lo and NCCL_SOCKET_IFNAME=lo, each unless
the user set it. The job runs in a mount namespace whose private /etc/hosts maps this host's name to one of
its routable addresses; the workers list their own TCP sockets (their fds' inodes in /proc/net/tcp{,6})."""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from conftest import HYPERPODRUN, read_markers, write_script
from hyperpodrun.env import LOOPBACK_IFNAME, LOOPBACK_IFNAME_VARS, keep_on_loopback

WORKER = r'''
import datetime, json, os, socket, sys
import torch, torch.distributed as dist
sys.path.insert(0, TESTS)
from proc_sockets import tcp_sockets

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
t = torch.ones(4)
dist.all_reduce(t)
rank = dist.get_rank()
record = {"sockets": [{"state": s["state"], "addr": s["addr"]} for s in tcp_sockets()], "resolved": socket.gethostbyname(socket.gethostname()),
          "env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
dist.barrier()
with open(os.path.join(sys.argv[1], f"listen{rank}.json"), "w") as fh:
    json.dump(record, fh)
dist.destroy_process_group()
'''


def routable_address() -> Optional[str]:
    """A global IPv4 address of this machine (None: none here)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def is_loopback(text: str) -> bool:
    addr = ipaddress.ip_address(text)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def test_keep_on_loopback_sets_only_what_the_user_left_unset() -> None:
    env = {"NCCL_SOCKET_IFNAME": "^docker", "GLOO_SOCKET_IFNAME": ""}
    assert keep_on_loopback(env) == ["GLOO_SOCKET_IFNAME"]
    assert env == {"NCCL_SOCKET_IFNAME": "^docker", "GLOO_SOCKET_IFNAME": LOOPBACK_IFNAME}
    env = {}
    assert keep_on_loopback(env) == list(LOOPBACK_IFNAME_VARS)
    assert set(env.values()) == {"lo"}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private /etc/hosts needs a mount namespace (root, unshare); CI runs as root")
def test_a_single_node_job_listens_on_loopback_only_where_the_host_name_is_routable(launcher, tmp_path: Path,
                                                                                     out_dir: Path) -> None:
    addr = routable_address()
    if addr is None:
        pytest.skip("this machine has no global IPv4 address for the host name to resolve to")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    worker = write_script(tmp_path, "listen.py", f"TESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n" + WORKER)
    log_dir = tmp_path / "logs"
    cmd = ["unshare", "--mount", "--propagation", "private", "bash", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
           str(hosts), HYPERPODRUN, "--log-dir", str(log_dir)]
    res = launcher.run(["--nproc-per-node", "2", str(worker), str(out_dir)], cmd=cmd, timeout=90,
                       env={"NCCL_SOCKET_IFNAME": "^docker"})   # one the user set: kept
    assert res.rc == 0, res
    records = read_markers(out_dir, "listen*.json")
    assert len(records) == 2, res
    for rec in records:
        assert rec["resolved"] == addr                      # the host name does lead to the network here
        assert rec["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker"}
        listening = [s for s in rec["sockets"] if s["state"] == "0A"]
        assert listening, rec                               # gloo's listener was found
        assert all(is_loopback(s["addr"]) for s in rec["sockets"]), json.dumps(rec)
