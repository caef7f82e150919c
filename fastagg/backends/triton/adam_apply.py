"""Apply pass of the Adam family on the GPU (FedAdam, FedYogi, FedAdagrad, FedAMS)::

    m <- b1 m + (1 - b1) mean                   (adagrad: m = mean, no buffer)
    v <- b2 v + (1 - b2) mean^2                 (adam, ams)
    v <- v - (1 - b2) mean^2 sign(v - mean^2)   (yogi)
    v <- v + mean^2                             (adagrad)
    vhat <- max(vhat, v, ams_eps)               (ams: the denominator uses vhat)
    w <- w + lr * m / (sqrt(v or vhat) + tau)   (lr: a device scalar, bias correction folded in)

Every store is masked off when the round is not finite; an element whose new w or state would not be finite keeps
its old values and is counted in ``overflow_out`` (no Inf or NaN is ever stored).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ParamRows
from .launch import address_table, apply_launch, block_columns, guarded_store, scalar_table, table_address

RULES = {"adam": 0, "yogi": 1, "adagrad": 2, "ams": 3}


@triton.jit
def _adam_block(wptr, cols, inb, off, mean, m_buf, v_buf, vhat_buf, lr_ptr, finite, beta1, beta2, tau, ams_eps,
                overflow, RULE: tl.constexpr, SELECT: tl.constexpr):
    """One block; ``inb`` is a constant all-true mask for a block wholly inside its segment. An element whose new
    w or state would not be finite keeps its old values and is counted."""
    acc = mean.dtype.element_ty
    elem = wptr.dtype.element_ty
    mask = inb & finite
    lr = tl.load(lr_ptr).to(acc)
    g = tl.load(mean + off + cols, mask=mask, other=0.0)
    g2 = g * g
    if RULE == 2:
        m = g
        old_ok = g == g
    else:
        m_old = tl.load(m_buf + off + cols, mask=mask, other=0.0)
        m = beta1 * m_old + (1.0 - beta1) * g
        old_ok = m_old - m_old == 0
    v_old = tl.load(v_buf + off + cols, mask=mask, other=0.0)
    v = v_old
    old_ok = old_ok & (v - v == 0)
    if RULE == 0 or RULE == 3:
        v = beta2 * v + (1.0 - beta2) * g2
    elif RULE == 1:
        sign = (v > g2).to(acc) - (v < g2).to(acc)
        v = v - (1.0 - beta2) * g2 * sign
    else:
        v = v + g2
    denom_sq = v
    if RULE == 3:
        vhat = tl.load(vhat_buf + off + cols, mask=mask, other=0.0)
        vhat_old = vhat
        old_ok = old_ok & (vhat - vhat == 0)
        denom_sq = tl.maximum(tl.maximum(vhat, v), ams_eps)
    w_raw = tl.load(wptr + cols, mask=mask, other=0.0)
    w = w_raw.to(acc)
    old_ok = old_ok & (w - w == 0)
    w_new = w + lr * m / (tl.sqrt(denom_sq) + tau)
    r = w_new.to(elem).to(acc)
    good = (r - r == 0) & (m - m == 0) & (v - v == 0) & (denom_sq - denom_sq == 0)
    if RULE != 2:
        guarded_store(m_buf + off + cols, m, m_old, good, mask, SELECT)
    guarded_store(v_buf + off + cols, v, v_old, good, mask, SELECT)
    if RULE == 3:
        guarded_store(vhat_buf + off + cols, denom_sq, vhat_old, good, mask, SELECT)
    guarded_store(wptr + cols, w_new.to(elem), w_raw, good, mask, SELECT)
    bad = tl.sum((mask & ~good & old_ok).to(tl.int32))  # a kept element already Inf/NaN: not counted
    if bad > 0:
        tl.atomic_add(overflow, bad)


@triton.jit
def _adam_apply_kernel(param_ptrs, like, block_seg, block_start, seg_len, seg_off, mean, m_buf, v_buf, vhat_buf,
                       lr_ptr, finite_ptr, hyper, overflow,
                       RULE: tl.constexpr, SINGLE: tl.constexpr, ALIGNED: tl.constexpr, OFF_MULT: tl.constexpr,
                       BLOCK_D: tl.constexpr, SELECT: tl.constexpr):
    seg, _, cols, full, inb, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D, OFF_MULT)
    finite = tl.load(finite_ptr).to(tl.int32) != 0
    acc = mean.dtype.element_ty
    beta1, beta2 = tl.load(hyper).to(acc), tl.load(hyper + 1).to(acc)
    tau, ams_eps = tl.load(hyper + 2).to(acc), tl.load(hyper + 3).to(acc)
    wptr = table_address(param_ptrs, seg, like, ALIGNED)
    if full:
        _adam_block(wptr, cols, tl.full([BLOCK_D], 1, tl.int1), off, mean, m_buf, v_buf, vhat_buf, lr_ptr, finite,
                    beta1, beta2, tau, ams_eps, overflow, RULE, SELECT)
    else:
        _adam_block(wptr, cols, inb, off, mean, m_buf, v_buf, vhat_buf, lr_ptr, finite, beta1, beta2, tau, ams_eps,
                    overflow, RULE, SELECT)


def adam_apply(*, params: ParamRows, mean: torch.Tensor, finite: torch.Tensor, m: torch.Tensor | None,
               v: torch.Tensor, vhat: torch.Tensor | None, rule: str, lr: torch.Tensor, beta1: float, beta2: float,
               tau: float, ams_eps: float, overflow_out: torch.Tensor) -> None:
    addresses = [t.data_ptr() for t in params.parts]
    nb, blocks, launch = apply_launch(params.segments, mean.device, mean.element_size(), addresses)
    if nb == 0:
        return
    _adam_apply_kernel[(nb,)](
        address_table(addresses, mean.device), params.parts[0], *blocks, mean,
        v if m is None else m, v, v if vhat is None else vhat, lr, finite,
        scalar_table((beta1, beta2, tau, ams_eps), mean.device), overflow_out, RULE=RULES[rule], **launch,
    )
