"""The control-plane benchmark (scripts/bench/control_plane.py) at small N, so that it cannot rot: 2 and 8
simulated agents on a real coordinator, on the node-hosted store, and on a real etcd member where `etcd` is
installed. Each restart round reaches GO on every agent, a round's store operations per agent stay flat
(no per-agent reads of every other agent's records), and the growth law is printed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from etcd_cluster import unavailable as etcd_unavailable

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "control_plane.py"


def test_control_plane_benchmark_at_2_and_8_agents(tmp_path):
    stores = "coordinator,node" + (",etcd" if etcd_unavailable() is None else "")
    out = tmp_path / "cp.json"
    res = subprocess.run([sys.executable, str(BENCH), "--nodes", "2,8", "--store", stores, "--rounds", "2",
                          "--node-timeout", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["store"], r["nodes"]): r for r in data["results"]}
    assert set(rows) == {(s, n) for s in stores.split(",") for n in (2, 8)}, rows
    for (store, n), r in rows.items():
        assert len(r["rounds"]) == 2 and 0 < r["first_go_s"] <= r["last_go_s"] < 10, r
        assert 0 < r["round_ops_per_agent"] < 60, r
        assert 0 < r["bg_ops_per_agent_per_period"] < 60, r
    for store in stores.split(","):
        assert f"{store}/round_ops" in data["fits"] and f"{store}/bg_ops_per_agent_per_period" in data["fits"]
        assert store == "node" or f"{store}/last_go_s_model" in data["fits"]   # the store's CPU per operation
        # 4 times the agents, at most about 4 times the operations per round (N*N would be 16 times)
        assert rows[(store, 8)]["round_ops"] < 6 * rows[(store, 2)]["round_ops"], (rows[(store, 2)], rows[(store, 8)])
    assert "command: python scripts/bench/control_plane.py" in res.stdout
    bad = subprocess.run([sys.executable, str(BENCH), "--store", "zookeeper"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
