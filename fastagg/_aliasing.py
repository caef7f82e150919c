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
from operator import attrgetter, methodcaller

import numpy as np
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
    """Whether some written span intersects another span (written or read): one sort and one sweep per device,
    O(n log n) for n spans (a state_dict step checks ~100 written entries against ~2000 read ones), in numpy. In start
    order a span meets an earlier one exactly when it starts before that one ends, so it is enough to know, before
    each span, the largest end of every earlier span (for a written one) and of the earlier written ones (for a read
    one); spans with equal starts meet whichever comes first."""
    by_device: dict = {}
    for j, sp in enumerate(spans):
        if sp is not None:
            by_device.setdefault(sp[0], []).append(j)
    for idx in by_device.values():
        if len(idx) < 2:
            continue
        lo = np.array([spans[j][1] for j in idx], dtype=np.uint64)
        hi = np.array([spans[j][2] for j in idx], dtype=np.uint64)
        written = np.array([j < num_writes for j in idx])
        order = np.argsort(lo, kind="stable")
        lo, hi, written = lo[order], hi[order], written[order]
        end_any = np.maximum.accumulate(hi)
        end_written = np.maximum.accumulate(np.where(written, hi, np.uint64(0)))
        before_any = np.concatenate(([np.uint64(0)], end_any[:-1]))
        before_written = np.concatenate(([np.uint64(0)], end_written[:-1]))
        if np.any(np.where(written, lo < before_any, lo < before_written)):
            return True
    return False


class Rows:
    """Many read tensors, each 1-D with unit stride (a round's client rows), named only when an error needs a name:
    ``name(j)`` names ``tensors[j]``. Their spans come from two attribute reads each (a ResNet-18 round of 16 clients
    reads ~1,000 rows; building their names and general spans cost ~5 ms a step)."""

    def __init__(self, tensors: list, name) -> None:
        self.tensors, self.name = tensors, name

    def spans(self) -> list:
        ts = self.tensors
        if not ts:
            return []
        numels = list(map(_NUMEL, ts))
        if (set(map(_DIM, ts)) != {1} or len(set(map(_DTYPE, ts))) != 1 or len(set(map(_DEVICE, ts))) != 1
                or (set(map(_STRIDE0, ts)) != {1} and any(st != 1 and n > 1
                                                         for st, n in zip(map(_STRIDE0, ts), numels)))):
            return [span(t) for t in ts]
        device, es = ts[0].device, ts[0].element_size()
        return [(device, p, p + n * es) if n else None for p, n in zip(map(_DATA_PTR, ts), numels)]

    def pairs(self) -> list:
        return [(self.name(j), t) for j, t in enumerate(self.tensors)]


_DATA_PTR, _NUMEL, _DIM, _STRIDE0 = methodcaller("data_ptr"), methodcaller("numel"), methodcaller("dim"), \
    methodcaller("stride", 0)
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def check_writes(writes: Iterable[Named], reads: Iterable[Named] = ()) -> None:
    """Raise ValueError naming the pair when a written tensor overlaps itself, another written tensor, or a read
    one. ``writes`` and ``reads`` are (name, tensor) pairs; names say where the user gave them. The pairs are
    compared by one sweep over the sorted spans; only when one overlaps are they walked in order, to name the first
    pair as the message always has."""
    writes = list(writes)
    if isinstance(reads, Rows):
        read_spans = reads.spans()
        if not any(self_overlapping(t) for _, t in writes) and not _any_overlap(
                [span(t) for _, t in writes] + read_spans, len(writes)):
            return
        reads = reads.pairs()
    reads = list(reads)
    spans = [(n, t, span(t)) for n, t in writes + reads]
    if not any(self_overlapping(t) for _, t in writes) and not _any_overlap([sp for _, _, sp in spans], len(writes)):
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
