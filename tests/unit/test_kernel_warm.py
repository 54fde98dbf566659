"""A standby's kernel warm-up (agent/kernel_warm.py) runs the usual training kernels and touches nothing a
script could see - it may run beside the script the standby has just become: no draw from the default random
generators, the caller's grad mode and default dtype as they were. Run on CPU here (the same code as on a GPU)."""
from __future__ import annotations

import threading

import torch

from hyperpodrun.agent import kernel_warm


def test_the_warm_up_draws_nothing_from_the_default_generator_and_keeps_the_modes() -> None:
    torch.manual_seed(123)
    expected = torch.rand(8)                  # what the script's first draw would be
    torch.manual_seed(123)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)    # a script's choice, kept
    try:
        report = kernel_warm.warm(torch.device("cpu"))
        assert torch.is_grad_enabled() is False
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
    assert torch.equal(torch.rand(8), expected), "the warm-up drew from the default generator"
    assert report["dtypes"] == ["float32", "bfloat16", "float16"] and report["skipped"] == {}
    assert report["stopped"] is False and report["warm_s"] >= 0


def test_a_dtype_the_device_cannot_do_is_skipped_and_named() -> None:
    report = kernel_warm.warm(torch.device("cpu"), dtypes=("float32", "int8"))
    assert report["dtypes"] == ["float32"]
    assert "int8" in report["skipped"] and report["skipped"]["int8"]


def test_a_takeover_stops_the_warm_up_before_its_next_dtype() -> None:
    """The standby became a rank: its warm-up thread ends at the next dtype; the script's random numbers stay
    its own even while the thread runs beside it."""
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1                 # the rank dies during the first dtype
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(kernel_warm.warm(torch.device("cpu"), stop=stop)))
    worker.start()
    got = torch.rand(4)                       # the script, drawing while the warm-up runs
    worker.join(120)
    assert not worker.is_alive()
    assert result["stopped"] is True and result["dtypes"] == ["float32"]
    assert torch.equal(got, expected)
