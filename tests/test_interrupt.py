"""The restart interrupt never splits an optimizer step: it lands before the step or right after it."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hyperpodrun.runtime.interrupt import Interrupter, RestartInterrupt


class SlowSGD(torch.optim.Optimizer):
    """An optimizer whose step is long Python code: an interrupt could land in the middle of it."""

    def __init__(self, params, started: threading.Event):
        super().__init__(params, {"lr": 1.0})
        self.started = started

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                p.add_(1.0)
                if i == 0:
                    self.started.set()
                deadline = time.monotonic() + 0.05
                while time.monotonic() < deadline:   # Python bytecode: async exceptions can land here
                    pass


def test_interrupt_during_optimizer_step_waits_for_the_step_to_finish():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(5)]
    started = threading.Event()
    opt = SlowSGD(params, started)
    intr = Interrupter()
    intr.install_optimizer_hooks()
    intr.enter_fn(0)

    def restart_when_step_runs():
        assert started.wait(10)
        intr.request(1)

    t = threading.Thread(target=restart_when_step_runs)
    t.start()
    with pytest.raises(RestartInterrupt):
        try:
            opt.step()
            # the interrupt must come out of the step's post hook, not later Python code
            pytest.fail("optimizer.step returned although a restart was requested during it")
        finally:
            intr.leave_fn()
    t.join()
    assert all(torch.equal(p, torch.ones(3)) for p in params), "the optimizer step was left half-done"


def test_interrupt_outside_a_step_lands_in_python_code():
    intr = Interrupter()
    intr.enter_fn(0)
    threading.Timer(0.05, intr.request, args=(1,)).start()
    deadline = time.monotonic() + 10
    with pytest.raises(RestartInterrupt):
        try:
            while time.monotonic() < deadline:
                pass
        finally:
            intr.leave_fn()
    assert time.monotonic() < deadline, "the loop was not interrupted"


def test_restart_requested_before_entry_raises_at_entry():
    intr = Interrupter()
    intr.request(3)
    with pytest.raises(RestartInterrupt):
        intr.enter_fn(2)
    intr.enter_fn(3)   # the generation it asked for: no interrupt
    intr.leave_fn()
