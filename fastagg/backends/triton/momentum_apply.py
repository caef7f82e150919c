"""Apply pass of the momentum family on the GPU (plain step, FedAvgM, Nesterov, FedACG, FedExP-M)::

    u = momentum * buf + mean          (u = mean without buf)
    step = mean + momentum * u if nesterov else u
    w <- w + lr * step;  buf <- u;  extra = w_new + extra_coef * u       (extra: eval model or broadcast)

lr, the extra coefficients and the round's finite flag are read from device memory: when the round is not
finite, stores to w and buf are masked off and extra = w + extra_coef_skip * buf (left untouched without
extra_coef_skip), so no host sync is needed. No Inf or NaN is ever stored: an element whose new value would not
be finite in its dtype keeps its old values and is counted in ``overflow_out``. With ``start``, w's old values are
read from it and w is only written (start's values where it would have kept its own). With ``mean_scale``, ``mean``
is a sum and the mean is ``0 + mean_scale * sum`` (the one-row stats pass's mean, bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ParamRows
from .launch import address_table, apply_launch, block_columns, guarded_store, scalar_table, table_address


@triton.jit
def _stays_finite(v, elem):
    """Elementwise: ``v`` is finite once rounded to ``elem`` (the dtype it is stored in)."""
    r = v.to(elem).to(v.dtype)
    return r - r == 0


@triton.jit
def _momentum_block(wptr, eptr, sptr, cols, inb, off, mean, buf, lr, coef_ptr, coef_skip_ptr, scale_ptr, finite,
                    momentum, overflow, HAS_BUF: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SKIP: tl.constexpr,
                    NESTEROV: tl.constexpr, HAS_START: tl.constexpr, SCALED: tl.constexpr, SELECT: tl.constexpr):
    """One block; ``inb`` is a constant all-true mask for a block wholly inside its segment. An element whose new
    w, buf or extra would not be finite keeps its old values and is counted. HAS_START: the old w is read at
    ``sptr`` and every w of the block is written."""
    acc = mean.dtype.element_ty
    elem = wptr.dtype.element_ty
    mask = inb & finite
    lr = tl.load(lr).to(acc)
    m = tl.load(mean + off + cols, mask=mask, other=0.0)
    if SCALED:  # mean is a sum: the one-row stats pass's mean, 0 + scale * sum
        m = 0.0 + tl.load(scale_ptr).to(acc) * m
    if HAS_START:
        w_raw = tl.load(sptr + cols, mask=inb, other=0.0)
    else:
        w_raw = tl.load(wptr + cols, mask=inb, other=0.0)
    w = w_raw.to(acc)
    if HAS_BUF:
        b_old = tl.load(buf + off + cols, mask=inb, other=0.0)
        u = momentum * b_old + m
    else:
        b_old = m * 0.0
        u = m
    if NESTEROV:
        step = m + momentum * u
    else:
        step = u
    w_new = w + lr * step
    good = _stays_finite(w_new, elem) & (u - u == 0)
    if HAS_EXTRA:
        coef = tl.load(coef_ptr).to(acc)
        extra = w_new + coef * u
        good = good & _stays_finite(extra, elem)
    old_ok = (w - w == 0) & (b_old - b_old == 0)  # a kept element already Inf/NaN is the caller's: not counted
    bad = tl.sum((mask & ~good & old_ok).to(tl.int32))
    if HAS_START:
        tl.store(wptr + cols, tl.where(mask & good, w_new.to(elem), w_raw), mask=inb)
    else:
        guarded_store(wptr + cols, w_new.to(elem), w_raw, good, mask, SELECT)
    if HAS_BUF:
        guarded_store(buf + off + cols, u, b_old, good, mask, SELECT)
    if HAS_EXTRA:
        if HAS_SKIP:
            kept = w + tl.load(coef_skip_ptr).to(acc) * b_old
            keep_ok = _stays_finite(kept, elem)
            skipped = inb & ~finite
            bad += tl.sum((skipped & ~keep_ok & old_ok).to(tl.int32))
            tl.store(eptr + cols, tl.where(mask & good, extra, tl.where(skipped & keep_ok, kept, w)).to(elem),
                     mask=inb)
        else:
            tl.store(eptr + cols, tl.where(good, extra, w).to(elem), mask=mask)
    if bad > 0:
        tl.atomic_add(overflow, bad)


@triton.jit
def _momentum_apply_kernel(param_ptrs, extra_ptrs, start_ptrs, like, block_seg, block_start, seg_len, seg_off, mean,
                           buf, lr_ptr, coef_ptr, coef_skip_ptr, scale_ptr, finite_ptr, momentum_ptr, overflow,
                           HAS_BUF: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SKIP: tl.constexpr, NESTEROV: tl.constexpr,
                           HAS_START: tl.constexpr, SCALED: tl.constexpr, SINGLE: tl.constexpr, ALIGNED: tl.constexpr,
                           OFF_MULT: tl.constexpr, BLOCK_D: tl.constexpr, SELECT: tl.constexpr):
    seg, _, cols, full, inb, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D, OFF_MULT)
    finite = tl.load(finite_ptr).to(tl.int32) != 0
    momentum = tl.load(momentum_ptr).to(mean.dtype.element_ty)
    wptr = table_address(param_ptrs, seg, like, ALIGNED)
    eptr = table_address(extra_ptrs, seg, like, ALIGNED)
    sptr = table_address(start_ptrs, seg, like, ALIGNED)
    if full:
        _momentum_block(wptr, eptr, sptr, cols, tl.full([BLOCK_D], 1, tl.int1), off, mean, buf, lr_ptr, coef_ptr,
                        coef_skip_ptr, scale_ptr, finite, momentum, overflow, HAS_BUF, HAS_EXTRA, HAS_SKIP, NESTEROV,
                        HAS_START, SCALED, SELECT)
    else:
        _momentum_block(wptr, eptr, sptr, cols, inb, off, mean, buf, lr_ptr, coef_ptr, coef_skip_ptr, scale_ptr,
                        finite, momentum, overflow, HAS_BUF, HAS_EXTRA, HAS_SKIP, NESTEROV, HAS_START, SCALED, SELECT)


def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None,
                   overflow_out: torch.Tensor, start: list | None = None,
                   mean_scale: torch.Tensor | None = None) -> None:
    addresses = [t.data_ptr() for t in params.parts]
    extra_addresses = [t.data_ptr() for t in extra_out.parts] if extra_out is not None else addresses
    start_addresses = [t.data_ptr() for t in start] if start is not None else addresses
    nb, blocks, launch = apply_launch(params.segments, mean.device, mean.element_size(),
                                      addresses + extra_addresses + start_addresses)
    if nb == 0:
        return
    param_ptrs = address_table(addresses, mean.device)
    extra_ptrs = address_table(extra_addresses, mean.device) if extra_out is not None else param_ptrs
    start_ptrs = address_table(start_addresses, mean.device) if start is not None else param_ptrs
    _momentum_apply_kernel[(nb,)](
        param_ptrs, extra_ptrs, start_ptrs, params.parts[0], *blocks, mean, mean if buf is None else buf,
        lr, lr if extra_coef is None else extra_coef, lr if extra_coef_skip is None else extra_coef_skip,
        lr if mean_scale is None else mean_scale, finite, scalar_table((momentum,), mean.device), overflow_out,
        HAS_BUF=buf is not None, HAS_EXTRA=extra_out is not None, HAS_SKIP=extra_coef_skip is not None,
        NESTEROV=bool(nesterov), HAS_START=start is not None, SCALED=mean_scale is not None, **launch,
    )
