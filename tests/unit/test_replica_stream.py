"""replica_stream: a donor's live tensors (several dtypes, bf16, an empty and a non-contiguous tensor, an
optimizer-like nesting, more tensors than one batch) reach the receiver bitwise, on the device it asked for,
over a real 3-rank gloo group (subprocesses on 127.0.0.1, a TCPStore the test serves, the workers' key in
their environment: every message MACed, replica_stream.py); a donor without live
state, and a "peer" transfer, send slot bytes; state the wire does not carry falls back; malformed metadata
is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from hyperpodrun.errors import SnapshotCorrupt
from hyperpodrun.state.restore import replica_stream
from hyperpodrun.state.codec import safe_codec

RANK_SCRIPT = r"""
import collections, json, os, random, sys
from datetime import timedelta
import torch, torch.distributed as dist
from hyperpodrun.state.restore import replica_stream

Pair = collections.namedtuple("Pair", "tensor count")

def payload():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(5, 3, generator=g)
    w[0, 0] = float("nan")
    model = collections.OrderedDict(weight=w, bias=torch.randn(3, generator=g).to(torch.bfloat16),
                                    empty=torch.empty(0, 4), wide=torch.randn(4, 6, generator=g).t(),
                                    big=torch.randn(1 << 18, generator=g))
    opt = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(2, generator=g),
                         "exp_avg_sq": torch.randn(2, generator=g).double()} for i in range(100)},
           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": list(range(100)), "name": "g0"}]}
    opt["state"][0]["mask"] = torch.rand(7, generator=g) > 0.5
    extra = {"counts": torch.arange(4, dtype=torch.int32), "half": torch.randn(2, 2, generator=g).half(),
             "x": 1.5, "nested": [(torch.tensor(3, dtype=torch.int64), "a"), {"z": torch.zeros(1, 0)}],
             "pair": Pair(torch.ones(2, dtype=torch.complex64), 3)}
    rng = {"torch": torch.Generator().manual_seed(5).get_state(), "python": random.Random(3).getstate()}
    return {"step": 7, "rng": rng, "ddp_layouts": {"fp": [[0, 1], [2]]},
            "state": {"model": ("sd", model), "opt": ("sd", opt), "extra": ("value", extra)}}

def same(a, b, where, bad):
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape or \
                not torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)):
            bad.append(where)
    elif type(a) is not type(b):
        bad.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
    elif isinstance(a, dict):
        if list(a) != list(b):
            bad.append(f"{where}: keys")
        for k in a:
            same(a[k], b.get(k), f"{where}.{k}", bad)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            bad.append(f"{where}: length")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]", bad)
    elif a != b:
        bad.append(where)

def places(obj, where, out):
    if isinstance(obj, torch.Tensor):
        out.append([where, str(obj.device), obj.dim()])
    elif isinstance(obj, dict):
        for k, v in obj.items():
            places(v, f"{where}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            places(v, f"{where}[{i}]", out)

rank, port, device = int(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=60))
expected = payload()
blob = lambda receiver, kind: f"slot of rank 0 for {receiver} ({kind})".encode() * 1000
devices = {"model": device, "opt": device, "extra": device}
report = {}
for case, live in (("live", lambda receiver, kind: expected if kind == "replica" else None),
                   ("none", lambda receiver, kind: None)):
    got = replica_stream.exchange([(0, 1, "replica"), (0, 2, "peer")], rank, live, blob, devices)
    if got is None:
        report[case] = None
        continue
    mine = {"donor": got.donor, "kind": got.kind, "via": got.via}
    if got.payload is not None:
        bad = []
        same(expected, got.payload, "payload", bad)
        mine["mismatches"] = bad
        mine["places"] = []
        places(got.payload, "payload", mine["places"])
    else:
        mine["blob_ok"] = got.blob == blob(rank, got.kind)
    report[case] = mine
dist.barrier()
dist.destroy_process_group()
print(json.dumps(report))
"""


def _run_group(device: str) -> list[dict]:
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    # as under hyperpodrun's agent: the workers' key in the environment, so every message carries its MAC
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HYPERPODRUN_JOB_KEY": os.urandom(32).hex(),
           "TORCHELASTIC_RUN_ID": "stream-test"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(server.port), device], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    reports = []
    try:
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"rank {r}:\n{err[-3000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    del server
    return reports


DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_live_tensors_reach_the_receiver_bitwise_on_its_device_and_slot_bytes_otherwise(device):
    donor, replica, peer = _run_group(device)
    assert donor == {"live": None, "none": None}
    live = replica["live"]
    assert (live["donor"], live["kind"], live["via"]) == (0, "replica", "live"), live
    assert live["mismatches"] == [], live["mismatches"]
    entry_tensors = [p for p in live["places"] if p[0].startswith(("payload.state.model", "payload.state.opt"))]
    assert len(live["places"]) > replica_stream._BATCH      # more tensors than one batch of operations
    # the entries' tensors on the requested device; scalars (an optimizer's step), values and RNG on the host
    assert all(dev == (device if dim else "cpu") for _w, dev, dim in entry_tensors), entry_tensors
    assert all(dev == "cpu" for w, dev, _d in live["places"] if not w.startswith(("payload.state.model",
                                                                                   "payload.state.opt")))
    assert replica["none"] == {"donor": 0, "kind": "replica", "via": "slot", "blob_ok": True}
    for case in ("live", "none"):   # a copy held for another node's rank always goes as its slot's bytes
        assert peer[case] == {"donor": 0, "kind": "peer", "via": "slot", "blob_ok": True}


def test_state_the_wire_does_not_carry_goes_as_slot_bytes():
    dense = {"step": 1, "rng": {}, "state": {"m": ("sd", {"w": torch.ones(2)})}}
    assert replica_stream.encode(dense) is not None
    sparse = {"step": 1, "rng": {}, "state": {"m": ("sd", {"w": torch.ones(2).to_sparse()})}}
    assert replica_stream.encode(sparse) is None
    opaque = {"step": 1, "rng": {}, "state": {"m": ("value", object())}}
    assert replica_stream.encode(opaque) is None


def test_malformed_metadata_is_refused():
    meta, tensors = replica_stream.encode({"step": 1, "rng": {}, "state": {"m": ("sd", {"w": torch.ones(3)})}})
    payload, fresh = replica_stream.decode(meta, {"m": torch.device("cpu")})
    assert payload["state"]["m"][1]["w"].shape == (3,) and len(fresh) == len(tensors) == 1
    for bad in (meta[:-1],                                                        # truncated
                safe_codec.dumps({"step": 1, "rng": {}, "state": {"m": ("sd", {"w": safe_codec.TensorRef(
                    0, "float32", (3,), 4)})}}),                                  # size does not match
                safe_codec.dumps({"step": 1, "rng": {}, "state": {"m": ("sd", {"w": safe_codec.TensorRef(
                    1, "float32", (1,), 4)})}}),                                  # index out of order
                safe_codec.dumps({"step": 1, "rng": {}, "state": {"m": ("sd", {"w": safe_codec.TensorRef(
                    0, "Tensor", (1,), 4)})}}),                                   # not a dtype
                safe_codec.dumps({"state": {}})):                                 # not a payload
        with pytest.raises(SnapshotCorrupt):
            replica_stream.decode(bad, {})
