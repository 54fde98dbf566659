"""Value fingerprints of a rank's state tensors: is the live state still the one a save() saw?

Why values, not identity: a survivor keeps its model and optimizer objects across an in-process restart, but
what wraps them is often made again (DDP or FSDP built inside the re-executed function, before or after
`restore()`), DDP's construction broadcast writes every parameter in place (the same values, a new version
count), and updates through `.data` change values without any version count seeing it. Whether a survivor may
keep its state without copying anything back is a question about the values, so that is what is compared.

How: at save() the L2 norm of every floating-point tensor is computed on its own device, accumulated in
float64, in fused multi-tensor kernels (`torch._foreach_norm`: a few launches for a thousand tensors, one read
of the state, on a side stream behind the training); tensors of other dtypes (integer counters, masks: small in
practice) are kept as a copy and compared exactly. restore() computes the same on the tensors the objects hold
now and compares bit for bit - the same kernels over the same tensor list give the same bits; a difference
only ever costs a copy back, never a wrong keep.

On the host (CPU tensors) the fingerprint is instead the exact sum (modulo 2**64) of each tensor's 64-bit words
(or 32-, 16-, 8-bit where its size does not divide): one read, no cast, and any change of any one word shows.

On a GPU a tensor of more than SAMPLE_ABOVE elements (1 Mi) is fingerprinted by a sample instead: one
element in every STRIDE (251) of its flattened values, copied as raw bits and compared exactly. Why: at every
save() the whole-state read took 3.2 ms of a 115 ms step for a 1 B-parameter GPT on an H200 (2.8 %: more than
the 2 % the overhead budget allows for everything, snapshots included), and the device reads memory in 32-byte
sectors, so a sample of one element in 251 reads about a sixteenth of the bytes.

What it catches: on the host, and for every GPU tensor of up to 1 Mi elements, every change made by training
arithmetic, an optimizer step (even one cut short), `copy_`, `fill_`, `zero_`, a scaled or shifted tensor, and a
change of a single element: the float64 sum of squares moves by 2*x*d for a change d of an element x, which
shows unless it is below the sum's rounding (about 1e-16 of it): for a 1 Mi-element tensor of unit-scale
values, any change of one element larger than about 1e-10; on the host the exact word sums see any change of
any word. For a larger GPU tensor: any change that touches at least 251 consecutive elements of its flattened
values (a row of a weight of width >= 251, a column of one with >= 251 rows whose width is not a multiple
of 251, the whole tensor, an optimizer step even cut short: fused optimizers work in chunks of 65,536
elements) and any change of a sampled element, bit for bit; and any optimizer step at all through the
optimizer's step counters (small tensors, compared in full).
What it misses: a change that leaves every small tensor's sum of squares the same (a permutation of
elements, flipped signs), and on a GPU a change confined to fewer than 251 consecutive elements of a large
tensor that avoids the sampled ones (a single element; a row of an embedding narrower than 251). Training
arithmetic does not do that by accident between a save() and a fault; a script that does such things to its
state between a save and a restore should pass `CheckpointManager(reuse_live=False)`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

#: GPU tensors of more elements than this are fingerprinted by a sample (see the module doc)
SAMPLE_ABOVE = 1 << 20
#: one element in every STRIDE of a sampled tensor: a prime, so no row or column of a weight lines up with it
STRIDE = 251


def _normed() -> tuple:
    import torch
    return (torch.float16, torch.bfloat16, torch.float32)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


class Fingerprint:
    """Fingerprints of an ordered list of tensors (computed at construction, possibly still running on a side
    stream: `event` per device says when). Holds small result tensors only, never a reference to the state."""

    def __init__(self, tensors: Sequence[Any], streams: Any = None, timed: bool = False) -> None:
        """`streams`: a SideStream to compute device tensors' fingerprints on (after the current stream's work
        so far); None: on the current stream. `timed`: record timing events (device_seconds) - only when asked,
        as this runs at every save()."""
        import torch
        #: (shape, dtype, device) of each tensor, once remember_layout() was called (the caller that holds the
        #: tensors themselves need not: they are what matches() is asked about)
        self.layout: Optional[list[tuple]] = None
        self.events: dict[Any, Any] = {}        # device -> event recorded after its fingerprint kernels
        self.source_events: dict[Any, Any] = {}  # device -> event the fingerprint kernels waited for
        #: device -> (start, end) timing events around each of its fingerprint's operations (when timed)
        self._spans: dict[Any, list[tuple[Any, Any]]] = {}
        groups: dict[tuple, list[Any]] = {}
        for t in tensors:                       # per tensor: the training thread pays this at every save()
            local = t.to_local() if hasattr(t, "placements") else t
            groups.setdefault((local.device, local.dtype), []).append(local)
        self.values: list[Any] = []
        with torch.no_grad():
            self._compute(groups, streams, timed)

    def _compute(self, groups: dict[tuple, list[Any]], streams: Any, timed: bool) -> None:
        import torch
        for (device, dtype), ts in groups.items():
            if device.type == "cuda" and streams is not None:
                stream = streams.get(device)
                source = torch.cuda.Event()
                source.record(torch.cuda.current_stream(device))
                self.source_events[device] = source
                stream.wait_event(source)
                with torch.cuda.stream(stream):
                    spans = self._spans.setdefault(device, []) if timed else None
                    self.values.extend(_group_print(ts, dtype, spans))
                    event = torch.cuda.Event()
                    event.record(stream)
                    self.events[device] = event
            else:
                self.values.extend(_group_print(ts, dtype))

    def remember_layout(self, tensors: Sequence[Any]) -> None:
        """Keep the tensors' shapes, dtypes and devices (before the tensors themselves are let go)."""
        self.layout = _layout(tensors)

    def wait_on(self, device: Any) -> None:
        """Make `device`'s current stream wait (on the device) until the fingerprint read its tensors: the
        optimizer step must not change them before."""
        import torch
        event = self.events.get(device)
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    def device_seconds(self) -> Optional[float]:
        """The device time the fingerprint's kernels took (the longest device's), once they are done; None while
        they run or without device tensors. What certifying a save() costs a GPU-bound step (its host time
        hides behind the device's work). Summed over each operation's own span, not from the first to the last:
        the host launches them one after another, and the gaps between them - its time, not the device's -
        would count too (a sampled fingerprint is a few hundred small kernels)."""
        longest: Optional[float] = None
        try:
            for spans in self._spans.values():
                if not spans or not spans[-1][1].query():
                    return None
                longest = max(longest or 0.0, sum(start.elapsed_time(end) for start, end in spans) / 1e3)
        except Exception:      # a broken context, a stream that never ran: nothing to learn from it
            return None
        return longest

    def final(self) -> bool:
        """Whether everything the fingerprint read had been computed when it was asked (see data_final in
        snapshot_copy): a fingerprint of work an abort then cut holds nothing certain."""
        try:
            return all(bool(e.query()) for e in self.source_events.values())
        except Exception:
            return False

    def matches(self, tensors: Sequence[Any]) -> bool:
        """Whether `tensors` (in the same order) hold the values fingerprinted."""
        import torch
        if self.layout is not None and _layout(tensors) != self.layout:
            return False
        for event in self.events.values():
            event.synchronize()
        now = Fingerprint(tensors)
        if len(now.values) != len(self.values):
            return False
        for a, b in zip(self.values, now.values):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b.to(a.device)):
                return False
        return True


