"""Health checks run at every restart, after abort and finalize; a failed check replaces the process.

HPWrapper runs `CudaHealthCheck()` by default. A check that raises `HealthCheckError` makes the process exit
with EXIT_WORKER_UNHEALTHY (74); the agent then starts a fresh process for the rank (the other ranks keep
theirs), so a sticky CUDA error (illegal address, uncorrectable ECC, a device that no longer answers) costs
one process, not the job.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from hyperpodrun.errors import ApiValueError, HealthCheckError

log = logging.getLogger("hyperpodrun.runtime")


class CudaHealthCheck:
    """The device answers a synchronize within `timeout` seconds and carries no sticky error.

    Without CUDA (or before CUDA was initialised in this process) the check does not apply and passes. The
    device checked is the calling thread's current device (the rank's GPU), also from the probe thread that
    enforces the timeout (a new thread's current device would be GPU 0).
    """

    def __init__(self, timeout: float = 30.0) -> None:
        if timeout <= 0:
            raise ApiValueError(f"CudaHealthCheck(timeout={timeout}): the timeout must be positive seconds")
        self.timeout = timeout

    def __call__(self) -> None:
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_initialized() or not torch.cuda.is_available():
            log.debug("CudaHealthCheck: no CUDA in this process, not applicable")
            return
        try:
            device = torch.cuda.current_device()
        except Exception as exc:  # a sticky error can surface as early as this
            raise HealthCheckError(f"CUDA device is unhealthy: {exc}") from exc
        result: dict[str, Any] = {}

        def probe() -> None:
            try:
                torch.cuda.set_device(device)
                torch.cuda.synchronize(device)
                torch.zeros(1, device=f"cuda:{device}").add_(1).item()
                result["ok"] = True
            except Exception as exc:  # sticky errors surface here
                result["error"] = exc

        t = threading.Thread(target=probe, name="hyperpodrun-cuda-health", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            raise HealthCheckError(f"CUDA device {device} did not answer a synchronize within {self.timeout:g}s")
        if "error" in result:
            raise HealthCheckError(f"CUDA device {device} is unhealthy: {result['error']}")
