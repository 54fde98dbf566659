"""hyperpodrun's own restore protocols are authenticated and bounded (hyperpodrun/state/restore/wire_auth.py,
restore_inventory.py, replica_stream.py): every malformed inventory of the security probe (nesting 100000 deep,
non-UTF-8, steps 10**400 and -5, unknown source ranks, an empty inventory from a peer without the key, huge
announced lengths) is refused as its sender's fault, never an escaped exception or a lost state; an outsider
claiming step 1000000 does not choose the restored step; replica transfers with a forged, replayed, tampered
or oversized message are refused before anything is allocated or decoded; and no numpy is needed."""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from hyperpodrun.errors import ProtocolError, StateLostError
from hyperpodrun.state.restore import replica_stream
from hyperpodrun.state.restore import restore_inventory as inv_wire
from hyperpodrun.state.restore import wire_auth
from hyperpodrun.state.restore.restore_inventory import Gathered, check, encode, nothing, parse
from hyperpodrun.state.restore.restore_plan import plan_restore

KEY = b"k" * 32
WORLD = 4


def chan(generation: int = 2, world: int = WORLD, key: bytes = KEY, run: str = "run") -> wire_auth.Channel:
    return wire_auth.channel(generation, world, run_id=run, key=key)


def inv(shm=(), latest=None, copies=None, live=None, at=None, never=False, disk=()) -> dict:
    return {"shm": list(shm), "disk": list(disk), "latest": latest, "copies": copies or {},
            "never_committed": never, "live": live, "at": at}


def signed(body: bytes, rank: int = 1, channel: wire_auth.Channel | None = None) -> bytes:
    return (channel or chan()).tag("inventory", rank, -1, body) + body


# ------------------------------------------------------------------------------------------------ MACs
def test_a_tag_is_bound_to_key_run_generation_world_and_ranks() -> None:
    c = chan()
    tag = c.tag("inventory", 1, -1, b"x")
    assert c.check(tag, "inventory", 1, -1, b"x")
    assert not c.check(tag, "inventory", 2, -1, b"x")              # another rank's
    assert not c.check(tag, "inventory", 1, -1, b"y")              # another message
    assert not c.check(tag, "replica-head", 1, -1, b"x")           # another protocol
    for other in (chan(generation=3), chan(world=8), chan(run="other"), chan(key=b"o" * 32)):
        assert not other.check(tag, "inventory", 1, -1, b"x")
    assert c.tag("inventory", 1, -1, b"ab", b"c") != c.tag("inventory", 1, -1, b"a", b"bc")   # parts framed


def test_without_the_workers_key_nothing_is_checked() -> None:
    plain = wire_auth.Channel(None, "run", 0, 1)
    assert plain.tag("inventory", 0, -1, b"x") == bytes(wire_auth.TAG_BYTES)
    assert plain.check(b"anything", "inventory", 0, -1, b"x")


def test_the_channel_key_comes_from_the_workers_key(monkeypatch) -> None:
    monkeypatch.setenv("HYPERPODRUN_JOB_KEY", KEY.hex())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("HYPERPODRUN_GENERATION", "5")
    c = wire_auth.current()
    assert c.enabled and (c.run_id, c.generation, c.world) == ("run", 5, 1)
    assert c == wire_auth.channel(5, 1, run_id="run", key=KEY)


# ------------------------------------------------------------------------------------------------ inventories
def test_an_inventory_round_trips_with_its_mac() -> None:
    mine = inv((4, 6), latest=6, copies={2: [6]}, live=6, at=7)
    assert check(encode(mine, chan(), 1), 1, chan()) == mine


@pytest.mark.parametrize("body, needle", [
    (b"[" * 100000, "RecursionError"),
    (b"\xff\xfe{}", "UnicodeDecodeError"),
    (b'{"shm": [NaN]}', "not JSON"),
    (b"1" * 5000, "not JSON"),                                    # an int past Python's digit limit
    (json.dumps(inv((10 ** 400,))).encode(), "malformed step list"),
    (json.dumps(inv((-5,))).encode(), "malformed step list"),
    (json.dumps(inv(disk=(2 ** 63,))).encode(), "malformed step list"),
    (json.dumps(inv(latest=10 ** 400)).encode(), "malformed restore inventory"),
    (json.dumps(inv(live=-5)).encode(), "malformed restore inventory"),
    (json.dumps(inv(at=True)).encode(), "malformed restore inventory"),
    (json.dumps(inv(copies={7: [1]})).encode(), "malformed copies"),     # no rank 7 in a world of 4
    (json.dumps(inv(copies={"-1": [1]})).encode(), "malformed copies"),
    (json.dumps(inv(copies={"01": [1]})).encode(), "malformed copies"),
    (json.dumps(inv(copies={1: [10 ** 400]})).encode(), "malformed step list"),
    (json.dumps(inv(shm=range(5000))).encode(), "malformed step list"),
])
def test_a_malformed_inventory_from_a_key_holder_is_a_protocol_error_naming_it(body: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle) as err:
        check(signed(body), 1, chan())
    assert "rank 1" in str(err.value)


