"""A restore that copies from a slot lets go of that slot's mapping (and its descriptor) when it returns, with
garbage collection off - as on the restart path after HPWrapper's gc.freeze, where a reference cycle holding a
view of the mapping would keep it (and the slot's pages) until a full collection that may never come."""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hyperpodrun import CheckpointManager


def slot_descriptors() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "slot" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


class Caller:
    iteration = 0
    store = None


@pytest.fixture
def group(tmp_path, monkeypatch):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("offload", [False, True])
def test_restore_from_a_slot_keeps_no_mapping_of_it(tmp_path, group, offload):
    cm = CheckpointManager(enable_offload=offload, shm_dir=str(tmp_path / "shm"))
    cm.attach(Caller(), None)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "opt": opt}
    for step in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        cm.save(step + 1, state)
    cm.wait()
    saved = [p.detach().clone() for p in model.parameters()]
    held = slot_descriptors()            # the two slots this rank writes
    was = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            model.weight.add_(1)         # no longer at the saved step: restore must copy from the slot
        assert cm.restore(state) == 3 and cm.restored_from == "shm"
        assert slot_descriptors() == held, "the restore's mapping of the slot outlived restore()"
    finally:
        if was:
            gc.enable()
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    cm.close(success=True)
