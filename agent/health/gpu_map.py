"""Which GPU each local rank uses: the node's inventory, CUDA_VISIBLE_DEVICES, and the workers' own reports.

Two sources, the second wins:
1. Before a worker reports (and always without --inprocess-restart): local rank r uses the r-th GPU that
   CUDA_VISIBLE_DEVICES makes visible (what `cuda:LOCAL_RANK` / `torch.cuda.set_device(LOCAL_RANK)` selects).
   Entries are NVML indices or UUIDs (`GPU-...`, a unique prefix is enough, as CUDA accepts); unset means
   every GPU; CUDA stops at the first invalid entry and so does this parser. Indices are read in PCI bus order,
   which is NVML's order and CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID. CUDA's default order (FASTEST_FIRST)
   only differs from it on nodes mixing GPU models; set CUDA_DEVICE_ORDER=PCI_BUS_ID there, or rely on 2.
2. A worker under --inprocess-restart reports the UUID and PCI bus id of its current CUDA device once CUDA is
   initialised in it (hyperpodrun/runtime/wrapper.py); that report replaces guess 1 for that rank.

A rank moved to a spare GPU is started with an explicit CUDA_VISIBLE_DEVICES (see `visible_devices_for`).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

log = logging.getLogger("hyperpodrun.agent")


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU of the node. `index` is its NVML index (without NVML: the index CUDA_VISIBLE_DEVICES names, or
    the position); `token` is how CUDA_VISIBLE_DEVICES names it when a rank is moved (its UUID when known)."""

    index: int
    uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None
    name: Optional[str] = None
    token: str = ""

    @property
    def label(self) -> str:
        ident = self.uuid or self.pci_bus_id
        return f"GPU {self.index}" + (f" ({ident})" if ident else "")


def normalize_pci(bus_id: Optional[str]) -> Optional[str]:
    """`0000:1B:00.0` / `00000000:1b:00.0` -> `00000000:1b:00.0` (NVML and torch spell the domain differently)."""
    if not bus_id:
        return None
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)\s*", bus_id)
    if not m:
        return bus_id.strip().lower()
    dom, bus, dev, fn = (int(x, 16) for x in m.groups())
    return f"{dom:08x}:{bus:02x}:{dev:02x}.{fn:x}"


def normalize_uuid(uuid: Optional[str]) -> Optional[str]:
    if not uuid:
        return None
    text = uuid.strip()
    return text if text.upper().startswith(("GPU-", "MIG-")) else "GPU-" + text


def visible_devices(cvd: Optional[str], inventory: Sequence[DeviceInfo]) -> list[DeviceInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES=`cvd` makes visible, in CUDA's order (see the module docstring)."""
    if cvd is None:
        return sorted(inventory, key=lambda d: d.index)
    by_index = {d.index: d for d in inventory}
    out: list[DeviceInfo] = []
    for raw in cvd.split(","):
        token = raw.strip()
        found: Optional[DeviceInfo] = None
        if re.fullmatch(r"-?\d+", token):
            found = by_index.get(int(token))
        elif token.upper().startswith("GPU-"):
            matches = [d for d in inventory if d.uuid and d.uuid.lower().startswith(token.lower())]
            found = matches[0] if len(matches) == 1 else None
        if found is None or found in out:
            if token:
                log.debug("CUDA_VISIBLE_DEVICES=%s: %r names no (new) GPU of this node; CUDA ignores it and "
                          "every entry after it", cvd, token)
            break
        out.append(found)
    return out


def fallback_inventory(cvd: Optional[str], nproc: int) -> list[DeviceInfo]:
    """Without NVML: the GPUs CUDA_VISIBLE_DEVICES names (indices or UUIDs), else one per local rank.

    Used for synthetic events (`hyperpodrun inject`) on machines without NVML, e.g. tests and drills on CPU.
    """
    if cvd is None:
        return [DeviceInfo(index=i, token=str(i)) for i in range(nproc)]
    out: list[DeviceInfo] = []
    for pos, raw in enumerate(t.strip() for t in cvd.split(",")):
        if re.fullmatch(r"\d+", raw):
            dev = DeviceInfo(index=int(raw), token=raw)
        elif raw.upper().startswith("GPU-"):
            dev = DeviceInfo(index=pos, uuid=raw, token=raw)
        else:
            break
        if any(d.index == dev.index for d in out):
            break
        out.append(dev)
    return out


def initial_assignment(visible: Sequence[DeviceInfo], nproc: int) -> dict[int, Optional[int]]:
    """local rank -> inventory index of the GPU it uses (None: it has none, e.g. more ranks than GPUs)."""
    return {lr: (visible[lr].index if lr < len(visible) else None) for lr in range(nproc)}


def match_report(inventory: Sequence[DeviceInfo], uuid: Optional[str], pci_bus_id: Optional[str]) -> Optional[int]:
    """The inventory index of the GPU a worker reported (by UUID, else by PCI bus id), or None."""
    uuid_n, pci_n = normalize_uuid(uuid), normalize_pci(pci_bus_id)
    for dev in inventory:
        if uuid_n and dev.uuid and dev.uuid.lower() == uuid_n.lower():
            return dev.index
    for dev in inventory:
        if pci_n and dev.pci_bus_id and normalize_pci(dev.pci_bus_id) == pci_n:
            return dev.index
    return None


def spares(visible: Sequence[DeviceInfo], assignment: Mapping[int, Optional[int]], unusable: set[int]) -> list[int]:
    """Visible, usable GPUs that no local rank uses: each can take over from a rank whose GPU failed."""
    used = {idx for idx in assignment.values() if idx is not None}
    return [d.index for d in visible if d.index not in used and d.index not in unusable]


def visible_devices_for(local_rank: int, visible: Sequence[DeviceInfo], assignment: Mapping[int, Optional[int]],
                        unusable: set[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a (re)started rank once the node's GPUs changed: position k holds local rank k's
    GPU (so `cuda:LOCAL_RANK` is this rank's new GPU), then the other usable GPUs; unusable GPUs are left out
    (a GPU that fell off the bus can make CUDA's initialisation fail in every process that sees it)."""
    by_index = {d.index: d for d in visible}
    usable = [d.index for d in visible if d.index not in unusable]
    mine = assignment.get(local_rank)
    assigned = {i for i in assignment.values() if i is not None}
    order: list[int] = []

    def filler() -> Optional[int]:
        # a usable GPU not placed yet and not this rank's; GPUs no rank uses first
        rest = [i for i in usable if i not in order and i != mine]
        rest.sort(key=lambda i: i in assigned)
        return rest[0] if rest else None

    for lr in sorted(assignment):
        idx = mine if lr == local_rank else assignment[lr]
        if lr != local_rank and (idx is None or idx in unusable or idx in order or idx == mine):
            idx = filler()
        if idx is None:
            if lr <= local_rank:
                log.warning("local rank %d: not enough usable GPUs to keep cuda:%d its GPU; CUDA_VISIBLE_DEVICES "
                            "lists its GPU first", local_rank, local_rank)
                order = [mine] if mine is not None else []
            break
        order.append(idx)
    order += [i for i in usable if i not in order]
    return ",".join(by_index[i].token or str(i) for i in order)