@pytest.mark.parametrize("blob", [
    signed(json.dumps(inv((1_000_000,), latest=1_000_000, live=1_000_000)).encode(), channel=chan(key=b"o" * 32)),
    bytes(32) + json.dumps(inv()).encode(),                        # an empty inventory, never_committed false
    signed(json.dumps(inv((5,))).encode(), rank=2),                # rank 2's, replayed as rank 1's
    signed(json.dumps(inv((5,))).encode(), channel=chan(generation=1)),   # from the generation before
    b"[" * 100000,                                                 # junk: its "tag" is checked first
])
def test_an_inventory_without_the_jobs_mac_is_forged(blob: bytes) -> None:
    assert not inv_wire.authentic(blob, 1, chan())
    with pytest.raises(ProtocolError, match="rank 1 .* without the job's MAC"):
        check(blob, 1, chan())


def test_oversized_and_truncated_inventories_are_refused() -> None:
    with pytest.raises(ProtocolError, match="bytes"):
        check(b"x" * (inv_wire.MAX_WIRE_BYTES + 1), 1, chan())
    with pytest.raises(ProtocolError, match="bytes"):
        check(b"short", 1, chan())


def test_parse_keeps_the_previous_checks() -> None:
    with pytest.raises(ProtocolError, match="rank 3"):
        parse([1, 2], 3, WORLD)
    with pytest.raises(ProtocolError, match="rank 3"):
        parse({"shm": [1]}, 3, WORLD)


# ------------------------------------------------------------------------------------------------ the plan
def ddp(world: int) -> list[list[int]]:
    return [list(range(world))]


def singletons(world: int) -> list[list[int]]:
    return [[r] for r in range(world)]


def test_an_outsider_claiming_a_newer_step_does_not_choose_the_restore() -> None:
    """Rank 1's seat sends "step 1000000" without the key: refused, it holds nothing; the plan restores the
    true step 4 and - with replicas - rank 1 would get it from rank 0, but a rank without the MAC is sent
    nothing (the round is tried again)."""
    c = chan()
    blobs = [encode(inv((3, 4), latest=4), c, r) for r in range(WORLD)]
    blobs[1] = signed(json.dumps(inv((1_000_000,), latest=1_000_000, live=1_000_000)).encode(),
                      channel=chan(key=b"outsider" * 4))
    gathered = _gather_from(blobs, c)
    assert set(gathered.refused) == {1} and gathered.forged == {1}
    plan = plan_restore(gathered.inventories, ddp, gathered.refused)
    assert plan is not None and plan.step == 4 and plan.pairs == [(0, 1, "replica")]
    with pytest.raises(ProtocolError, match=r"rank\(s\) \[1\] would be sent state"):
        gathered.check_receivers(plan.pairs)


def test_a_refused_inventory_is_its_senders_fault_not_a_lost_state() -> None:
    """An empty inventory (never_committed false) without the key from one peer: without replicas its state
    survives nowhere as far as anyone can tell - a ProtocolError (retried), not StateLostError (exit 75)."""
    c = chan()
    blobs = [encode(inv((4,), latest=4), c, r) for r in range(WORLD)]
    blobs[2] = bytes(32) + json.dumps(inv()).encode()
    gathered = _gather_from(blobs, c)
    assert gathered.inventories[2] == nothing() and set(gathered.refused) == {2}
    with pytest.raises(ProtocolError, match=r"rank\(s\) \[2\].*refused") as err:
        plan_restore(gathered.inventories, singletons, gathered.refused)
    assert not isinstance(err.value, StateLostError)
    # the same inventory with the job's MAC is a rank that really lost its state: StateLostError as before
    blobs[2] = encode(inv(), c, 2)
    gathered = _gather_from(blobs, c)
    assert not gathered.refused
    with pytest.raises(StateLostError, match=r"rank\(s\) \[2\]"):
        plan_restore(gathered.inventories, singletons, gathered.refused)


