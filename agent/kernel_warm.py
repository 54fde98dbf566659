"""Run, once and small, the GPU kernels a training script's top and first steps use, in a standby.

Why: CUDA loads a kernel lazily, the first time it is launched (CUDA_MODULE_LOADING=LAZY, torch's default),
and so does cuBLAS its handle and workspace. A standby that has only made its CUDA context pays all of that
after the fault, while the script it becomes builds its model (random init, casts) and runs its first steps
(matmuls forward and backward, activations, losses, the optimizer). Loading them here, ahead of the fault,
moves that time out of recovery; the tensors are tiny (64 x 64), so the GPU memory a standby holds stays
its context plus cuBLAS's workspace (measured in scripts/bench/gpu_standby_warm.py).

It runs in a thread of the standby's own, after the standby reported ready (zygote.stand_by), so that a
rank dying meanwhile is taken over at once; the script the standby becomes may then run beside its tail
(`stop` ends it between steps). So it touches nothing the script could see: random numbers come from a
private generator only (modules are made without their default init, `skip_init`), grad mode is set per
thread, the default dtype is never set, and the cache is emptied only when it ran to its end. The loaded
kernels (and cuBLAS's handle, back in torch's pool when the thread ends) are the only lasting effect.

Written for any device torch runs on (`warm(torch.device("cpu"))` runs the same code on CPU, which is how it
is tested on a machine without a GPU).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: the side of the warm-up's square tensors: big enough to take the same kernels as a real layer (cuBLAS
#: picks its algorithms by shape; 64 is a common tile multiple), small enough to cost no memory
SIDE = 64


def warm(device: Any, dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
         stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Launch the usual init, cast, elementwise, reduction, matmul, loss and optimizer kernels on `device`
    for each dtype of `dtypes` it supports, then synchronise and empty the cache. `stop()` is asked before
    each dtype: True ends the warm-up there (the standby became a rank). Returns {"warm_s": seconds,
    "dtypes": [those warmed], "skipped": {dtype: reason}, "stopped": bool}; never raises for one dtype's
    failure (an old GPU without bfloat16 matmuls still warms the rest)."""
    import torch
    t0 = time.monotonic()
    dev = torch.device(device)
    done: list[str] = []
    skipped: dict[str, str] = {}
    stopped = False
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for name in dtypes:
        if stop():
            stopped = True
            break
        try:
            with torch.enable_grad():
                _one_dtype(torch, dev, getattr(torch, name), gen)
            done.append(name)
        except Exception as exc:     # a dtype this device cannot do: the others are still worth warming
            skipped[name] = f"{type(exc).__name__}: {exc}"[:200]
    if not stopped:
        _casts(torch, dev, tuple(done))
        _synchronize(torch, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"warm_s": round(time.monotonic() - t0, 3), "dtypes": done, "skipped": skipped, "stopped": stopped}


def _synchronize(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _one_dtype(torch: Any, dev: Any, dtype: Any, gen: Any) -> None:
    """A model's build, a few forward/backward passes and optimizer steps in `dtype`, tiny."""
    nn, F = torch.nn, torch.nn.functional
    n = SIDE
    # what nn.init and the layers' reset_parameters launch (on the device: `with device:` model builds)
    w = torch.empty(n, n, device=dev, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=5 ** 0.5, generator=gen)
    nn.init.xavier_uniform_(w, generator=gen)
    nn.init.normal_(w, 0.0, 0.02, generator=gen)
    nn.init.trunc_normal_(w, std=0.02, generator=gen)
    nn.init.uniform_(w, -0.1, 0.1, generator=gen)
    nn.init.ones_(w)
    nn.init.zeros_(w)
    w.fill_(0.5)
    torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    torch.rand(n, n, device=dev, dtype=dtype, generator=gen)
    torch.randint(0, n, (n,), device=dev, generator=gen)
    torch.arange(n, device=dev)
    # a small network: embedding, linear layers, the usual activations and norms, forward and backward
    skip = nn.utils.skip_init          # made without their default init: that would draw from the default RNG
    emb = skip(nn.Embedding, n, n, device=dev, dtype=dtype)
    lin1 = skip(nn.Linear, n, n, device=dev, dtype=dtype)
    lin2 = skip(nn.Linear, n, n, device=dev, dtype=dtype)
    norm = skip(nn.LayerNorm, n, device=dev, dtype=dtype)
    params = [*emb.parameters(), *lin1.parameters(), *lin2.parameters(), *norm.parameters()]
    with torch.no_grad():
        for p in params:
            nn.init.normal_(p, 0.0, 0.02, generator=gen)
    ids = torch.randint(0, n, (n,), device=dev, generator=gen)
    x = emb(ids)
    h = lin1(norm(x))
    acts = [F.gelu(h), F.gelu(h, approximate="tanh"), F.relu(h), F.silu(h), torch.tanh(h), torch.sigmoid(h)]
    h = sum(acts[1:], acts[0])
    out = lin2(F.rms_norm(h, (n,)) if hasattr(F, "rms_norm") else h)
    logits = torch.softmax(out, dim=-1) + F.log_softmax(out, dim=-1)
    loss = F.cross_entropy(out, ids) + F.mse_loss(logits, x) + out.float().pow(2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    (torch.cat([x, h]).sum() + torch.stack([x, h]).amax() + x.abs().max()).item()   # a device->host read
    # the optimizers' kernels: the foreach path (torch's default on CUDA) and the fused one, Adam and AdamW
    for make in (lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3),
                 lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)):
        opt = make(params)
        opt.step()
        opt.step()        # the second step takes the steady-state kernels (the first one makes the state)
        opt.zero_grad(set_to_none=False)
    if dev.type == "cuda":
        for fused in (torch.optim.Adam, torch.optim.AdamW):
            try:
                opt = fused(params, lr=1e-3, fused=True)
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                opt.step()
            except (RuntimeError, TypeError):   # fused needs floating point params of a supported dtype
                pass


def _casts(torch: Any, dev: Any, dtypes: tuple[str, ...]) -> None:
    """Every cast between the dtypes (model.to(torch.bfloat16) after an fp32 init, autocast's copies)."""
    for a in dtypes:
        x = torch.ones(SIDE, SIDE, device=dev, dtype=getattr(torch, a))
        for b in dtypes:
            if a != b:
                x.to(getattr(torch, b))
