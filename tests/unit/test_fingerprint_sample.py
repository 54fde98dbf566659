"""The GPU fingerprint's sample of large tensors (hyperpodrun/state/fingerprint.py): what it sees and what it
is documented to miss. Run on host tensors through the same function the GPU path calls."""
from __future__ import annotations

import torch

from hyperpodrun.state import fingerprint as fp


def _print(ts: list) -> list:
    return fp._device_print(ts, ts[0].dtype)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _weights(dtype: torch.dtype = torch.bfloat16) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1024, 1100, generator=g).to(dtype), torch.randn(3000, 500, generator=g).to(dtype)]


def test_the_same_values_match_bit_for_bit_and_nans_that_stay_nans_match() -> None:
    ts = _weights()
    ts[0][0, 0] = float("nan")
    assert _same(_print(ts), _print([t.clone() for t in ts]))


def test_a_row_a_column_a_whole_tensor_and_a_sampled_element_are_seen() -> None:
    def changed(edit) -> bool:
        ts = _weights()
        before = _print(ts)
        edit(ts)
        return not _same(before, _print(ts))
    assert changed(lambda ts: ts[0][7].add_(1))                 # a row of width >= 251
    assert changed(lambda ts: ts[1][:, 3].mul_(2))              # a column of >= 251 rows
    assert changed(lambda ts: ts[0].data.mul_(0.5))             # the whole tensor, through .data
    assert changed(lambda ts: ts[1].view(-1)[5 * fp.STRIDE].add_(1))    # one sampled element
    # a chunk of a fused optimizer (65,536 elements) updated, the rest not: an optimizer step cut short
    assert changed(lambda ts: ts[1].view(-1)[65536:131072].add_(1e-2))


def test_what_it_is_documented_to_miss_a_single_unsampled_element() -> None:
    ts = _weights()
    before = _print(ts)
    ts[0].view(-1)[1].add_(1)          # between two sampled elements
    assert _same(before, _print(ts))


def test_small_tensors_are_normed_in_full_and_large_ones_sampled(monkeypatch) -> None:
    monkeypatch.setattr(fp, "SAMPLE_ABOVE", 1000)
    small, large = torch.randn(10, 10), torch.randn(50, 50)
    norms, sample = fp._device_print([small, large], torch.float32)
    assert norms.dtype == torch.float64 and norms.shape == (1,)
    assert sample.dtype == torch.int32 and sample.numel() == (2500 + fp.STRIDE - 1) // fp.STRIDE
    before = fp._device_print([small, large], torch.float32)
    small.view(-1)[1].add_(1)      # a single element of a small tensor: its norm moves
    assert not torch.equal(before[0], fp._device_print([small, large], torch.float32)[0])
