"""Tensor bytes to and from the host without numpy (not a dependency of hyperpodrun's runtime).

Why: `.numpy().tobytes()` fails where numpy is not installed ("Numpy is not available") and copies once
more; these helpers read a CPU tensor's bytes in place and land a device tensor's bytes in a bytearray with
one copy.
"""
from __future__ import annotations

import ctypes
from typing import Any

from hyperpodrun.errors import OutOfOrderError


def view(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place (valid while `t` lives and is not resized)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise OutOfOrderError("host_bytes.view needs a contiguous CPU tensor (a bug in hyperpodrun)")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def copy_out(t: Any) -> bytearray:
    """The bytes of a tensor (any device, uint8 or not) in a new bytearray: one copy."""
    import torch
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    out = bytearray(flat.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return out


def tensor(data: Any) -> Any:
    """A uint8 CPU tensor over a writable buffer (a bytearray), sharing its memory (empty buffers too)."""
    import torch
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)
