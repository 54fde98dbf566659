"""Elastic layouts: which node ranks run the job from a generation on (`--nnodes MIN:MAX`).

Why: torchrun answers any change of membership by restarting every worker. Here the job's nodes are a signed
record per generation (a `Layout`: node rank -> worker count); when it changes, the next in-process round
moves every surviving rank to it - new global ranks and world size in GO, state from memory - and the
processes stay. Global ranks are handed out node by node in node-rank order, as at the job's start.

Two changes, both decided by the agent that hosts the coordination store (it watches every lease, so it
declares the losses too: one writer, no race between two survivors):

- shrink: a lost node was neither taken over by a spare nor replaced within --replace-timeout, and at least
  MIN nodes remain: the lost node's rank is *dropped* (its holder record goes from the loss's tombstone to
  `dropped:<incarnation>` by compare-and-set, so a replacement arriving at that moment either took the rank
  first - then there is no shrink - or finds it dropped and asks to be admitted instead), and the layout
  of the round under way leaves it out.
- grow: an agent that joins a running elastic job with fewer than MAX nodes holds a free node rank, says
  how many workers it runs (`member/<n>/join`) and waits; the store host writes the layout of the next
  generation with it, then starts that round (in this order, so that no node can count the round's barrier
  without the newcomer). The newcomer's workers join that generation like a replacement's.

Records (agent/coordination/store_schema.py): `layout/<g>` (written by the store host alone) and `layout` (the newest,
which a replacement or a newcomer starts from).
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping, Optional

from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.signed_records import SignedRecords
from hyperpodrun.agent.coordination.store_schema import Layout, NodeJoin

log = logging.getLogger("hyperpodrun.agent")


def shrunk(counts: Mapping[int, int], lost: Iterable[int], generation: int) -> Layout:
    """The layout without the `lost` node ranks, from `generation` on."""
    gone = set(lost)
    return Layout(generation=generation, nodes={n: c for n, c in counts.items() if n not in gone},
                  previous_world_size=sum(counts.values()))


def grown(counts: Mapping[int, int], node: int, nproc: int, generation: int) -> Layout:
    """The layout with node rank `node` (running `nproc` workers) added, from `generation` on."""
    return Layout(generation=generation, nodes={**counts, node: nproc}, previous_world_size=sum(counts.values()))


def free_ranks(nodes: Iterable[int], max_nodes: int) -> list[int]:
    """The node ranks below `max_nodes` that the layout does not use, lowest first."""
    used = set(nodes)
    return [n for n in range(max_nodes) if n not in used]


class LayoutRecords:
    """The layout records of one run, over one store connection (not thread-safe: one per thread)."""

    def __init__(self, records: SignedRecords) -> None:
        self.records = records

    def claim(self, layout: Layout) -> Layout:
        """Make `layout` the job's from its generation on, and the newest one unless a later generation has one.
        Only the store host writes layouts, so a second change in one round (two nodes lost one after the
        other) replaces the first; returned as written."""
        self.records.write(K.layout(layout.generation), layout.model_dump_json())

        def newest(current: Optional[str]) -> str:
            if current and Layout.model_validate_json(current).generation > layout.generation:
                return current
            return layout.model_dump_json()
        self.records.update(K.LAYOUT, newest)
        return layout

    def at(self, generation: int) -> Optional[Layout]:
        """The layout whose nodes changed at `generation`, if they did."""
        value = self.records.read(K.layout(generation))
        return Layout.model_validate_json(value) if value is not None else None

    def latest(self) -> Optional[Layout]:
        """The newest layout change (None: the job runs on the nodes it formed with)."""
        value = self.records.read(K.LAYOUT)
        return Layout.model_validate_json(value) if value is not None else None

    def for_round(self, target: int) -> Optional[Layout]:
        """The layout the round into `target` moves to: the newest change, unless it is for a later round."""
        latest = self.latest()
        return latest if latest is not None and latest.generation <= target else None

    # ------------------------------------------------------------ newcomers
    def ask_to_join(self, node: int, join: NodeJoin) -> None:
        self.records.write(K.node_join(node), join.model_dump_json())

    def join_request(self, node: int) -> Optional[NodeJoin]:
        value = self.records.read(K.node_join(node))
        return NodeJoin.model_validate_json(value) if value is not None else None
