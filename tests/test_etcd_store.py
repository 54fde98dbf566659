"""The etcd coordination store (agent/coordination/etcd_store.py) against a real etcd member on loopback: each
operation the agents use answers as a TCPStore's does (checked against torch's own in-memory store), adds
and claims from several threads never lose an update, jobs' keys stay apart, the members are tried in
turn, and an etcd that stays away ends in one line after the deadline - not before, not never."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from conftest import free_port
from etcd_cluster import EtcdCluster, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-one"), 1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _link(endpoints: str, prefix: str, timeout_s: float = 30.0, **kw):
    from hyperpodrun.agent.coordination.etcd_store import EtcdLink
    from hyperpodrun.launch.rdzv_conf import EtcdConf
    pairs = [(h, int(p)) for h, p in (e.split(":") for e in endpoints.split(","))]
    return EtcdLink(EtcdConf(endpoints=pairs), prefix, timeout_s=timeout_s, **kw)


def test_operations_answer_as_a_tcpstore_does(etcd):
    """set/get/add/check/compare_set/delete_key/wait, side by side with torch's HashStore (the TCPStore's
    semantics, in memory)."""
    import torch.distributed as dist
    etcd_store, ref = _link(etcd.endpoints, "hyperpodrun/ops/").connect(), dist.HashStore()
    for store in (etcd_store, ref):
        store.set_timeout(timedelta(seconds=5))
    steps = [("set", "a", b"1"), ("get", "a"), ("set", "a", "two"), ("get", "a"), ("add", "n", 3), ("add", "n", -1),
             ("add", "n", 0), ("get", "n"), ("add", "fresh", 0), ("check", ["a", "n"]), ("check", ["a", "nope"]),
             ("compare_set", "c", "", "x"), ("compare_set", "c", "", "y"), ("compare_set", "c", "x", "z"),
             ("compare_set", "c", "x", "w"), ("compare_set", "absent", "e", "v"), ("check", ["absent"]),
             ("set", "bin", bytes(range(256))), ("get", "bin"), ("delete_key", "a"), ("check", ["a"]),
             ("delete_key", "a")]
    for op, *args in steps:
        got = [getattr(s, op)(*args) for s in (etcd_store, ref)]
        got = [bytes(g) if isinstance(g, (bytes, bytearray, list)) and op != "check" else g for g in got]
        assert got[0] == got[1], (op, args, got)
    etcd_store.wait(["n", "c"], timedelta(seconds=1))


def test_get_waits_for_its_key_and_times_out_as_a_tcpstore(etcd):
    store = _link(etcd.endpoints, "hyperpodrun/wait/").connect()
    writer = _link(etcd.endpoints, "hyperpodrun/wait/").connect()
    threading.Timer(0.2, lambda: writer.set("late", "here")).start()
    store.set_timeout(timedelta(seconds=5))
    assert store.get("late") == b"here"
    store.set_timeout(timedelta(seconds=0.3))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:   # torch's DistStoreError, as a TCPStore's get raises
        store.get("never")
    assert any(c.__name__ == "DistStoreError" for c in type(err.value).__mro__)
    assert 0.3 <= time.monotonic() - start < 3


def test_concurrent_adds_and_claims_lose_nothing(etcd):
    """Four threads (one connection each, as the agents' threads have) add 25 times each, and all claim one
    record: the count is exact and one claim wins for all."""
    link = _link(etcd.endpoints, "hyperpodrun/race/")
    won: list[bytes] = []

    def work(i: int) -> None:
        store = link.connect()
        for _ in range(25):
            store.add("count", 1)
        won.append(bytes(store.compare_set("claim", "", f"t{i}")))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store = link.connect()
    assert store.add("count", 0) == 100
    assert len(set(won)) == 1 and won[0] == store.get("claim")


def test_jobs_do_not_see_each_others_keys(etcd):
    a, b = _link(etcd.endpoints, "hyperpodrun/job-a/").connect(), _link(etcd.endpoints, "hyperpodrun/job-b/").connect()
    a.set("generation", "3")
    assert a.check(["generation"]) and not b.check(["generation"])
    assert b.add("generation", 0) == 0 and a.get("generation") == b"3"


def test_signed_records_and_secret_agreement_run_on_etcd(etcd):
    """The agents' own record code (signed claims, updates, marks and counts) over the etcd store."""
    from hyperpodrun.agent.coordination.signed_records import SignedRecords, agree_secret
    store = _link(etcd.endpoints, "hyperpodrun/signed/").connect()
    secret, warning = agree_secret(store, None, "signed", "etcd")
    assert agree_secret(_link(etcd.endpoints, "hyperpodrun/signed/").connect(), None, "signed", "etcd")[0] == secret
    records = SignedRecords(store, secret, "signed", forged=lambda name: None)
    assert records.claim("holder", "me") == "me" and records.claim("holder", "you") == "me"
    assert records.update("gen", lambda cur: str(int(cur or 0) + 1)) == "1"
    records.mark("done", 0)
    records.mark("done", 1)
    assert records.count("done", [0, 1]) == 2 and warning


def test_members_are_tried_in_turn(etcd):
    """A dead endpoint first in the list: every call goes on to the live member, no outage is told."""
    told: list[tuple] = []
    link = _link(f"127.0.0.1:{free_port()},{etcd.endpoints}", "hyperpodrun/turn/")
    link.post = told.append
    store = link.connect()
    store.set("k", "v")
    assert store.get("k") == b"v" and not told


def test_an_etcd_that_stays_away_ends_in_one_line_after_the_deadline():
    """No member answers: the call keeps trying for the deadline, the outage is told once, then one line."""
    from hyperpodrun.agent.coordination.etcd_store import EtcdUnreachable
    told: list[tuple] = []
    link = _link(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", "hyperpodrun/gone/", timeout_s=1.0)
    link.post = told.append
    store = link.connect()
    start = time.monotonic()
    with pytest.raises(EtcdUnreachable) as err:
        store.check(["x"])
    took = time.monotonic() - start
    assert 1.0 <= took < 4, took
    assert "\n" not in str(err.value) and "coordinator_timeout" in str(err.value), err.value
    assert [kind for kind, _ in told] == ["coordinator_lost"], told


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory):
    pytest.importorskip("cryptography")
    from etcd_cluster import make_certs
    tmp = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certs(tmp)
    cluster = EtcdCluster(tmp, 1, tls=certs).start()
    try:
        yield cluster, certs
    finally:
        cluster.stop()


def _tls_link(cluster, prefix: str, timeout_s: float = 30.0, **files):
    from hyperpodrun.agent.coordination.etcd_store import EtcdLink
    from hyperpodrun.launch.rdzv_conf import EtcdConf
    pairs = [(h, int(p)) for h, p in (e.split(":") for e in cluster.endpoints.split(","))]
    return EtcdLink(EtcdConf(endpoints=pairs, protocol="https", **files), prefix, timeout_s=timeout_s)


def test_tls_with_client_certificates(etcd_tls):
    """A member that admits only clients with a certificate its CA signed (--client-cert-auth): the store works
    with --rdzv-conf's cacert, cert and key; without the client certificate, or trusting another CA, it does
    not, and the line says why."""
    from hyperpodrun.agent.coordination.etcd_store import EtcdUnreachable
    cluster, certs = etcd_tls
    store = _tls_link(cluster, "hyperpodrun/tls/", cacert=certs["ca"], cert=certs["client"],
                      key=certs["client_key"]).connect()
    store.set("k", "v")
    assert store.get("k") == b"v" and store.add("n", 2) == 2
    with pytest.raises(EtcdUnreachable, match="TLS"):
        _tls_link(cluster, "hyperpodrun/tls/", timeout_s=0.5, cacert=certs["other_ca"], cert=certs["client"],
                  key=certs["client_key"]).connect().check(["k"])
    with pytest.raises(EtcdUnreachable, match="TLS"):
        _tls_link(cluster, "hyperpodrun/tls/", timeout_s=0.5, cacert=certs["ca"]).connect().check(["k"])
