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


def check_writes(writes: Iterable[Named], reads: Iterable[Named] = ()) -> None:
    """Raise ValueError naming the pair when a written tensor overlaps itself, another written tensor, or a read
    one. ``writes`` and ``reads`` are (name, tensor) pairs; names say where the user gave them."""
    writes, reads = list(writes), list(reads)
    spans = [(n, t, span(t)) for n, t in writes + reads]
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
