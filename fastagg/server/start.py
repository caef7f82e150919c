"""Stepping from a given start model (fastagg.nvflare's aggregator, whose params take fresh storage every round):
``step`` as if the params had first been set to ``start``, without that copy where the rule allows it."""
from __future__ import annotations

from typing import Any

import torch

from .._aliasing import check_writes
from ..rows import param_rows

__all__ = ["step_from", "assign", "start_parts"]


def step_from(opt, start: Any, *args, **kw):
    """``opt.step(*args, **kw)`` as if the params had first been set to ``start`` (:func:`assign`), without that
    copy where the rule allows it: the momentum family's apply pass reads ``start`` where it writes the params (one
    pass; their old values are never read: ``_apply_reads_start``), so an aggregator whose params take fresh storage
    every round sets them by the step itself (fastagg.nvflare). Other rules, and a step that ends before its apply
    (a raise), copy ``start`` in."""
    with opt._serial:
        with torch.no_grad():
            opt._follow()
            parts = start_parts(opt, start)
            if not opt._apply_reads_start:
                _copy_in(opt, parts)
                return opt.step(*args, **kw)
            opt._start = parts
        try:
            return opt.step(*args, **kw)
        finally:
            left, opt._start = opt._start, None
            if left is not None:  # no apply pass ran: the params are start's
                _copy_in(opt, left)


def assign(opt, start: Any) -> None:
    """Set the params (and the model's buffers) to ``start``, a model of their form, layout, dtype and device."""
    with opt._serial, torch.no_grad():
        opt._follow()
        _copy_in(opt, start_parts(opt, start))


def start_parts(opt, start: Any) -> list:
    """``start``'s flat parameter parts, checked against the params (entries by name, sizes, dtype, device; no
    overlap with anything a step writes); its buffers are copied into the model's now."""
    p, layout = opt._p, opt.layout
    s = param_rows(start, buffers_count=opt.buffers == "optimizer")
    if (s.segments.lens != p.segments.lens or s.dtype != p.dtype or s.device != opt.device
            or [n for n, _ in s.buffers] != [n for n, _ in p.buffers]
            or (s.form.kind == layout.kind == "dict" and s.form.names != layout.names)):
        raise ValueError(f"start must be a model like the params (entries {list(layout.names)[:4]}... "
                         f"of {list(p.segments.lens)[:4]}... elements of {p.dtype} on "
                         f"{opt.device}); got {list(s.form.names)[:4]}... of {list(s.segments.lens)[:4]}... "
                         f"of {s.dtype} on {s.device}")
    check_writes(opt._written(), [(f"start entry {k}", t) for k, t in enumerate(s.parts)])
    for (_, dst), (_, src) in zip(p.buffers, s.buffers):
        dst.copy_(src)
    return s.parts


def _copy_in(opt, parts: list) -> None:
    with torch.no_grad():
        for dst, src in zip(opt._p.parts, parts):
            dst.copy_(src)