def test_a_malformed_inventory_from_a_key_holder_holds_nothing_and_gets_its_state_from_a_replica() -> None:
    c = chan()
    blobs = [encode(inv((4,), latest=4), c, r) for r in range(WORLD)]
    blobs[3] = signed(json.dumps(inv((-5,))).encode(), rank=3)
    gathered = _gather_from(blobs, c)
    assert set(gathered.refused) == {3} and not gathered.forged
    plan = plan_restore(gathered.inventories, ddp, gathered.refused)
    assert plan is not None and plan.step == 4 and plan.pairs == [(0, 3, "replica")]
    gathered.check_receivers(plan.pairs)


def test_refused_inventories_never_make_a_silent_fresh_start() -> None:
    c = chan()
    blobs = [encode(inv(), c, 0), bytes(32) + json.dumps(inv((9,))).encode()]
    gathered = _gather_from(blobs, chan(world=2))
    with pytest.raises(ProtocolError, match="fresh start"):
        plan_restore(gathered.inventories, singletons, gathered.refused)


# ------------------------------------------------------------------------------------------------ gather()
class FakeGroup:
    """torch.distributed's calls that gather() makes, for one rank of `world` whose peers sent `blobs`
    (announcing `lengths`); records every tensor gather() allocates for the exchange."""

    def __init__(self, blobs: list[bytes], lengths: list[int] | None = None, me: int = 0) -> None:
        self.blobs, self.me = blobs, me
        self.lengths = lengths if lengths is not None else [len(b) for b in blobs]
        self.sizes: list[int] = []

    def install(self, monkeypatch) -> None:
        import torch.distributed as dist
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: len(self.blobs))
        monkeypatch.setattr(dist, "get_rank", lambda: self.me)
        monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
        monkeypatch.setattr(dist, "all_gather", self.all_gather)

    def all_gather(self, out: list[Any], mine: Any) -> None:
        self.sizes.append(mine.numel())
        if mine.dtype == torch.int64:
            for t, n in zip(out, self.lengths):
                t.fill_(n)
            return
        for t, b in zip(out, self.blobs):
            t.zero_()
            raw = b[:t.numel()]
            t[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)


def _gather_from(blobs: list[bytes], channel: wire_auth.Channel) -> Gathered:
    """The checks gather() applies to what every rank sent (without a process group)."""
    out, refused, forged = [], {}, set()
    for rank, blob in enumerate(blobs):
        try:
            out.append(check(blob, rank, channel))
        except ProtocolError as exc:
            refused[rank] = str(exc)
            forged |= set() if inv_wire.authentic(blob, rank, channel) else {rank}
            out.append(nothing())
    return Gathered(out, refused, frozenset(forged))


def test_gather_caps_announced_lengths_before_allocating(monkeypatch) -> None:
    """Rank 1 announces 2**62 bytes, rank 2 a negative length: the blob buffer is sized by the honest ranks'
    lengths only, both are refused and hold nothing, and the honest inventories arrive."""
    c = chan()
    blobs = [encode(inv((4,), latest=4), c, r) for r in range(WORLD)]
    lengths = [len(blobs[0]), 2 ** 62, -7, len(blobs[3])]
    group = FakeGroup(blobs, lengths)
    group.install(monkeypatch)
    gathered = inv_wire.gather(inv((4,), latest=4), c)
    assert max(group.sizes) <= max(len(b) for b in blobs), group.sizes
    assert set(gathered.refused) == {1, 2} and "announced a restore inventory of 4611686018427387904" in \
        gathered.refused[1]
    assert gathered.inventories[0] == gathered.inventories[3] == inv((4,), latest=4)
    assert gathered.inventories[1] == gathered.inventories[2] == nothing()


def test_gather_checks_every_inventory_with_the_same_verdict_on_every_rank(monkeypatch) -> None:
    c = chan()
    blobs = [encode(inv((4,), latest=4), c, r) for r in range(WORLD)]
    blobs[1] = signed(json.dumps(inv((1_000_000,))).encode(), channel=chan(key=b"o" * 32))
    verdicts = []
    for me in range(WORLD):
        group = FakeGroup(blobs, me=me)
        group.install(monkeypatch)
        got = inv_wire.gather(json.loads(blobs[me][32:]) if me != 1 else inv(), c)
        verdicts.append((sorted(got.refused), got.forged, got.inventories))
    assert all(v == verdicts[0] for v in verdicts) and verdicts[0][0] == [1]


def test_gather_on_a_real_one_rank_group_round_trips() -> None:
    import datetime

    import torch.distributed as dist
    mine = inv((4, 6), latest=6, copies={0: [6]}, live=9, at=9)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        assert inv_wire.gather(mine, chan(world=1)) == Gathered([mine], {}, frozenset())
    finally:
        dist.destroy_process_group()
