"""A standby's kernel warm-up (agent/kernel_warm.py) runs the usual training kernels and leaves nothing else
behind: the script the standby becomes draws the same random numbers, builds its model in the same grad mode
and default dtype, as it would in a fresh process. Run on CPU here (the same code as on a GPU)."""
from __future__ import annotations

import torch

from hyperpodrun.agent import kernel_warm


def test_the_warm_up_leaves_the_random_state_and_the_modes_as_they_were() -> None:
    torch.manual_seed(123)
    expected = torch.rand(8)                  # what the script's first draw would be
    torch.manual_seed(123)
    torch.set_grad_enabled(False)
    try:
        report = kernel_warm.warm(torch.device("cpu"))
        assert torch.is_grad_enabled() is False
    finally:
        torch.set_grad_enabled(True)
    assert torch.equal(torch.rand(8), expected)
    assert torch.get_default_dtype() == torch.float32
    assert report["dtypes"] == ["float32", "bfloat16", "float16"] and report["skipped"] == {}
    assert report["warm_s"] >= 0


def test_a_dtype_the_device_cannot_do_is_skipped_and_named() -> None:
    report = kernel_warm.warm(torch.device("cpu"), dtypes=("float32", "int8"))
    assert report["dtypes"] == ["float32"]
    assert "int8" in report["skipped"] and report["skipped"]["int8"]
