"""A standby's kernel warm-up (agent/workers/kernel_warm.py) runs the usual training kernels - a transformer's too:
attention, norms, embedding, losses, the optimizers - and touches nothing a script could see: it may run
beside the script the standby has just become, so no draw from the default random generators, the caller's
grad mode and default dtype as they were, and it stops between steps when told to. Run on CPU here (the
same code as on a GPU)."""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

import pytest
import torch

from hyperpodrun.agent.workers import kernel_warm

DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_warm_up_draws_nothing_from_the_default_generator_and_keeps_the_modes(grad: bool) -> None:
    torch.manual_seed(123)
    expected = torch.rand(8)                  # what the script's first draw would be
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(torch.float64)    # a script's choice, kept
    try:
        report = kernel_warm.warm(torch.device("cpu"))
        assert torch.is_grad_enabled() is grad
        assert torch.get_default_dtype() == torch.float64
        assert torch.equal(torch.get_rng_state(), rng), "the warm-up moved the default generator"
    finally:
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
    assert torch.equal(torch.rand(8), expected), "the warm-up drew from the default generator"
    assert report["dtypes"] == DTYPES and report["skipped"] == {}
    assert report["stopped"] is False and report["warm_s"] >= 0


def test_it_runs_the_usual_transformer_kernels_in_every_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention (causal and not, head dims 64 and 128, with a graph to run backward), layer_norm, rms_norm,
    embedding, cross_entropy, gelu, silu and softmax are each launched in each dtype."""
    F = torch.nn.functional
    seen: dict[str, set[Any]] = defaultdict(set)

    def spy(owner: Any, name: str, key: Callable[..., Any]) -> None:
        real = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            seen[name].add(key(out, *args, **kwargs))
            return out
        monkeypatch.setattr(owner, name, call)

    spy(F, "scaled_dot_product_attention", lambda out, q, *a, is_causal=False, **k:
        (str(q.dtype), q.shape[-1], is_causal, out.requires_grad))
    for name in ("layer_norm", "rms_norm", "embedding", "cross_entropy", "gelu", "silu"):
        spy(F, name, lambda out, *a, **k: (str(out.dtype), out.requires_grad))
    spy(torch, "softmax", lambda out, *a, **k: (str(out.dtype), out.requires_grad))

    report = kernel_warm.warm(torch.device("cpu"))
    assert report["dtypes"] == DTYPES, report
    every = {f"torch.{d}" for d in DTYPES}
    assert seen["scaled_dot_product_attention"] == {(d, hd, causal, True) for d in every
                                                    for hd in kernel_warm.HEAD_DIMS for causal in (False, True)}
    assert set(kernel_warm.HEAD_DIMS) == {64, 128}
    for name in ("layer_norm", "rms_norm", "embedding", "gelu", "silu", "softmax"):
        assert {(d, True) for d in every} <= seen[name], (name, seen[name])
    # cross_entropy in the dtype and upcast to fp32, with a graph (backward) each time
    assert {(d, True) for d in every} | {("torch.float32", True)} <= seen["cross_entropy"]


def test_a_dtype_the_device_cannot_do_is_skipped_and_named() -> None:
    report = kernel_warm.warm(torch.device("cpu"), dtypes=("float32", "int8"))
    assert report["dtypes"] == ["float32"]
    assert "int8" in report["skipped"] and report["skipped"]["int8"].startswith("init: ")


def _fake_steps(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str]], failing: str = "") -> None:
    """kernel_warm.STEPS replaced by steps that record (step, dtype); `failing` raises."""
    def step(name: str) -> Callable[[Any, Any, Any, Any], None]:
        def run(torch_: Any, dev: Any, dtype: Any, gen: Any) -> None:
            calls.append((name, str(dtype)))
            if name == failing:
                raise RuntimeError("no such kernel here")
        return run
    monkeypatch.setattr(kernel_warm, "STEPS", tuple((n, step(n)) for n in ("a", "b", "c")))


def test_a_failing_step_is_named_and_the_other_steps_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    _fake_steps(monkeypatch, calls, failing="b")
    report = kernel_warm.warm(torch.device("cpu"), dtypes=("float32", "bfloat16"))
    assert [c[0] for c in calls] == ["a", "b", "c", "a", "b", "c"]
    assert report["dtypes"] == [] and report["stopped"] is False
    assert report["skipped"] == {d: "b: RuntimeError: no such kernel here" for d in ("float32", "bfloat16")}


def test_stop_is_asked_before_every_step_and_ends_the_warm_up_there(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    _fake_steps(monkeypatch, calls)
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 4             # the first dtype's 3 steps and the second's first, then a takeover
    report = kernel_warm.warm(torch.device("cpu"), stop=stop)
    assert calls == [("a", "torch.float32"), ("b", "torch.float32"), ("c", "torch.float32"), ("a", "torch.bfloat16")]
    assert report["stopped"] is True and report["dtypes"] == ["float32"], "bfloat16 was not warmed in full"
    assert len(asked) == 5


def test_a_takeover_stops_the_warm_up_at_its_next_step() -> None:
    """The standby became a rank: its warm-up thread ends at the next step; the script's random numbers stay
    its own even while the thread runs beside it."""
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > len(kernel_warm.STEPS)   # the rank dies during the first dtype's last step
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
    assert len(asked) == len(kernel_warm.STEPS) + 1
    assert torch.equal(got, expected)
