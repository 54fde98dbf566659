"""LossNews: how an agent that does not watch every lease learns of lost and replaced nodes from the one
record of declared losses - each loss told once, its replacement told once, its own node never."""
from __future__ import annotations

from typing import Optional

from hyperpodrun.agent.coordination.membership import LossNews
from hyperpodrun.agent.coordination.store_schema import NodeLoss


def loss(node: int, inc: str) -> NodeLoss:
    return NodeLoss(node=node, incarnation=inc, generation=3, by_node=0, why="no lease renewal for 5.0s",
                    wall_time=0.0)


def test_each_loss_and_its_replacement_are_told_once() -> None:
    news = LossNews(me=2)
    holders: dict[int, Optional[str]] = {1: "a"}
    assert news.observe([], holders.get) == []
    assert news.observe([loss(1, "a")], holders.get) == [("node_lost", (1, "a", "no lease renewal for 5.0s"))]
    assert news.observe([loss(1, "a")], holders.get) == [], "told once"
    holders[1] = "b"                                   # a replacement took node 1's rank
    assert news.observe([loss(1, "a")], holders.get) == [("node_joined", (1, "b"))]
    assert news.observe([loss(1, "a")], holders.get) == []
    # the replacement is lost in turn: a new loss, and a new replacement
    holders[1] = "c"
    assert news.observe([loss(1, "a"), loss(1, "b")], holders.get) == [
        ("node_lost", (1, "b", "no lease renewal for 5.0s")), ("node_joined", (1, "c"))]


def test_a_loss_already_replaced_when_first_seen_is_no_news() -> None:
    """An agent that joins later (a replacement of another node) does not act on losses that are over."""
    news = LossNews(me=0)
    assert news.observe([loss(1, "a")], {1: "b"}.get) == []
    assert news.observe([loss(1, "a"), loss(2, "c")], {1: "b", 2: "lost:c"}.get) == [
        ("node_lost", (2, "c", "no lease renewal for 5.0s"))], "a later loss is news; a tombstone is no replacement"


def test_its_own_loss_is_not_news_to_a_node() -> None:
    """A replacement reads the loss of the incarnation it replaced: nothing to do (fencing is the holder check)."""
    assert LossNews(me=1).observe([loss(1, "a")], {1: "b"}.get) == []


def test_the_lease_watch_reports_no_replacement_for_a_tombstone() -> None:
    """Declaring a loss turns the holder record into a tombstone: not a new holder, nothing more to judge;
    the replacement that takes the rank from it is."""
    from hyperpodrun.agent.coordination.membership import LeaseWatch
    from hyperpodrun.agent.coordination.store_schema import NodeLease
    watch = LeaseWatch(me=0, nnodes=2, timeout=3.0)
    assert watch.observe(0.0, {1: ("a", NodeLease(incarnation="a", count=1))}) == []
    assert watch.observe(3.0, {1: ("a", NodeLease(incarnation="a", count=1))})[0][0] == "node_lost"
    assert watch.observe(4.0, {1: ("lost:a", NodeLease(incarnation="a", count=1))}) == []
    assert watch.observe(60.0, {1: ("lost:a", NodeLease(incarnation="a", count=1))}) == []
    assert watch.observe(61.0, {1: ("b", NodeLease(incarnation="a", count=1))}) == [("node_joined", (1, "b"))]