def _layout(tensors: Sequence[Any]) -> list[tuple]:
    return [(tuple(_local(t).shape), _local(t).dtype, _local(t).device) for t in tensors]


def _words(t: Any) -> Any:
    """A tensor's bytes as the widest integer words they divide into."""
    import torch
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return flat.new_zeros(1, dtype=torch.int32)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and flat.element_size() <= size:
            return flat.view(dtype)
    return flat.view(torch.uint8)


def _group_print(ts: list[Any], dtype: Any, spans: Optional[list] = None) -> list[Any]:
    """The fingerprint of same-device, same-dtype tensors `ts` (in order): one or two tensors. `spans`: where
    to add timing events around each device operation (None: not timed)."""
    import torch
    if ts and ts[0].device.type == "cpu" and dtype in _normed() + (torch.float64,):
        # on the host the float64 norms are a slow path (a cast of every tensor first: 0.7 s for 512 MiB);
        # exact sums of each tensor's words cost a read (25x faster) and see any change of any one word
        return [torch.stack([_words(t).sum(dtype=torch.int64) for t in ts])]   # int64 words: wraps, exactly
    if dtype in _normed() + (torch.float64,):
        return _device_print(ts, dtype, spans)
    # integer, bool, float8, complex...: an exact copy of the bytes (such state is small: counters, masks)
    flat = [t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8) for t in ts]
    return [_timed(spans, lambda: torch.cat(flat)) if flat else torch.empty(0, dtype=torch.uint8)]


def _device_print(ts: list[Any], dtype: Any, spans: Optional[list] = None) -> list[Any]:
    """A GPU's floating-point tensors: the small ones' float64 norms, the large ones' sample (module doc)."""
    import torch
    full = [t for t in ts if t.numel() <= SAMPLE_ABOVE]
    large = [t for t in ts if t.numel() > SAMPLE_ABOVE]
    out = []
    if full:
        wide = None if dtype == torch.float64 else torch.float64
        out.append(_timed(spans, lambda: torch.stack(torch._foreach_norm(full, 2, dtype=wide))))
    if large:
        out.append(_timed(spans, lambda: _sample(large)))
    return out


def _timed(spans: Optional[list], op: Callable[[], Any]) -> Any:
    """`op()`, with timing events recorded around it on the current stream when `spans` is a list."""
    if spans is None:
        return op()
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = op()
    end.record()
    spans.append((start, end))
    return out


def _sample(ts: list[Any]) -> Any:
    """One element in every STRIDE of each tensor's flattened values, as raw bits (compared exactly: a NaN
    that stays a NaN matches, unlike a float comparison)."""
    import torch
    out = torch.cat([t.reshape(-1)[::STRIDE] for t in ts])    # strided views: a batched copy where CUDA can
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(out.element_size())
    return out.view(bits) if bits is not None else out


def fingerprint(tensors: Sequence[Any], streams: Optional[Any] = None) -> Fingerprint:
    """The fingerprint of `tensors` (see Fingerprint)."""
    return Fingerprint(tensors, streams)


__all__ = ["Fingerprint", "fingerprint"]
