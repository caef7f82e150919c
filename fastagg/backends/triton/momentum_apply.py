"""Apply pass of the momentum family on the GPU (plain step, FedAvgM, Nesterov, FedACG, FedExP-M)::

    u = momentum * buf + mean          (u = mean without buf)
    step = mean + momentum * u if nesterov else u
    w <- w + lr * step;  buf <- u;  extra = w_new + extra_coef * u       (extra: eval model or broadcast)

lr, the extra coefficients and the round's finite flag are read from device memory: when the round is not
finite, stores to w and buf are masked off and extra = w + extra_coef_skip * buf (left untouched without
extra_coef_skip), so no host sync is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ParamRows
from .launch import apply_block, apply_launch


@triton.jit
def _momentum_apply_kernel(param_ptrs, extra_ptrs, like, block_seg, block_start, seg_len, seg_off, mean, buf,
                           lr_ptr, coef_ptr, coef_skip_ptr, finite_ptr, momentum,
                           HAS_BUF: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_SKIP: tl.constexpr, NESTEROV: tl.constexpr,
                           SINGLE: tl.constexpr, BLOCK_D: tl.constexpr):
    seg, cols, inb, off, mask, lr, m = apply_block(block_seg, block_start, seg_len, seg_off, finite_ptr, lr_ptr,
                                                   mean, SINGLE, BLOCK_D)
    acc = mean.dtype.element_ty
    elem = like.dtype.element_ty
    wptr = tl.load(param_ptrs + seg).to(tl.pointer_type(elem))
    w = tl.load(wptr + cols, mask=inb, other=0.0).to(acc)
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
    tl.store(wptr + cols, w_new.to(elem), mask=mask)
    if HAS_BUF:
        tl.store(buf + off + cols, u, mask=mask)
    if HAS_EXTRA:
        coef = tl.load(coef_ptr).to(acc)
        eptr = tl.load(extra_ptrs + seg).to(tl.pointer_type(elem))
        if HAS_SKIP:
            coef_skip = tl.load(coef_skip_ptr).to(acc)
            extra = tl.where(mask, w_new + coef * u, w + coef_skip * b_old)
            tl.store(eptr + cols, extra.to(elem), mask=inb)
        else:
            tl.store(eptr + cols, (w_new + coef * u).to(elem), mask=mask)


def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None) -> None:
    nb, blocks, launch = apply_launch(params.segments, mean.device)
    if nb == 0:
        return
    param_ptrs = params.ptrs().to(mean.device, non_blocking=True)
    extra_ptrs = extra_out.ptrs().to(mean.device, non_blocking=True) if extra_out is not None else param_ptrs
    _momentum_apply_kernel[(nb,)](
        param_ptrs, extra_ptrs, params.parts[0], *blocks, mean, mean if buf is None else buf,
        lr, lr if extra_coef is None else extra_coef, lr if extra_coef_skip is None else extra_coef_skip, finite,
        float(momentum), HAS_BUF=buf is not None, HAS_EXTRA=extra_out is not None,
        HAS_SKIP=extra_coef_skip is not None, NESTEROV=bool(nesterov), **launch,
    )
