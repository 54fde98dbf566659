"""DDP bucket layouts are captured for restores even when the first save comes before the first gradient
sync (a save of the initial state, or gradient accumulation under no_sync)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, socket, torch, torch.distributed as dist, torch.nn as nn
    from hyperpodrun.state.ddp_layout import LayoutKeeper
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)))
    keeper = LayoutKeeper()
    x = torch.randn(8, 16)
    with ddp.no_sync():
        ddp(x).sum().backward()
    before = dict(keeper.collect())    # a save while accumulating: no layout known yet
    ddp(x).sum().backward()            # the first synchronised backward
    after = keeper.collect()
    print("RESULT", len(before), len(after), sorted(i for b in next(iter(after.values()), []) for i in b))
    dist.destroy_process_group()
""")


def test_layout_is_captured_after_a_save_that_came_before_the_first_sync():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))
    assert line == "RESULT 0 1 [0, 1, 2, 3]", line
