"""Keep DDP's gradient-bucket layout identical across in-process re-entries.

Why: with three or more ranks the bits of an all-reduced gradient depend on where each gradient sits in
the flattened bucket (the ring splits the buffer into chunks, and each chunk is summed in a different rank
order). DDP runs its first iteration with one initial layout and then rebuilds its buckets in the order
the gradients became ready. A DDP built again after a restart would run its first step with the initial
layout while the fault-free run was already using the rebuilt one - and the parameters drift apart.

What: `capture` reads the rebuilt layout of a DDP module (forcing the pending rebuild that DDP would do
at the start of the next forward, so the layout is known from step 1 on); `apply` gives a newly built DDP
that layout before its first step. The next rebuild then reproduces the same layout (the ready order is
deterministic), so every step uses the buckets the fault-free run used.

This reaches into DDP internals (`_ddp_init_helper`, the reducer's buckets), which are checked for before
use: where they are missing, `apply` logs a warning naming the consequence and leaves DDP as built.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger("hyperpodrun.runtime")

Layout = list[list[int]]


def is_ddp(obj: Any) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return False
    return isinstance(obj, DistributedDataParallel)


def _supported(ddp: Any) -> bool:
    import torch.distributed as dist
    return all(hasattr(ddp, a) for a in ("reducer", "_ddp_init_helper", "_build_params_for_reducer",
                                         "_build_debug_param_to_name_mapping")) \
        and hasattr(ddp.reducer, "_get_zeros_like_grad_buckets") and hasattr(ddp.reducer, "_rebuild_buckets") \
        and hasattr(dist, "_compute_bucket_assignment_by_size")


def capture(ddp: Any) -> Optional[Layout]:
    """The DDP module's bucket layout as lists of parameter indices, once its buckets have been rebuilt.

    Returns None before the first backward (DDP still uses its initial layout, which a new DDP reproduces
    by itself) and where DDP's internals are not as expected.
    """
    if not _supported(ddp) or getattr(ddp, "_use_python_reducer", False):
        return None
    try:
        if not getattr(ddp, "_has_rebuilt_buckets", False):
            # DDP would rebuild at the start of the next forward from the order recorded in the first
            # backward; doing it now is equivalent and makes the layout of step 1 known.
            if ddp.reducer._rebuild_buckets():
                ddp._has_rebuilt_buckets = True
            else:
                return None
        params, _ = ddp._build_params_for_reducer()
        by_ptr: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            by_ptr.setdefault(p.data_ptr(), []).append(i)
        layout: Layout = []
        for bucket in ddp.reducer._get_zeros_like_grad_buckets():
            layout.append([by_ptr[p.data_ptr()].pop(0) for p in bucket.parameters()])
        return layout
    except (RuntimeError, KeyError, IndexError, AttributeError) as exc:
        log.warning("could not read DDP's bucket layout (%s); a restored DDP may not be bitwise exact", exc)
        return None


def apply(ddp: Any, layout: Layout) -> bool:
    """Rebuild a not-yet-used DDP's reducer with `layout`; True on success.

    Communication hooks registered through `register_comm_hook` are registered again on the new reducer.
    """
    import torch.distributed as dist
    if not _supported(ddp) or not hasattr(ddp, "_comm_hooks"):
        log.warning("this torch's DDP lacks the internals hyperpodrun uses to keep its bucket layout; the "
                    "first step after a restore may differ in the last bits from a run without the fault")
        return False
    params, expect_sparse = ddp._build_params_for_reducer()
    flat = sorted(i for bucket in layout for i in bucket)
    if flat != list(range(len(params))):
        log.warning("saved DDP bucket layout covers %d parameters, the model has %d; keeping DDP's own layout",
                    len(flat), len(params))
        return False
    cap = int(getattr(ddp, "bucket_bytes_cap", 25 * 1024 * 1024))
    original = dist._compute_bucket_assignment_by_size

    def assignment(*_args: Any, **_kwargs: Any) -> tuple[Layout, list[int]]:
        # DDP reverses the list it gets, to approximate the ready order; hand it the layout reversed.
        return [list(b) for b in reversed(layout)], [cap] * len(layout)

    old = ddp.reducer
    try:
        old._remove_autograd_hooks()
    except (RuntimeError, AttributeError):
        pass
    dist._compute_bucket_assignment_by_size = assignment
    try:
        ddp._ddp_init_helper(params, expect_sparse, ddp._build_debug_param_to_name_mapping(params),
                             getattr(ddp, "static_graph", False))
    finally:
        dist._compute_bucket_assignment_by_size = original
    if getattr(ddp, "static_graph", False):
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    return True


def find_ddps() -> list[Any]:
    """Every live DDP module in the process (the user may keep DDP out of the state given to save)."""
    import gc
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return []
    return [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]


def fingerprint(ddp: Any) -> str:
    """Names a DDP by the shapes of its parameters, so a rebuilt model finds its saved layout."""
    import zlib
    shapes = ";".join(str(tuple(p.shape)) for p in ddp.module.parameters())
    return f"{sum(1 for _ in ddp.module.parameters())}:{zlib.crc32(shapes.encode()):08x}"


class LayoutKeeper:
    """Per generation: capture the layouts of the DDP modules in use, give new DDP modules saved ones."""

    def __init__(self) -> None:
        import weakref
        self._weak = weakref
        self._tracked: Optional[list[Any]] = None     # weakrefs to this generation's DDP modules
        self.layouts: dict[str, Layout] = {}
        self._late_hook: Any = None

    def reset(self) -> None:
        self._tracked, self.layouts = None, {}
        self._unhook()

    def _unhook(self) -> None:
        hook = getattr(self, "_late_hook", None)
        if hook is not None:
            hook.remove()
        self._late_hook = None

    def collect(self) -> dict[str, Layout]:
        """Layouts of the DDP modules that have run, captured once each (called at every save)."""
        self._unhook()
        if self._tracked is None:
            self._tracked = [self._weak.ref(d) for d in find_ddps()]
        pending = []
        for ref in self._tracked:
            ddp = ref()
            if ddp is None:
                continue
            if not getattr(ddp, "_lazy_init_ran", True):
                pending.append(ref)          # not run yet: its layout is not known
                continue
            layout = capture(ddp)
            if layout is not None:
                self.layouts[fingerprint(ddp)] = layout
            elif not getattr(ddp, "_has_rebuilt_buckets", False) and _supported(ddp):
                # no gradient sync yet (a save before the first synchronised backward, e.g. while
                # accumulating under no_sync): the layout is known after it
                pending.append(ref)
        self._tracked = pending
        return self.layouts

    def restore(self, saved: dict[str, Layout]) -> int:
        """Give every DDP module built in this generation and not yet run its saved layout."""
        applied = 0
        for ddp in find_ddps():
            if getattr(ddp, "_lazy_init_ran", True):
                continue
            layout = saved.get(fingerprint(ddp))
            if layout is not None and apply(ddp, layout):
                applied += 1
        self.layouts = dict(saved)
        self._unhook()
        if saved:
            # a DDP made after restore() (the bare module restored, then wrapped) gets its layout before its
            # first forward, from a global forward pre-hook that goes once the next save() collects
            from torch.nn.modules.module import register_module_forward_pre_hook
            self._late_hook = register_module_forward_pre_hook(self._late)
        return applied

    def _late(self, module: Any, _args: Any) -> None:
        if not is_ddp(module) or getattr(module, "_lazy_init_ran", True) or getattr(module, "_hpr_layout", False):
            return
        module._hpr_layout = True
        layout = self.layouts.get(fingerprint(module))
        if layout is not None:
            apply(module, layout)
