"""Health checks run at every restart, after abort and finalize; a failed check replaces the process."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("hyperpodrun.runtime")


class HealthCheckError(RuntimeError):
    """This process cannot continue (e.g. a sticky CUDA error): the agent must replace it."""


class CudaHealthCheck:
    """The device answers a synchronize within `timeout` seconds and carries no sticky error.

    Without CUDA (or before CUDA was initialised in this process) the check does not apply and passes.
    """

    def __init__(self, timeout: float = 30.0) -> None:
        if timeout <= 0:
            raise ValueError(f"CudaHealthCheck(timeout={timeout}): the timeout must be positive seconds")
        self.timeout = timeout

    def __call__(self) -> None:
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            log.debug("CudaHealthCheck: no CUDA in this process, not applicable")
            return
        result: dict = {}

        def probe() -> None:
            try:
                torch.cuda.synchronize()
                torch.zeros(1, device="cuda").add_(1).item()
                result["ok"] = True
            except Exception as exc:  # sticky errors surface here
                result["error"] = exc

        t = threading.Thread(target=probe, name="hyperpodrun-cuda-health", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            raise HealthCheckError(f"CUDA device did not answer a synchronize within {self.timeout:g}s")
        if "error" in result:
            raise HealthCheckError(f"CUDA device is unhealthy: {result['error']}")
