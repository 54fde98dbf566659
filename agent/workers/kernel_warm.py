"""Run, once and small, the GPU kernels a training script's top and first steps use, in a standby.

Why: CUDA loads a kernel lazily, the first time it is launched (CUDA_MODULE_LOADING=LAZY, torch's default),
and so does cuBLAS its handle and workspace. A standby that has only made its CUDA context pays all of that
after the fault, while the script it becomes builds its model (random init, casts) and runs its first steps
(matmuls forward and backward, activations, norms, attention, losses, the optimizer). Loading them here,
ahead of the fault, moves that time out of recovery; the tensors are tiny (64 x 64; attention 1 x 2 heads x
256 tokens with head dims 64 and 128), so the GPU memory a standby holds stays its context plus cuBLAS's
workspace (measured in scripts/bench/gpu/gpu_standby_warm.py).

What runs, per dtype (fp32, bf16, fp16), in STEPS: the init kernels (nn.init, randn/rand/randint); a small
transformer block's pieces forward and backward (embedding, linear, layer_norm, rms_norm, gelu/silu/relu,
softmax, batched matmuls, scaled_dot_product_attention causal and not, rotary-style elementwise ops,
cross_entropy in the dtype and upcast to fp32); the optimizers' steps (Adam, AdamW, SGD; Adam and AdamW
fused=True on CUDA); then every cast between the dtypes.

It runs in a thread of the standby's own, after the standby reported ready (zygote.stand_by), so that a
rank dying meanwhile is taken over at once; the script the standby becomes may then run beside its tail
(`stop` is asked before every step and ends it there). So it touches nothing the script could see: random
numbers come from a private generator only (modules are made without their default init, `skip_init`, and
nothing that draws from the default generator, such as dropout, is run), grad mode is set per thread, the
default dtype is never set, and the cache is emptied only when it ran to its end. The loaded kernels (and
cuBLAS's handle, back in torch's pool when the thread ends) are the only lasting effect.

Written for any device torch runs on (`warm(torch.device("cpu"))` runs the same code on CPU, which is how it
is tested on a machine without a GPU).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: the side of the warm-up's square tensors: big enough to take the same kernels as a real layer (cuBLAS
#: picks its algorithms by shape; 64 is a common tile multiple), small enough to cost no memory
SIDE = 64
#: attention head dims warmed: the usual ones (attention kernels are built per head dim: flash and
#: memory-efficient attention pick a kernel by it)
HEAD_DIMS = (64, 128)
#: heads and tokens of the warm-up's attention (batch 1): 256 tokens, a multiple of every block size of flash
#: attention's kernels, as a real sequence length is (a length that is not takes other kernels of theirs)
HEADS = 2
TOKENS = 256


def warm(device: Any, dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
         stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Launch the usual init, cast, elementwise, norm, attention, matmul, loss and optimizer kernels on
    `device` for each dtype of `dtypes` it supports (STEPS), then synchronise and empty the cache. `stop()`
    is asked before each step: True ends the warm-up there (the standby became a rank). Returns
    {"warm_s": seconds, "dtypes": [those warmed in full], "skipped": {dtype: "step: reason; ..."},
    "stopped": bool}; never raises for one step's failure (an old GPU without bfloat16 matmuls, or without
    one attention kernel, still warms the rest)."""
    import torch
    t0 = time.monotonic()
    dev = torch.device(device)
    done: list[str] = []
    usable: list[str] = []          # dtypes at least one step ran in: the casts between them are warmed
    skipped: dict[str, str] = {}
    stopped = False
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for name in dtypes:
        failed: list[str] = []
        ran = 0
        for step, run in STEPS:
            if stop():
                stopped = True
                break
            try:
                with torch.enable_grad():        # per thread: the script's grad mode is its own
                    run(torch, dev, getattr(torch, name), gen)
                ran += 1
            except Exception as exc:   # not for this device or dtype: the other steps are still worth warming
                failed.append(f"{step}: {type(exc).__name__}: {exc}")
        if failed:
            skipped[name] = "; ".join(failed)[:200]
        if ran:
            usable.append(name)
        if stopped:
            break
        if not failed:
            done.append(name)
    if not stopped and not stop():
        _casts(torch, dev, tuple(usable))
        _synchronize(torch, dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    else:
        stopped = True
    return {"warm_s": round(time.monotonic() - t0, 3), "dtypes": done, "skipped": skipped, "stopped": stopped}


def _synchronize(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rand(torch: Any, dev: Any, dtype: Any, gen: Any, *shape: int) -> Any:
    """A tensor of normal numbers from the private generator, made a leaf that takes a gradient."""
    return torch.randn(*shape, device=dev, dtype=dtype, generator=gen).requires_grad_()


def _init(torch: Any, dev: Any, dtype: Any, gen: Any) -> None:
    """What nn.init and the layers' reset_parameters launch (on the device: `with device:` model builds)."""
    nn, n = torch.nn, SIDE
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


def _network(torch: Any, dev: Any, dtype: Any, gen: Any) -> None:
    """A small network forward and backward: embedding, linear layers, layer_norm and rms_norm (with and
    without weights), the usual activations, softmax, the losses (cross_entropy in the dtype and upcast to
    fp32, as most training loops compute it, with ignored labels), gradient clipping, a device->host read."""
    nn, F, n = torch.nn, torch.nn.functional, SIDE
    skip = nn.utils.skip_init          # made without their default init: that would draw from the default RNG
    emb = skip(nn.Embedding, n, n, device=dev, dtype=dtype)
    lin1 = skip(nn.Linear, n, n, device=dev, dtype=dtype)
    lin2 = skip(nn.Linear, n, n, device=dev, dtype=dtype)
    norm = skip(nn.LayerNorm, n, device=dev, dtype=dtype)
    params = [*emb.parameters(), *lin1.parameters(), *lin2.parameters(), *norm.parameters()]
    scale = _rand(torch, dev, dtype, gen, n)
    with torch.no_grad():
        for p in params:
            nn.init.normal_(p, 0.0, 0.02, generator=gen)
    ids = torch.randint(0, n, (n,), device=dev, generator=gen)
    x = emb(ids)
    h = lin1(norm(x) + F.layer_norm(x, (n,)))
    acts = [F.gelu(h), F.gelu(h, approximate="tanh"), F.relu(h), F.silu(h), torch.tanh(h), torch.sigmoid(h)]
    h = sum(acts[1:], acts[0])
    if hasattr(F, "rms_norm"):     # torch >= 2.4
        h = F.rms_norm(h, (n,)) + F.rms_norm(h, (n,), scale)
    out = lin2(h)
    logits = torch.softmax(out, dim=-1) + F.log_softmax(out, dim=-1)
    labels = ids.clone()
    labels[0] = -100               # a padded position: cross_entropy's ignore_index
    loss = (F.cross_entropy(out, ids) + F.cross_entropy(out.float(), labels) + F.mse_loss(logits, x)
            + out.float().pow(2).mean())
    loss.backward()
    torch.nn.utils.clip_grad_norm_([*params, scale], 1.0)
    (torch.cat([x, h]).sum() + torch.stack([x, h]).amax() + x.abs().max()).item()   # a device->host read


def _attention(torch: Any, dev: Any, dtype: Any, gen: Any, d: int) -> None:
    """Attention forward and backward at head dim `d` (a step per dim of HEAD_DIMS: the warm-up stops only
    between steps, and a short step is a short tail beside the script after a takeover; loading attention's
    kernels takes about 0.3 s a dim in bf16 on an H200): scaled_dot_product_attention causal and
    not (flash, memory-efficient or cuDNN attention: whichever torch picks for the device and dtype), the
    same written out (batched matmuls, a causal mask, softmax) as models without SDPA do, and rotary
    embeddings' elementwise ops. cuDNN attention also builds a plan per shape at its first call, which no
    warm-up can do ahead of the script's shapes; its library and the other backends' kernels are loaded."""
    F = torch.nn.functional
    q, k, v = (_rand(torch, dev, dtype, gen, 1, HEADS, TOKENS, d) for _ in range(3))
    half = d // 2
    angle = torch.arange(TOKENS, device=dev, dtype=torch.float32)[:, None] * torch.ones(half, device=dev,
                                                                                        dtype=torch.float32)
    cos, sin = torch.cat([angle, angle], -1).cos().to(dtype), torch.cat([angle, angle], -1).sin().to(dtype)
    rq = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
    outs = [F.scaled_dot_product_attention(rq, k, v, is_causal=causal) for causal in (False, True)]
    mask = torch.ones(TOKENS, TOKENS, device=dev, dtype=torch.bool).triu(1)
    scores = (rq @ k.transpose(-2, -1)) * d ** -0.5
    outs.append(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v)
    sum(o.float().sum() for o in outs).backward()


def _optimizers(torch: Any, dev: Any, dtype: Any, gen: Any) -> None:
    """The optimizers' kernels: the foreach path (torch's default on CUDA), and on CUDA the fused one, of
    Adam, AdamW and SGD with momentum; two steps each (the first makes the state, the second takes the
    steady-state kernels)."""
    params = [_rand(torch, dev, dtype, gen, SIDE, SIDE), _rand(torch, dev, dtype, gen, SIDE)]
    for p in params:
        p.grad = torch.ones_like(p)
    makers: list[Callable[[list[Any]], Any]] = [
        lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3),
        lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)]
    for make in makers:
        opt = make(params)
        opt.step()
        opt.step()
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


#: one dtype's warm-up, in order: (name, step); `stop()` is asked before each
STEPS: tuple[tuple[str, Callable[[Any, Any, Any, Any], None]], ...] = (
    ("init", _init), ("network", _network),
    *((f"attention{d}", functools.partial(_attention, d=d)) for d in HEAD_DIMS),
    ("optimizers", _optimizers))


def _casts(torch: Any, dev: Any, dtypes: tuple[str, ...]) -> None:
    """Every cast between the dtypes (model.to(torch.bfloat16) after an fp32 init, autocast's copies)."""
    for a in dtypes:
        x = torch.ones(SIDE, SIDE, device=dev, dtype=getattr(torch, a))
        for b in dtypes:
            if a != b:
                x.to(getattr(torch, b))
