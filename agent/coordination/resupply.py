"""Writing an agent's records back into a coordination store that came back empty (a standalone coordinator
killed and started again: agent/coordination/reconnect.py).

Why merge rules and not a plain write-back: every agent writes back what it saw, and what two agents saw of
one record may differ - one read the generation before another moved it. Each record therefore goes back
by the rule that makes the agents agree whatever their order:

- the generation and the restart budget go to the highest any agent saw (compare-and-set, so agents that
  write back together do not count a restart twice: the budget is a value, never an increment);
- a node's holder: a loss (tombstone) beats the incarnation it names, and a live incarnation beats another
  one's tombstone (it took that rank over) - so a node declared lost stays fenced, and its replacement keeps
  its rank, whichever agent writes first;
- the list of declared losses is the union of the lists seen;
- counters (the hints beside per-node marks, the rendezvous' counts) go to the highest count seen;
- everything else is first-claim-wins or has a single writer: written when absent, else left alone.

Signed records stay signed: a value goes back only when it verifies under the job's key for its own name
(what this agent read but could not verify is dropped, not laundered), and it is written as a record of
this job again. The plain rendezvous records (the job secret's check, node counts) go back as they were.
"""
from __future__ import annotations

import json
import logging
from typing import Callable, Optional

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.membership import TOMBSTONE
from hyperpodrun.agent.coordination.reconnect import Ledger
from hyperpodrun.agent.coordination.signed_records import SignedRecords
from hyperpodrun.agent.coordination.store_schema import Layout, RestartBudget
from hyperpodrun.agent.ports import KVStore

log = logging.getLogger("hyperpodrun.agent")

#: how often a counter's compare-and-set is tried again while other agents move it
_TRIES = 64
_DROPPED = K.node_dropped("")


class Resupply:
    """The Resupplier of one job (its signing key and run id)."""

    def __init__(self, key: bytes, run_id: str) -> None:
        self._key = key
        self._run = run_id

    def __call__(self, store: KVStore, ledger: Ledger) -> int:
        """Write `ledger` back into `store` (the run's prefix over the new coordinator); -> records written."""
        records = SignedRecords(store, self._key, self._run, forged=lambda name: None)
        written = 0
        for name, raw in sorted(ledger.values().items()):
            if K.is_plain(name):
                if not store.check([name]):
                    store.compare_set(name, b"", raw)     # the first agent's wins: they agree on these
                    written += 1
                continue
            mine = records.verified(name, raw)
            if mine is None:
                continue            # not a record of this job: never written back
            if merged(name, mine, records.read(name)) is not None:
                records.update(name, lambda current: merged(name, mine, current) or current or mine)
                written += 1
        for name, count in sorted(ledger.counts().items()):   # after the marks they count
            written += raise_to(store, name, count)
        return written


def merged(name: str, mine: str, current: Optional[str]) -> Optional[str]:
    """The value record `name` should hold given this agent's `mine` and the store's `current` (None:
    absent); None when `current` stays as it is."""
    if current is None:
        return mine
    if current == mine:
        return None
    rule = _RULES.get(name) or (_holder if K.is_node_holder(name) else None)
    return rule(mine, current) if rule is not None else None


def _generation(mine: str, current: str) -> Optional[str]:
    return mine if int(mine) > int(current) else None


def _budget(mine: str, current: str) -> Optional[str]:
    a, b = RestartBudget.model_validate_json(mine), RestartBudget.model_validate_json(current)
    return mine if (a.counted, a.used) > (b.counted, b.used) else None


def _layout(mine: str, current: str) -> Optional[str]:
    newer = Layout.model_validate_json(mine).generation > Layout.model_validate_json(current).generation
    return mine if newer else None


def _losses(mine: str, current: str) -> Optional[str]:
    have = json.loads(current)
    known = {(x.get("node"), x.get("incarnation")) for x in have}
    more = [x for x in json.loads(mine) if (x.get("node"), x.get("incarnation")) not in known]
    return json.dumps(have + more) if more else None


def _holder(mine: str, current: str) -> Optional[str]:
    """A loss beats the incarnation it names (and a shrink beats the loss); a live incarnation beats another
    incarnation's loss, having taken that rank over since. Two live incarnations: the store's stays."""
    def parts(value: str) -> tuple[str, int]:
        if value.startswith(_DROPPED):
            return value[len(_DROPPED):], 2
        if value.startswith(TOMBSTONE):
            return value[len(TOMBSTONE):], 1
        return value, 0
    (mine_inc, mine_level), (cur_inc, cur_level) = parts(mine), parts(current)
    if mine_inc == cur_inc:
        return mine if mine_level > cur_level else None
    return mine if mine_level == 0 and cur_level > 0 else None


_RULES: dict[str, Callable[[str, str], Optional[str]]] = {
    K.GENERATION: _generation, K.RESTARTS_USED: _budget, K.LAYOUT: _layout, K.NODE_LOSSES: _losses,
}


def raise_to(store: KVStore, name: str, count: int) -> bool:
    """Counter `name` to at least `count` (compare-and-set: agents that write back together agree on the
    highest); True when this call raised it."""
    want = str(count).encode()
    for _ in range(_TRIES):
        raw = bytes(store.get(name)) if store.check([name]) else b""
        try:
            if raw and int(raw) >= count:
                return False
        except ValueError:
            pass                     # not a count (something outside the job wrote it): ours replaces it
        if bytes(store.compare_set(name, raw, want)) == want:
            return True
    log.warning("could not write back the counter %r: it keeps changing", name)
    return False
