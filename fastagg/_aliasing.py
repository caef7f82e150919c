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

from . import _facts

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


def _sweep(lo: np.ndarray, hi: np.ndarray, written: np.ndarray) -> bool:
    """Whether some written span of one device intersects another span (written or read), the spans given as uint64
    start / end arrays: one sort and one sweep, O(n log n) for n spans (a state_dict step checks ~100 written entries
    against ~2000 read ones). In start order a span meets an earlier one exactly when it starts before that one
    ends, so it is enough to know, before each span, the largest end of every earlier span (for a written one) and
    of the earlier written ones (for a read one); spans with equal starts meet whichever comes first."""
    if len(lo) < 2:
        return False
    order = np.argsort(lo, kind="stable")
    lo, hi, written = lo[order], hi[order], written[order]
    before_any = np.concatenate(([np.uint64(0)], np.maximum.accumulate(hi)[:-1]))
    before_written = np.concatenate(([np.uint64(0)], np.maximum.accumulate(np.where(written, hi, np.uint64(0)))[:-1]))
    return bool(np.any(np.where(written, lo < before_any, lo < before_written)))


def _any_overlap(spans: list, num_writes: int) -> bool:
    """:func:`_sweep` over (device, start, end) spans (None: empty), the first ``num_writes`` written, per device."""
    by_device: dict = {}
    for j, sp in enumerate(spans):
        if sp is not None:
            by_device.setdefault(sp[0], []).append(j)
    for idx in by_device.values():
        if _sweep(np.array([spans[j][1] for j in idx], dtype=np.uint64),
                  np.array([spans[j][2] for j in idx], dtype=np.uint64), np.array([j < num_writes for j in idx])):
            return True
    return False


class Rows:
    """Many read tensors (a round's client rows), named only when an error needs a name: ``name(j)`` names
    ``tensors[j]``. When all are contiguous, of one dtype and on one device, each spans ``[data_ptr, data_ptr + numel *
    element size)``, read into numpy arrays with two calls a tensor (a ResNet-18 round of 16 clients reads ~1,000
    rows; building their names and general spans cost ~5 ms a step)."""

    def __init__(self, tensors: list, name, arrays: tuple | None = None) -> None:
        self.tensors, self.name, self._arrays = tensors, name, arrays

    def arrays(self) -> tuple | None:
        """(device, starts, ends) as uint64 arrays of the nonempty tensors, or None when the shortcut does not
        apply (then :meth:`pairs` and the general spans). ``arrays``, when given, are the contiguous tensors'
        (device, starts, ends) read by whoever checked them (rows.py's shortcut), in the order of ``tensors``."""
        if self._arrays is not None:
            device, lo, hi = self._arrays
            keep = hi > lo
            return device, lo[keep], hi[keep]
        ts = self.tensors
        if not ts or len(set(map(_DTYPE, ts))) != 1 or len(set(map(_DEVICE, ts))) != 1 or not all(
                map(_CONTIGUOUS, ts)):
            return None
        n = len(ts)
        lo = np.fromiter(map(_DATA_PTR, ts), dtype=np.uint64, count=n)
        size = np.fromiter(map(_NUMEL, ts), dtype=np.uint64, count=n) * np.uint64(ts[0].element_size())
        keep = size > 0
        return ts[0].device, lo[keep], lo[keep] + size[keep]

    def pairs(self) -> list:
        return [(self.name(j), t) for j, t in enumerate(self.tensors)]


_DATA_PTR, _NUMEL, _CONTIGUOUS = methodcaller("data_ptr"), methodcaller("numel"), methodcaller("is_contiguous")
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def _rows_overlap(writes: list, reads: Rows) -> bool | None:
    """Whether a written tensor may overlap another one or ``reads`` (True: walk the pairs to name it), or None
    when ``reads`` has no array form."""
    arrays = reads.arrays()
    if arrays is None:
        return None
    device, rlo, rhi = arrays
    wspans = [span(t) for _, t in writes]
    here = [sp for sp in wspans if sp is not None and sp[0] == device]
    elsewhere = [sp for sp in wspans if sp is not None and sp[0] != device]
    lo = np.concatenate((np.array([sp[1] for sp in here], dtype=np.uint64), rlo))
    hi = np.concatenate((np.array([sp[2] for sp in here], dtype=np.uint64), rhi))
    written = np.concatenate((np.ones(len(here), dtype=bool), np.zeros(len(rlo), dtype=bool)))
    return _sweep(lo, hi, written) or _any_overlap(elsewhere, len(elsewhere))


def _contiguous_writes_overlap(writes: list, reads: Rows) -> bool | None:
    """:func:`_rows_overlap` from the written tensors' facts read in C (:mod:`fastagg._facts`), when every one is a
    plain contiguous tensor on the rows' device (then none overlaps itself and each spans ``[data, data + nbytes)``);
    None when that does not apply (or the module is not used)."""
    f = _facts.facts([t for _, t in writes]) if writes else None
    arrays = None if f is None else reads.arrays()
    if arrays is None or not (f[:, _facts.OK].all() and (f[:, _facts.FLAGS] & _facts.CONTIGUOUS).all()
                              and (f[:, _facts.DEVICE] == _facts.device_code(arrays[0])).all()):
        return None
    _, rlo, rhi = arrays
    wlo = f[:, _facts.DATA].astype(np.uint64)
    whi = wlo + f[:, _facts.NBYTES].astype(np.uint64)
    keep = whi > wlo
    return _sweep(np.concatenate((wlo[keep], rlo)), np.concatenate((whi[keep], rhi)),
                  np.concatenate((np.ones(int(keep.sum()), dtype=bool), np.zeros(len(rlo), dtype=bool))))


def check_writes(writes: Iterable[Named], reads: Iterable[Named] = ()) -> None:
    """Raise ValueError naming the pair when a written tensor overlaps itself, another written tensor, or a read
    one. ``writes`` and ``reads`` are (name, tensor) pairs; names say where the user gave them. The pairs are
    compared by one sweep over the sorted spans; only when one overlaps are they walked in order, to name the first
    pair as the message always has."""
    writes = list(writes)
    if isinstance(reads, Rows):
        fast = _contiguous_writes_overlap(writes, reads)
        if fast is False or (fast is None and not any(self_overlapping(t) for _, t in writes)
                             and _rows_overlap(writes, reads) is False):
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
