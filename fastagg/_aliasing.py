"""Memory rules every entry point applies before a kernel runs: a buffer that is written must not overlap
another argument, nor itself.

A tensor's bytes are the span from its lowest to its highest element (on its device); two arguments overlap when
their spans intersect. That is conservative (``x[:, ::2]`` and ``x[:, 1::2]`` interleave without sharing an
element, yet count as overlapping), as torch's own in-place checks are. Reading the same memory through several
inputs is fine; writing into memory another argument reads or writes is not: the result would depend on the
order the kernel visits elements, and on the GPU on which program runs first.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

Named = tuple[str, torch.Tensor]


def span(t: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """(device, first byte, one past the last byte) of a tensor's elements; None when it has none."""
    if t.numel() == 0:
        return None
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    es, base = t.element_size(), t.data_ptr()
    return t.device, base + lo * es, base + (hi + 1) * es


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = span(a), span(b)
    return sa is not None and sb is not None and sa[0] == sb[0] and max(sa[1], sb[1]) < min(sa[2], sb[2])


def self_overlapping(t: torch.Tensor) -> bool:
    """Some memory location holds two elements of ``t`` (an ``expand``-ed tensor, a stride-0 dimension...)."""
    if t.numel() <= 1:
        return False
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    extent = 1  # elements spanned by the dimensions so far, innermost first
    for stride, n in dims:
        if stride < extent:
            return True
        extent = stride * (n - 1) + extent
    return False


def _any_overlap(spans: list, num_writes: int) -> bool:
    """Whether some written span intersects another span (written or read): one sort and one sweep, O(n log n) for
    n spans (a state_dict step checks ~100 written entries against ~2000 read ones). Spans in start order: a span
    meets an earlier one exactly when it starts before that one ends, so it is enough to keep the largest end seen,
    of any span and of written ones."""
    order = sorted((s[2][0].type, -1 if s[2][0].index is None else s[2][0].index, s[2][1], s[2][2], j < num_writes)
                   for j, s in enumerate(spans) if s[2] is not None)
    device, end_any, end_written = None, 0, 0
    for dev_type, dev_index, start, end, written in order:
        if (dev_type, dev_index) != device:
            device, end_any, end_written = (dev_type, dev_index), 0, 0
        if start < (end_any if written else end_written):
            return True
        end_any = max(end_any, end)
        if written:
            end_written = max(end_written, end)
    return False


def check_writes(writes: Iterable[Named], reads: Iterable[Named] = ()) -> None:
    """Raise ValueError naming the pair when a written tensor overlaps itself, another written tensor, or a read
    one. ``writes`` and ``reads`` are (name, tensor) pairs; names say where the user gave them. The pairs are
    compared by one sweep over the sorted spans; only when one overlaps are they walked in order, to name the first
    pair as the message always has."""
    writes, reads = list(writes), list(reads)
    spans = [(n, t, span(t)) for n, t in writes + reads]
    if not any(self_overlapping(t) for _, t in writes) and not _any_overlap(spans, len(writes)):
        return
    for k, (name, t) in enumerate(writes):
        if self_overlapping(t):
            raise ValueError(f"{name} has elements that share memory (strides {t.stride()} for shape "
                             f"{tuple(t.shape)}, e.g. from expand()); it is written in place: pass a tensor that "
                             "owns its memory (.clone())")
        sa = spans[k][2]
        if sa is None:
            continue
        for j, (other, _, sb) in enumerate(spans):
            if j == k or (j < len(writes) and j < k) or sb is None or sa[0] != sb[0]:
                continue
            if max(sa[1], sb[1]) < min(sa[2], sb[2]):
                verb = "is also written" if j < len(writes) else "is read"
                raise ValueError(f"{name} overlaps {other}, which {verb} in the same call; the results would depend "
                                 "on the order elements are visited: pass separate buffers")
