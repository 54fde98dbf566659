"""The elastic part of the in-process round (`--nnodes MIN:MAX`): shrink, grow, and moving to a new layout.

Why a module of its own: the round (agent/inprocess.py) knows faults, READY and GO; whether the job's nodes
change in a round is a separate decision with its own records (agent/coordination/layout.py). The round asks this class
three things - which layout the round moves to (`follow`), what to do when a lost node was not replaced in
time (`shrink`), and whether a newcomer waits to be admitted (`admission`) - and hands GO the new places.
"""
from __future__ import annotations

import logging
from typing import Optional

from hyperpodrun.agent.coordination import layout as L
from hyperpodrun.agent.ports import Clock, Coordination, Events, RendezvousInfo
from hyperpodrun.agent.rankstate import Round
from hyperpodrun.agent.coordination.store_schema import FailureInfo, Layout, NodeJoin
from hyperpodrun.launch.config import LaunchConfig

log = logging.getLogger("hyperpodrun.agent")


class Elastic:
    """Layout changes of one node's rounds. Fixed-size jobs never change layout: every method is then a no-op."""

    def __init__(self, cfg: LaunchConfig, rdzv: RendezvousInfo, coord: Coordination, events: Events,
                 clock: Clock) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.coord = coord
        self.events = events
        self.clock = clock
        self.on = cfg.elastic and not rdzv.single_node
        # the newest layout this node's workers were moved to; a newcomer's workers have yet to be told theirs
        self.applied = -1 if rdzv.admitted is not None else rdzv.layout_generation
        self.joining: dict[int, NodeJoin] = {}      # newcomers waiting to be admitted (store host only)

    # ------------------------------------------------------------------ the round's layout
    def nodes(self, r: Round) -> list[int]:
        """The node ranks whose READY the round waits for."""
        return sorted(r.layout.nodes) if r.layout is not None else list(self.rdzv.nodes)

    def follow(self, r: Round) -> None:
        """Learn whether the round's layout changed (the store host decides, and may change it again in the same
        round when another node is lost): the lost nodes it leaves out are no longer awaited."""
        if not self.on or (r.layout is not None and self.rdzv.store_host):
            return    # the store host set it itself
        found = self.coord.layout_for_round(r.target)
        if found is None or found.generation <= self.applied or found == r.layout:
            return
        r.layout = found
        for node in [n for n in r.awaiting if n not in found.nodes]:
            r.awaiting.pop(node)

    def excluded(self, r: Round) -> bool:
        """The round's layout leaves this node out (it came back too late)."""
        return r.layout is not None and self.rdzv.node_rank not in r.layout.nodes

    def adopt(self, r: Round) -> Optional[Layout]:
        """At GO: run on the round's layout from now on; returns it when the job's nodes changed."""
        lay = r.layout
        if lay is None:
            return None
        self.rdzv.adopt(lay)
        self.applied = lay.generation
        return lay

    # ------------------------------------------------------------------ shrink
    def shrink(self, r: Round, now: float) -> bool:
        """A lost node was not replaced within --replace-timeout. True when the round goes on - without it
        (store host: the job shrinks while MIN nodes remain), or waiting for the store host's decision."""
        if not self.on:
            return False
        if not self.rdzv.store_host:
            if r.shrink_wait:
                return False
            r.shrink_wait = True
            r.deadline = now + self.cfg.inprocess_timeout
            return True
        base = dict(r.layout.nodes) if r.layout is not None else dict(self.rdzv.counts)
        if len(base) - len(r.awaiting) < self.cfg.min_nnodes:
            return False
        dropped = [n for n, inc in list(r.awaiting.items()) if self.coord.drop_lost(n, inc)]
        for n in dropped:
            r.awaiting.pop(n)
        if not dropped:   # replaced at this very moment: the replacement's ranks are awaited now
            r.deadline = now + self.cfg.inprocess_timeout
            return True
        lay = self.coord.set_layout(L.shrunk(base, dropped, r.target))
        r.layout = lay
        r.deadline = now + self.cfg.inprocess_timeout
        self.events.emit("job_shrunk", f"node(s) {', '.join(map(str, dropped))} not replaced within "
                         f"--replace-timeout {self.cfg.replace_timeout:g}s: the job goes on with {len(lay.nodes)} "
                         f"node(s) and {lay.world_size} ranks (was {lay.previous_world_size}) from generation "
                         f"{lay.generation} (--nnodes {self.cfg.min_nnodes}:{self.cfg.nnodes})",
                         generation=lay.generation, nodes=sorted(lay.nodes), world_size=lay.world_size,
                         previous_world_size=lay.previous_world_size, level=logging.WARNING)
        return True

    # ------------------------------------------------------------------ grow
    def want_join(self, node: int, join: NodeJoin) -> None:
        """A newcomer holds unused node rank `node` and asks to be admitted (store host only)."""
        if self.on and self.rdzv.store_host:
            self.joining[node] = join

    def admission(self, generation: int) -> Optional[FailureInfo]:
        """Between rounds: admit one waiting newcomer at generation+1 - its layout is written before the round
        starts, so no node can count that round's barrier without it. Returns the round's cause, or None."""
        while self.joining:
            node, join = next(iter(self.joining.items()))
            if node in self.rdzv.counts or len(self.rdzv.counts) >= self.cfg.nnodes:
                self.joining.pop(node)
                log.info("node %d not admitted: the job %s", node, "has it" if node in self.rdzv.counts else
                         f"has --nnodes max {self.cfg.nnodes} nodes")
                continue
            if self.coord.generation() != generation:
                return None   # a round is starting elsewhere: admit after it
            lay = self.coord.set_layout(L.grown(self.rdzv.counts, node, join.nproc, generation + 1))
            self.joining.pop(node)
            self.events.emit("node_admitted", f"node {node} ({join.host}) joins the job in generation "
                             f"{lay.generation}: {len(lay.nodes)} node(s), {lay.world_size} ranks (was "
                             f"{lay.previous_world_size}; --nnodes {self.cfg.min_nnodes}:{self.cfg.nnodes})",
                             node=node, generation=lay.generation, world_size=lay.world_size,
                             previous_world_size=lay.previous_world_size)
            return FailureInfo(host=join.host, node=node, cause="node joins", remote=True, generation=generation,
                               summary=f"node {node} ({join.host}) joins the job: {lay.previous_world_size} -> "
                                       f"{lay.world_size} ranks")
        return None
