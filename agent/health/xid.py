"""What a GPU event means for the job: the XID table and the policy for NVML's other health signals.

Every event the NVML monitor (agent/health/nvml_monitor.py) or a fault injection produces is a `GpuEvent`;
`classify` turns it into a `Verdict` whose action is one of:

  GPU   the GPU is unusable until it is reset or replaced: the rank on it is a faulty rank and may not come
        back on it; it moves to a spare GPU of the node, or the node exits 76 (EXIT_NO_USABLE_GPU)
  RANK  the process that uses the GPU must be replaced, the GPU itself stays usable (e.g. a contained ECC
        error: only the application that touched the bad memory is affected)
  WARN  logged (warning) and counted; no action
  INFO  logged and counted; no action

Sources for the XID table: NVIDIA's XID catalog, "XID Errors" in the NVIDIA GPU deployment and management
documentation (https://docs.nvidia.com/deploy/xid-errors/index.html, including its "Xid catalog" with the
recommended resolution per XID), and the row-remapping / dynamic page retirement chapters of the same
documentation (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/index.html). XIDs that the catalog
attributes to the application (illegal addresses, exceptions it caused) are not acted on here: the CUDA
error reaches the process itself, which reports a FAULT (in-process restart) and, if the error is sticky,
fails its health check and is replaced (hyperpodrun/runtime/health.py).

An XID not in the table is logged as a warning ("unclassified") and counted, never acted on: killing a
healthy rank for an event we do not understand costs more than missing one the driver will escalate anyway
(a GPU that really is gone stops answering NVML and is caught as `lost`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GPU, RANK, WARN, INFO = "gpu", "rank", "warn", "info"

#: XID -> (action, what it is). See the module docstring for the sources.
XID_TABLE: dict[int, tuple[str, str]] = {
    # caused by the application: the process sees the CUDA error itself
    13: (WARN, "graphics engine exception (usually an application error: out-of-range access, illegal instruction)"),
    31: (WARN, "GPU memory page fault (usually an application error: illegal address)"),
    43: (WARN, "GPU stopped processing (the application hit a fault; the GPU is fine)"),
    45: (WARN, "preemptive cleanup after previous errors (a context was torn down)"),
    68: (WARN, "video decoder (NVDEC) exception"),
    69: (WARN, "graphics engine class error (usually an application error)"),
    # memory: single-bit / contained errors keep the GPU usable
    63: (WARN, "ECC page retirement or row remapping recorded (takes effect at the next GPU reset)"),
    92: (WARN, "high single-bit ECC error rate"),
    94: (RANK, "contained ECC error (only the application that touched the memory is affected: restart it)"),
    # the GPU needs a reset (or replacement) before it can be trusted again
    48: (GPU, "double-bit ECC error (DBE)"),
    61: (GPU, "internal micro-controller breakpoint/warning"),
    62: (GPU, "internal micro-controller halt"),
    64: (GPU, "ECC page retirement or row remapping recording failure"),
    74: (GPU, "NVLink error"),
    79: (GPU, "GPU has fallen off the bus"),
    95: (GPU, "uncontained ECC error (every application on the GPU is affected; GPU reset required)"),
    119: (GPU, "GSP RPC timeout"),
    120: (GPU, "GSP error"),
}

# nvmlClocksEventReason* bits (nvml.h); the others (idle, application clocks, sync boost, display) are normal
THROTTLE_THERMAL = {0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                    0x08: "hardware slowdown (thermal or power brake)"}
THROTTLE_POWER_BRAKE = {0x80: "hardware power brake slowdown"}
#: the GPU runs at its power limit: normal under full load, so only INFO
THROTTLE_POWER_CAP = {0x04: "software power cap"}
#: every reason bit the monitor reports
THROTTLE_MASK = sum({**THROTTLE_THERMAL, **THROTTLE_POWER_BRAKE, **THROTTLE_POWER_CAP})


@dataclass(frozen=True)
class GpuEvent:
    """One observation about one GPU (by its index in the node's inventory, see agent/health/gpu_map.py).

    kind: xid | lost | ecc | remap_pending | remap_failure | ecc_at_start | throttle | monitor_error
    """

    kind: str
    device: Optional[int]
    xid: Optional[int] = None
    count: Optional[int] = None        # ecc: new uncorrectable errors; throttle: the reason bits
    detail: str = ""
    synthetic: bool = False            # injected (`hyperpodrun inject`), not read from NVML


@dataclass(frozen=True)
class Verdict:
    action: str                        # GPU | RANK | WARN | INFO
    what: str                          # human description, used in the event log


def classify_xid(xid: int) -> Verdict:
    """The table's verdict for an XID; unknown XIDs are WARN (logged, counted, not acted on)."""
    action, what = XID_TABLE.get(int(xid), (WARN, "unclassified XID (not in hyperpodrun's table: not acted on)"))
    return Verdict(action, f"XID {xid}: {what}")


def throttle_reasons(bits: int) -> tuple[str, list[str]]:
    """(WARN or INFO, names) for a clocks-event-reasons bit mask; INFO with no names when nothing matters."""
    warn = [name for bit, name in {**THROTTLE_THERMAL, **THROTTLE_POWER_BRAKE}.items() if bits & bit]
    info = [name for bit, name in THROTTLE_POWER_CAP.items() if bits & bit]
    return (WARN, warn + info) if warn else (INFO, info)


def classify(ev: GpuEvent) -> Verdict:
    """The action for any GPU event (see the module docstring)."""
    if ev.kind == "xid":
        assert ev.xid is not None
        return classify_xid(ev.xid)
    if ev.kind == "lost":
        return Verdict(GPU, f"GPU stopped answering NVML ({ev.detail or 'GPU is lost'})")
    if ev.kind == "ecc":
        # an uncorrectable (double-bit) error during the job: as XID 48, the GPU needs a reset (DCGM's health
        # watch treats a volatile DBE the same way)
        return Verdict(GPU, f"{ev.count} new uncorrectable ECC error(s) (volatile counter)")
    if ev.kind == "remap_failure":
        return Verdict(GPU, "row remapping failed (no spare rows left: the GPU should be replaced)")
    if ev.kind == "remap_pending":
        return Verdict(WARN, "row remapping pending (takes effect at the next GPU reset; drain the node when "
                             "convenient)")
    if ev.kind == "ecc_at_start":
        return Verdict(WARN, f"{ev.count} uncorrectable ECC error(s) since the driver loaded (before this job)")
    if ev.kind == "throttle":
        level, names = throttle_reasons(ev.count or 0)
        return Verdict(level, "clocks throttled: " + (", ".join(names) or "no reason that matters"))
    if ev.kind == "monitor_error":
        return Verdict(WARN, f"NVML monitor error: {ev.detail}")
    return Verdict(WARN, f"unknown GPU event {ev.kind!r}")
