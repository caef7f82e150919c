"""Apply pass on the GPU: ``w <- w + eta * mean`` (and the evaluation model ``w_new - eval_scale*eta*mean``),
reading eta and the round's finite flag from device memory; stores to the parameters are masked off when the
round is not finite (eval then receives a copy of them), so a bad round never touches them and the host never
waits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ParamRows
from .launch import apply_config, block_columns, block_grid


@triton.jit
def _apply_update_kernel(param_ptrs, eval_ptrs, like, block_seg, block_start, seg_len, seg_off, mean, eta_ptr,
                         finite_ptr, eval_scale, HAS_EVAL: tl.constexpr, SINGLE: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    seg, cols, inb, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D)
    finite = tl.load(finite_ptr).to(tl.int32) != 0
    mask = inb & finite
    acc = mean.dtype.element_ty
    elem = like.dtype.element_ty
    eta = tl.load(eta_ptr).to(acc)
    m = tl.load(mean + off + cols, mask=mask, other=0.0)
    wptr = tl.load(param_ptrs + seg).to(tl.pointer_type(elem))
    if HAS_EVAL:  # eval is written in every round: a copy of w when the round is not finite
        w = tl.load(wptr + cols, mask=inb, other=0.0).to(acc)
    else:
        w = tl.load(wptr + cols, mask=mask, other=0.0).to(acc)
    w_new = w + eta * m
    tl.store(wptr + cols, w_new.to(elem), mask=mask)
    if HAS_EVAL:
        eptr = tl.load(eval_ptrs + seg).to(tl.pointer_type(elem))
        ev = tl.where(mask, w_new - (eta * eval_scale) * m, w)
        tl.store(eptr + cols, ev.to(elem), mask=inb)


def apply_update(*, params: ParamRows, mean: torch.Tensor, eta: torch.Tensor, finite: torch.Tensor,
                 eval_out: ParamRows | None, eval_scale: float) -> None:
    device = mean.device
    cfg = apply_config(params.segments.numel)
    lens, offs = params.segments.tables(device)
    bseg, bstart, nb, single = block_grid(params.segments, cfg["BLOCK_D"], device)
    if nb == 0:
        return
    param_ptrs = params.ptrs().to(device, non_blocking=True)
    eval_ptrs = eval_out.ptrs().to(device, non_blocking=True) if eval_out is not None else param_ptrs
    _apply_update_kernel[(nb,)](
        param_ptrs, eval_ptrs, params.parts[0], bseg, bstart, lens, offs, mean, eta, finite, float(eval_scale),
        HAS_EVAL=eval_out is not None, SINGLE=single, BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
    )
