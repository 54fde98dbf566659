"""`--rdzv-backend etcd --rdzv-endpoint h1:2379,h2:2379,h3:2379`: the agents meet in an etcd cluster, which
keeps the job's coordination records (agent/coordination/etcd_store.py) - no agent hosts them.

Why a backend of its own, and so little: etcd takes the place of the standalone coordinator
(agent/coordination/coordinator.py), so the agents behave as they do with one - node ranks in join order
(as torchrun's c10d and etcd rendezvous hand them out), a node's command started again (or a hot spare)
takes over a lost node's rank, one agent elected through etcd (a compare-and-set on a key:
agent/coordination/owner.py) watches every lease, and each generation's workers' store is hosted by the live
agent that claims it, never by etcd. What differs is only how the store is reached: the
members in turn, the outage bounded by --rdzv-conf coordinator_timeout - and nothing to write back after an
outage, as etcd keeps its records through the loss of any minority of its members.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from hyperpodrun import netaddr
from hyperpodrun.agent.coordination import store_schema as K
from hyperpodrun.agent.coordination.etcd_store import EtcdLink
from hyperpodrun.agent.coordination.rendezvous import C10dRendezvous, Connected
from hyperpodrun.agent.ports import KVStore, RendezvousInfo
from hyperpodrun.errors import RendezvousError
from hyperpodrun.launch.config import LaunchConfig

log = logging.getLogger("hyperpodrun.agent")


class EtcdRendezvous(C10dRendezvous):
    """The c10d rendezvous' join order and spares, over the run's keys in etcd."""

    _link: Optional[EtcdLink] = None

    def join(self, cfg: LaunchConfig, stop_requested: Callable[[], bool]) -> RendezvousInfo:
        info = super().join(cfg, stop_requested)
        if self._link is not None:     # from here on, an outage happens while the job trains
            self._link.meanwhile = EtcdLink.meanwhile
        return info

    def open_store(self, cfg: LaunchConfig) -> tuple[KVStore, bool, str, str, int]:
        raise RendezvousError("the etcd backend opens no TCP store")   # connect() replaces it

    def connect(self, cfg: LaunchConfig) -> Connected:
        conf = cfg.etcd
        if conf is None:    # the launch configuration sets it for every --rdzv-backend etcd job of several nodes
            raise RendezvousError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]")
        link = EtcdLink(conf, K.run_prefix(cfg.rdzv_id), timeout_s=cfg.coordinator_timeout)
        # until the agent's inbox takes the outage news (agent.py), it is a warning of the rendezvous
        link.post, link.meanwhile = (lambda event: log.warning("%s", event[1])), "the rendezvous waits for etcd"
        self._link = link
        store = link.connect()
        store.check([K.AUTH])      # reach a member now: an outage at the start is told before anything else
        host, port = conf.endpoints[0]
        bind = netaddr.multi_node_bind(host, cfg.local_addr)   # the workers' stores this agent claims listen here
        log.info("the coordination store is the etcd cluster %s (%s): this agent hosts none", conf.where(),
                 conf.protocol)
        return Connected(store, False, True, bind, host, port, link)
