"""The NVML backend: the only module that calls pynvml (nvidia-ml-py), kept thin so the monitor's logic can be
tested with a fake backend on machines without a GPU.

pynvml is imported lazily: an agent on a machine without the NVIDIA driver never needs it. Every call here
releases the GIL while it runs (ctypes), so the monitor thread never stalls the agent's loop.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional, Protocol

from hyperpodrun.agent.health.gpu_map import DeviceInfo, normalize_pci
from hyperpodrun.errors import HyperpodrunError

log = logging.getLogger("hyperpodrun.agent")

NVML_FIX = ("run on a node with the NVIDIA driver (in a container: the NVIDIA container toolkit, e.g. "
            "`docker run --gpus all`) and nvidia-ml-py installed, or use --health-check auto (monitor where NVML "
            "loads) or --health-check none")


class NvmlUnavailable(HyperpodrunError):
    """NVML cannot be used on this machine (no library, no driver, no GPU); the message says why."""


class DeviceQueryError(HyperpodrunError):
    """An NVML query about one GPU failed. `lost`: NVML says the GPU is gone (NVML_ERROR_GPU_IS_LOST)."""

    def __init__(self, index: int, detail: str, lost: bool = False) -> None:
        super().__init__(f"GPU {index}: {detail}")
        self.index = index
        self.detail = detail
        self.lost = lost


class Backend(Protocol):
    """What the monitor needs from NVML. Queries return None where the GPU does not support them."""

    def devices(self) -> list[DeviceInfo]: ...
    def register_xid(self) -> list[int]: ...
    def wait_xid(self, timeout_s: float) -> Optional[tuple[int, int]]: ...
    def ecc_uncorrected(self, index: int) -> Optional[int]: ...
    def remap_state(self, index: int) -> Optional[tuple[bool, bool]]: ...
    def clock_event_reasons(self, index: int) -> Optional[int]: ...
    def close(self) -> None: ...


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """The real NVML, through pynvml. Construct with `load_nvml()`."""

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        self._handles: list[Any] = []
        self._by_addr: dict[Optional[int], int] = {}
        self._event_set: Any = None
        self._devices: list[DeviceInfo] = []
        self._missing: set[str] = set()     # NVML functions this driver lacks
        count = nvml.nvmlDeviceGetCount()
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            self._handles.append(h)
            self._by_addr[ctypes.cast(h, ctypes.c_void_p).value] = i
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            pci = normalize_pci(_text(nvml.nvmlDeviceGetPciInfo(h).busId))
            self._devices.append(DeviceInfo(index=i, uuid=uuid, pci_bus_id=pci,
                                            name=_text(nvml.nvmlDeviceGetName(h)), token=uuid))

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def _fail(self, index: int, exc: Exception) -> DeviceQueryError:
        code = getattr(exc, "value", None)
        return DeviceQueryError(index, str(exc), lost=code == self.nv.NVML_ERROR_GPU_IS_LOST)

    def _query(self, index: int, fn: Any, *args: Any) -> Any:
        """fn(handle, *args); None when the GPU does not support it; DeviceQueryError on other failures."""
        try:
            return fn(self._handles[index], *args)
        except self.nv.NVMLError as exc:
            if getattr(exc, "value", None) in (self.nv.NVML_ERROR_NOT_SUPPORTED, self.nv.NVML_ERROR_NO_PERMISSION,
                                               self.nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise self._fail(index, exc)

    def register_xid(self) -> list[int]:
        """Register every GPU that supports it for XID events; returns the indices registered."""
        nv = self.nv
        self._event_set = nv.nvmlEventSetCreate()
        done = []
        for i, h in enumerate(self._handles):
            try:
                if not nv.nvmlDeviceGetSupportedEventTypes(h) & nv.nvmlEventTypeXidCriticalError:
                    log.info("GPU %d does not report XID events; its other health signals are still polled", i)
                    continue
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                done.append(i)
            except nv.NVMLError as exc:
                log.warning("GPU %d: cannot register for XID events (%s)", i, exc)
        return done

    def wait_xid(self, timeout_s: float) -> Optional[tuple[int, int]]:
        """(GPU index, XID) of the next XID event, or None after `timeout_s`."""
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait(self._event_set, max(0, int(timeout_s * 1000)))
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_TIMEOUT:
                return None
            raise
        if not data.eventType & nv.nvmlEventTypeXidCriticalError:
            return None
        index = self._by_addr.get(ctypes.cast(data.device, ctypes.c_void_p).value)
        if index is None:
            index = int(nv.nvmlDeviceGetIndex(data.device))
        return index, int(data.eventData)

    def ecc_uncorrected(self, index: int) -> Optional[int]:
        nv = self.nv
        value = self._query(index, nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                            nv.NVML_VOLATILE_ECC)
        return None if value is None else int(value)

    def remap_state(self, index: int) -> Optional[tuple[bool, bool]]:
        """(remapping pending, remapping failed); None on GPUs without row remapping (before A100)."""
        value = self._query(index, self.nv.nvmlDeviceGetRemappedRows)
        return None if value is None else (bool(value[2]), bool(value[3]))

    def clock_event_reasons(self, index: int) -> Optional[int]:
        """nvmlClocksEventReason* bits; the older name (ThrottleReasons) where the driver or pynvml predates it."""
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(self.nv, name, None)
            if fn is None or name in self._missing:
                continue
            try:
                return int(fn(self._handles[index]))
            except self.nv.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == self.nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                    self._missing.add(name)
                    continue
                if code in (self.nv.NVML_ERROR_NOT_SUPPORTED, self.nv.NVML_ERROR_NO_PERMISSION):
                    return None
                raise self._fail(index, exc)
        return None

    def close(self) -> None:
        try:
            if self._event_set is not None:
                self.nv.nvmlEventSetFree(self._event_set)
                self._event_set = None
            self.nv.nvmlShutdown()
        except Exception as exc:  # shutting down: nothing to act on
            log.debug("NVML shutdown: %s", exc)


def load_nvml() -> PynvmlBackend:
    """Import pynvml, initialise NVML and read the GPUs; NvmlUnavailable (with the reason) otherwise."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"the nvidia-ml-py package is not installed ({exc}); pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        raise NvmlUnavailable(f"NVML did not initialise: {exc}")
    try:
        backend = PynvmlBackend(pynvml)
    except Exception as exc:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
        raise NvmlUnavailable(f"NVML could not list the GPUs: {exc}")
    if not backend.devices():
        backend.close()
        raise NvmlUnavailable("NVML works but this node has no GPU")
    return backend


def probe_nvml() -> Optional[str]:
    """Why NVML cannot be used here, or None when it can (used to validate --health-check nvml)."""
    try:
        load_nvml().close()
    except NvmlUnavailable as exc:
        return str(exc)
    return None
