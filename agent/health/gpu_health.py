"""GPU health on this node (`--health-check auto|nvml|none`): what the agent does about a GPU event.

Owned by the agent's loop thread; the NVML monitor thread (agent/health/nvml_monitor.py) and fault injection
(`hyperpodrun inject --kind nvml-xid|gpu-lost`) only post `("gpu", GpuEvent)` to the loop, so a synthetic
event takes exactly the path of a real one. It holds no handle on the agent: it reads the node's phase
(NodeState) and asks the node, through the GpuOps port, to kill, replace or fail (docs/ARCHITECTURE.md,
"Ports"). Constructing it only reads the inventory; `start()` starts the monitor and acts on what is
already wrong. Per event (classification: agent/health/xid.py):

- WARN / INFO: one `gpu_event` record, counted (the counts are in the final `gpu_summary` record).
- RANK: the rank on that GPU is a faulty rank: it is killed and started again on the same GPU; under
  --inprocess-restart the other ranks restart in-process, without it a process-level restart follows.
- GPU: as RANK, and the GPU is unusable for the rest of the job: the rank moves to a spare GPU (a GPU visible
  to the node that no local rank uses) with an adjusted CUDA_VISIBLE_DEVICES; with no spare the node stops its
  workers and exits 76 (EXIT_NO_USABLE_GPU: replace this node), and the event log says which GPU and rank.
  One exception: a single fatal XID on a GPU when there is no spare. An XID reports what the driver saw;
  whether the GPU itself is broken shows in NVML's own state, which the monitor watches (the GPU stops
  answering, its uncorrectable-ECC counter rises, row remapping fails). So the first fatal XID on a GPU
  without a spare replaces the rank on that GPU and marks the GPU suspect; a second fatal XID on it, or any
  of that evidence, makes it unusable (spare or 76). With a spare, the rank moves at once.

Which rank uses which GPU: agent/health/gpu_map.py. Without NVML (auto) nothing is monitored, but injected events
still act, on the GPUs CUDA_VISIBLE_DEVICES names (or one per local rank), so drills work on any machine.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Callable, Optional

from hyperpodrun.agent.health.gpu_map import (DeviceInfo, fallback_inventory, initial_assignment, match_report, spares,
                                       visible_devices, visible_devices_for)
from hyperpodrun.agent.health.nvml_backend import Backend, NvmlUnavailable, load_nvml
from hyperpodrun.agent.health.nvml_monitor import NvmlMonitor
from hyperpodrun.agent.ports import Events, GpuOps, Posted
from hyperpodrun.agent.state import NodeState
from hyperpodrun.agent.coordination.store_schema import FailureInfo
from hyperpodrun.agent.health.xid import GPU, INFO, RANK, WARN, GpuEvent, Verdict, classify
from hyperpodrun.launch.config import LaunchConfig
from hyperpodrun.errors import EXIT_NO_USABLE_GPU, EXIT_RESTARTS_EXHAUSTED

log = logging.getLogger("hyperpodrun.agent")

_LEVEL = {GPU: logging.ERROR, RANK: logging.ERROR, WARN: logging.WARNING, INFO: logging.INFO}


class GpuHealth:
    """Inventory, rank -> GPU map, unusable GPUs and counters of this node; acts on GPU events."""

    def __init__(self, cfg: LaunchConfig, host: str, rank_offset: int, events: Events, ops: GpuOps,
                 state: NodeState, post: Callable[[Posted], None], backend: Optional[Backend] = None) -> None:
        self.mode = cfg.health_check
        self.host = host
        self.interval = cfg.health_interval
        self.offset = rank_offset
        self.events = events
        self.ops = ops
        self.state = state
        self.post = post
        self.backend = backend
        self.monitor: Optional[NvmlMonitor] = None
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.unavailable = ""    # why NVML is not used (auto mode without NVML)
        if self.backend is None:
            try:
                self.backend = load_nvml()
            except NvmlUnavailable as exc:
                if self.mode == "nvml":
                    raise
                self.unavailable = str(exc)
        if self.backend is not None:
            self.inventory = self.backend.devices()
            self.visible = visible_devices(cvd, self.inventory)
        else:
            self.inventory = self.visible = fallback_inventory(cvd, cfg.nproc_per_node)
        self.assignment = initial_assignment(self.visible, cfg.nproc_per_node)
        self.source = {lr: "CUDA_VISIBLE_DEVICES" for lr in self.assignment}
        self.unusable: set[int] = set()
        self.suspect: set[int] = set()      # a fatal XID without a spare: replaced in place once (see above)
        self.counts: Counter[str] = Counter()        # "xid 79", "ecc", "throttle", ...
        self.by_action: Counter[str] = Counter()     # gpu / rank / warn / info
        self._reported: dict[int, tuple[int, Optional[str], Optional[str]]] = {}

    def start(self) -> None:
        """Say what is monitored, start the monitor thread, and act on what is wrong already (a failed row
        remap, a lost GPU): before any worker starts, so a rank starts on a spare GPU, or the node ends
        with EXIT_NO_USABLE_GPU at once."""
        if self.backend is None:
            self.events.emit("gpu_health", f"GPU health: NVML not available ({self.unavailable}), no GPU "
                             "monitoring (--health-check auto)", nvml=False)
            return
        early: list[Posted] = []
        self.monitor = NvmlMonitor(self.backend, early.append, interval=self.interval)
        self.monitor.baseline()
        self.monitor.post = self.post
        self.monitor.start()
        names = sorted({d.name for d in self.inventory if d.name})
        mapping = ", ".join(f"{lr}->{self._label(i)}" for lr, i in self.assignment.items())
        free = spares(self.visible, self.assignment, self.unusable)
        self.events.emit("gpu_health", f"GPU health: NVML monitor on {len(self.inventory)} GPU(s) "
                         f"({', '.join(names)}), XID events registered on {len(self.monitor.registered)}; "
                         f"local rank -> GPU: {mapping}; spare GPU(s): "
                         f"{', '.join(self._label(i) for i in free) or 'none'}", nvml=True,
                         gpus=len(self.inventory), xid_registered=self.monitor.registered,
                         mapping={lr: self._uuid(i) for lr, i in self.assignment.items()})
        for _, ev in early:
            self.on_event(ev)

    # ------------------------------------------------------------------ helpers
    def _dev(self, index: Optional[int]) -> Optional[DeviceInfo]:
        return next((d for d in self.inventory if d.index == index), None)

    def _label(self, index: Optional[int]) -> str:
        dev = self._dev(index)
        return dev.label if dev is not None else f"GPU {index}"

    def _uuid(self, index: Optional[int]) -> Optional[str]:
        dev = self._dev(index)
        return dev.uuid if dev is not None else None

    def owners(self, index: Optional[int]) -> list[int]:
        """Local ranks that use GPU `index`."""
        return [lr for lr, i in self.assignment.items() if i is not None and i == index]

    def env_for(self, local_rank: int) -> dict[str, str]:
        """Extra environment of a (re)started worker: an explicit CUDA_VISIBLE_DEVICES once a GPU of the node
        is unusable or the rank moved to a spare; nothing otherwise (the user's environment as it is)."""
        if self.assignment.get(local_rank) is None or (not self.unusable and self.source[local_rank] != "spare"):
            return {}
        return {"CUDA_VISIBLE_DEVICES": visible_devices_for(local_rank, self.visible, self.assignment,
                                                            self.unusable)}

    # ------------------------------------------------------------------ inputs
    def on_report(self, rank: int, pid: int, uuid: Optional[str], pci_bus_id: Optional[str]) -> None:
        """A worker said which GPU it uses (HELLO / heartbeat): that beats the CUDA_VISIBLE_DEVICES guess."""
        lr = rank - self.offset
        proc = self.ops.workers.get(lr)
        if (not uuid and not pci_bus_id) or proc is None or proc.pid != pid:
            return
        key = (pid, uuid, pci_bus_id)
        if self._reported.get(lr) == key:
            return
        self._reported[lr] = key
        idx = match_report(self.inventory, uuid, pci_bus_id)
        if idx is None:
            log.debug("rank %d reports GPU %s / %s, not one NVML lists here", rank, uuid, pci_bus_id)
            return
        before, self.assignment[lr], self.source[lr] = self.assignment.get(lr), idx, "report"
        moved = before != idx
        self.events.emit("gpu_map", f"rank {rank} reports {self._label(idx)}" + (
            f"; CUDA_VISIBLE_DEVICES gave {self._label(before)}: using the report" if moved else ""),
            rank=rank, gpu=idx, uuid=self._uuid(idx), pci_bus_id=pci_bus_id, pid=pid,
            level=logging.INFO if moved else logging.DEBUG)
        if idx in self.unusable:
            self._act(Verdict(GPU, "the rank reports a GPU already declared unusable"), idx, [lr], "")

    def inject(self, rank: int, kind: str, xid: Optional[int]) -> tuple[bool, str]:
        """A synthetic NVML event on the GPU of `rank` (fault injection); (accepted, detail)."""
        lr = rank - self.offset
        if lr not in self.assignment:
            return False, f"rank {rank} is not on this node"
        idx = self.assignment[lr]
        if idx is None:
            return False, f"rank {rank} has no known GPU (more ranks than visible GPUs, and it reported none)"
        if kind == "nvml-xid":
            if xid is None:
                return False, "--kind nvml-xid needs --xid N (e.g. --xid 79)"
            ev = GpuEvent("xid", idx, xid=xid, synthetic=True)
            what = f"XID {xid}"
        else:
            ev = GpuEvent("lost", idx, detail="declared lost by fault injection", synthetic=True)
            what = "GPU lost"
        self.post(("gpu", ev))
        return True, f"synthetic {what} on {self._label(idx)} (rank {rank})"

    # ------------------------------------------------------------------ actions
    def on_event(self, ev: GpuEvent) -> None:
        """Classify one GPU event and act on it (loop thread)."""
        verdict = classify(ev)
        self.counts[f"xid {ev.xid}" if ev.kind == "xid" else ev.kind] += 1
        self.by_action[verdict.action] += 1
        owners = self.owners(ev.device)
        where = self._label(ev.device) if ev.device is not None else "NVML"
        if ev.device is not None and ev.device not in {d.index for d in self.visible}:
            self.events.emit("gpu_event", f"{where} (not visible to this job): {verdict.what}", level=logging.INFO,
                               gpu=ev.device, uuid=self._uuid(ev.device), xid=ev.xid, action=verdict.action)
            return
        if owners:
            where += " of rank " + ", ".join(str(self.offset + lr) for lr in owners)
        elif ev.device is not None:
            where += " (no local rank uses it)"
        tag = " [injected]" if ev.synthetic else ""
        fields: dict[str, Any] = {"gpu": ev.device, "uuid": self._uuid(ev.device), "xid": ev.xid,
                                  "action": verdict.action, "synthetic": ev.synthetic or None,
                                  "rank": self.offset + owners[0] if owners else None}
        if verdict.action in (WARN, INFO):
            self.events.emit("gpu_event", f"{where}: {verdict.what}{tag}", level=_LEVEL[verdict.action], **fields)
            return
        if ev.device in self.unusable:
            self.events.emit("gpu_event", f"{where}: {verdict.what}{tag} (already unusable)", **fields)
            return
        dev = ev.device
        if verdict.action == GPU and ev.kind == "xid" and owners and dev is not None and dev not in self.suspect \
                and not spares(self.visible, self.assignment, self.unusable):
            self.suspect.add(dev)
            verdict = Verdict(RANK, f"{verdict.what} - no spare GPU: the rank restarts on this GPU, now suspect "
                                    f"(a second fatal XID, or NVML finding it broken, ends this node with "
                                    f"{EXIT_NO_USABLE_GPU})")
            fields["action"] = RANK
        if verdict.action == GPU and dev is not None:
            self.unusable.add(dev)
        ending = self.state.ending
        todo = ("the job is ending: no action" if ending or not owners else
                "its rank must move to a spare GPU" if verdict.action == GPU else "replacing the rank's process")
        if verdict.action == GPU and not owners:
            todo = "no rank uses it: one spare GPU fewer"
        self.events.emit("gpu_fault", f"{where}: {verdict.what}{tag}: {todo}", level=_LEVEL[verdict.action],
                           **fields)
        if owners and not ending and dev is not None:
            self._act(verdict, dev, owners, tag)

    def _act(self, verdict: Verdict, index: int, owners: list[int], tag: str) -> None:
        """Replace each rank of `owners` (on a spare GPU when `index` is unusable), or end the node with 76."""
        for lr in owners:
            rank = self.offset + lr
            proc = self.ops.workers.get(lr)
            cause = f"{self._label(index)}: {verdict.what}{tag}"
            info = FailureInfo(host=self.host, rank=rank, local_rank=lr, pid=proc.pid if proc else None,
                               step=self.ops.last_step(lr), secondary=False, gpu=self._label(index), cause=cause,
                               summary=f"rank {rank}: {cause}", exit_code=EXIT_RESTARTS_EXHAUSTED)
            if index in self.unusable:
                free = spares(self.visible, self.assignment, self.unusable)
                if not free:
                    usable = len([d for d in self.visible if d.index not in self.unusable])
                    msg = (f"rank {rank} (local rank {lr}) has no usable GPU: {cause}; no spare GPU on this node "
                           f"({len(self.visible)} visible, {usable} usable, {len(self.assignment)} local ranks): "
                           f"stopping this node's workers, exit code {EXIT_NO_USABLE_GPU} (replace this node)")
                    self.events.emit("no_usable_gpu", msg, level=logging.ERROR, rank=rank, gpu=index,
                                     uuid=self._uuid(index), exit_code=EXIT_NO_USABLE_GPU)
                    self.ops.kill(lr)   # on a dead GPU it may never act on a polite signal
                    self.ops.fail_job(info.with_(summary=msg, cause=msg), EXIT_NO_USABLE_GPU)
                    return
                self.assignment[lr], self.source[lr] = free[0], "spare"
                self.events.emit("gpu_remap", f"rank {rank} moves from {self._label(index)} to spare "
                                 f"{self._label(free[0])}", rank=rank, gpu=free[0], uuid=self._uuid(free[0]),
                                 from_gpu=index, level=logging.WARNING)
            self.ops.rank_fault(lr, info)

    # ------------------------------------------------------------------ end
    def report(self) -> None:
        """The counters, once at the end of the job (only when something was monitored or happened)."""
        if self.monitor is None and not self.counts:
            return
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items())) or "none"
        unusable = ", ".join(self._label(i) for i in sorted(self.unusable)) or "none"
        self.events.emit("gpu_summary", f"GPU health: events {counts}; unusable GPUs: {unusable}",
                           counts=dict(self.counts), actions=dict(self.by_action),
                           unusable=[self._uuid(i) or i for i in sorted(self.unusable)],
                           polls=self.monitor.polls if self.monitor else None)

    def stop(self) -> None:
        if self.monitor is not None and self.monitor.stop() and self.backend is not None:
            self.backend.close()
