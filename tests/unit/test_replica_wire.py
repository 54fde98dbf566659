"""The replica stream's messages carry MACs (hyperpodrun/state/restore/replica_stream.py, wire_auth.py): over an
in-memory wire (what a donor sends, replayed to a receiver) the receiver takes a transfer only from a holder
of the workers' key, for this receiver, kind and step; a tampered header, body or tensor, or an oversized
announced length, is refused before anything is allocated or decoded for it. Tensor.numpy is made to fail:
neither side needs numpy."""
from __future__ import annotations

import collections
import struct
from typing import Any

import pytest
import torch

from hyperpodrun.errors import ProtocolError
from hyperpodrun.state.restore import replica_stream
from hyperpodrun.state.restore import replicas
from hyperpodrun.state.restore import wire_auth

KEY = b"k" * 32


def chan(key: bytes = KEY, generation: int = 1) -> wire_auth.Channel:
    return wire_auth.channel(generation, 2, run_id="run", key=key)


class Wire:
    """torch.distributed's point-to-point calls between two ranks as one queue; `me` says who calls."""

    def __init__(self, monkeypatch) -> None:
        import torch.distributed as dist
        self.me = 0
        self.sent: list[Any] = []
        monkeypatch.setattr(dist, "send", self.send)
        monkeypatch.setattr(dist, "recv", self.recv)
        monkeypatch.setattr(replica_stream, "_p2p", self.p2p)
        monkeypatch.setattr(replica_stream, "wire_device", lambda: torch.device("cpu"))

        def no_numpy(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("Numpy is not available")
        monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)

    def send(self, t: Any, dst: int) -> None:
        self.sent.append(t.detach().clone().cpu())

    def recv(self, t: Any, src: int) -> None:
        got = self.sent.pop(0)
        if got.numel() != t.numel():
            raise RuntimeError(f"size mismatch: sent {got.numel()}, receiving {t.numel()}")
        t.copy_(got.view(t.dtype).reshape(t.shape))

    def p2p(self, tensors: Any, peer: int, send: bool) -> None:
        for t in tensors:
            (self.send if send else lambda x, _p: self.recv(x, _p))(t, peer)


def payload() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"step": 4, "rng": {}, "state": {"m": ("sd", collections.OrderedDict(
        w=torch.randn(3, 2, generator=g), b=torch.randn(2, generator=g).half(), n=torch.tensor(7)))}}


def donate(wire: Wire, live: bool, channel: wire_auth.Channel, step: int = 4, receiver: int = 1) -> None:
    wire.me = 0
    replica_stream.exchange([(0, receiver, "replica")], 0, lambda r, k: payload() if live else None,
                            lambda r, k: b"slot bytes " * 100, {}, channel, step)


def receive(channel: wire_auth.Channel, step: int = 4, me: int = 1) -> replica_stream.Received:
    got = replica_stream.exchange([(0, me, "replica")], me, lambda r, k: None, lambda r, k: b"", {"m": "cpu"},
                                  channel, step)
    assert got is not None
    return got


@pytest.mark.parametrize("live", [True, False])
def test_a_transfer_from_a_key_holder_arrives_whole_without_numpy(monkeypatch, live: bool) -> None:
    wire = Wire(monkeypatch)
    donate(wire, live, chan())
    got = receive(chan())
    assert not wire.sent
    if live:
        assert got.via == "live" and got.payload is not None
        for name, t in payload()["state"]["m"][1].items():
            assert torch.equal(got.payload["state"]["m"][1][name], t)
    else:
        assert got.via == "slot" and bytes(got.blob) == b"slot bytes " * 100


@pytest.mark.parametrize("donor, receiver", [
    (dict(channel=chan(key=b"o" * 32)), {}),             # an outsider without the key
    (dict(channel=chan(generation=0)), {}),              # replayed from the generation before
    (dict(channel=chan(), step=3), {}),                  # from another restore
    (dict(channel=chan(), receiver=2), dict(me=1)),      # meant for another rank
])
def test_a_transfer_without_the_jobs_mac_is_refused_at_its_header(monkeypatch, donor, receiver) -> None:
    wire = Wire(monkeypatch)
    donate(wire, True, **donor)
    with pytest.raises(ProtocolError, match="replica head without the job's MAC"):
        receive(chan(), **receiver)
    assert len(wire.sent) >= 1          # nothing read past the header


@pytest.mark.parametrize("index, offset, what", [(1, 3, "body"), (1, -1, "body"), (2, 0, "tensors")])
def test_a_tampered_body_or_tensor_is_refused(monkeypatch, index: int, offset: int, what: str) -> None:
    wire = Wire(monkeypatch)
    donate(wire, True, chan())
    wire.sent[index].view(torch.uint8).reshape(-1)[offset] ^= 1
    with pytest.raises(ProtocolError, match=f"replica {what}|replica tensors"):
        receive(chan())


def test_an_oversized_announced_length_is_refused_before_allocating(monkeypatch) -> None:
    """A key holder announcing 2**62 bytes (its header's MAC verifies): refused before the body is allocated."""
    wire = Wire(monkeypatch)
    head = struct.pack("<qq", replica_stream.SLOT, 1 << 62)
    tag = chan().tag("replica-head", 0, 1, "replica", "4", head)
    wire.sent.append(torch.frombuffer(bytearray(head + tag), dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="malformed replica header"):
        receive(chan())


def test_replicas_transfer_goes_the_same_authenticated_way(monkeypatch) -> None:
    wire = Wire(monkeypatch)
    wire.me = 0
    assert replicas.transfer([(0, 1, "replica")], 0, lambda r, k: b"abc" * 10, chan(), 7) is None
    assert replicas.transfer([(0, 1, "replica")], 1, lambda r, k: b"", chan(), 7) == bytearray(b"abc" * 10)
    replicas.transfer([(0, 1, "replica")], 0, lambda r, k: b"abc" * 10, chan(key=b"o" * 32), 7)
    with pytest.raises(ProtocolError):
        replicas.transfer([(0, 1, "replica")], 1, lambda r, k: b"", chan(), 7)
