"""Batched local steps on the GPU: one program per client row, two sweeps over its columns.

Sweep 1 sums ||dir||^2 (float32 per block, float64 across blocks, in order); the row's scalars (clip scale, the
fixed or SPS step, the safeguards) are computed in-program; sweep 2 applies the step with stores masked off for a
row that takes none. See ``backends/reference.py::local_step`` for the exact rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rowtable import per_row_tensor
from .launch import local_config

RULES = {"fixed": 0, "sps": 1}
MODES = {"none": 0, "heavy": 1, "nesterov": 2, "mass": 3}


@triton.jit
def _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC: tl.constexpr,
               HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr):
    v = tl.load(g_row + cols, mask=mask, other=0.0).to(ACC)
    if HAS_ANCHOR:
        xv = tl.load(x_row + cols, mask=mask, other=0.0).to(ACC)
        v += prox * (xv - tl.load(a_row + cols, mask=mask, other=0.0).to(ACC))
    if HAS_CONTROL:
        v += tl.load(control + cols, mask=mask, other=0.0).to(ACC) - tl.load(ci_row + cols, mask=mask, other=0.0).to(ACC)
    return v


@triton.jit
def _local_step_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, lr, loss, l_star,
                       sps_c, cap, first_ptr, step_out, d, prox, clip_norm, weight_decay, momentum, eta2, tiny,
                       ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, HAS_FIRST: tl.constexpr,
                       RULE: tl.constexpr,
                       MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    elem = like.dtype.element_ty
    x_row = tl.load(x_ptrs + i).to(tl.pointer_type(elem))
    g_row = tl.load(g_ptrs + i).to(tl.pointer_type(elem))
    a_row = tl.load(a_ptrs + i).to(tl.pointer_type(elem))
    ci_row = tl.load(ci_ptrs + i).to(tl.pointer_type(ACC))
    b_row = tl.load(buf_ptrs + i).to(tl.pointer_type(ACC))
    offs = tl.arange(0, BLOCK).to(tl.int64)

    s = tl.zeros([1], dtype=tl.float64)
    for b0 in range(0, d, BLOCK):
        cols = b0 + offs
        mask = cols < d
        v = _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC, HAS_ANCHOR, HAS_CONTROL)
        s += tl.sum(v * v).to(tl.float64)
    s = tl.sum(s)

    clip = clip_norm
    scale = tl.where((clip > 0) & (s > clip * clip), clip / tl.sqrt(tl.where(s > 0, s, 1.0)), 1.0)
    s2 = s * scale * scale
    finite = (s == s) & (s - s == 0)
    if RULE == 0:
        step = tl.where(finite, tl.load(lr + i), 0.0)
    else:
        f = tl.load(loss + i)
        ls = tl.load(l_star + i)
        ok = finite & (f - f == 0) & (f > ls) & (s2 > tiny)
        raw = tl.minimum((f - ls) / (tl.load(sps_c + i) * tl.where(ok, s2, 1.0)), tl.load(cap + i))
        step = tl.where(ok, raw, 0.0)
    step = tl.where((step - step == 0) & (step > 0), step, 0.0)
    tl.store(step_out + i, step)
    limit = tl.where(step > 0, d, 0)  # a row that takes no step masks off its whole sweep 2

    st = step.to(ACC)
    sc = scale.to(ACC)
    for b0 in range(0, d, BLOCK):
        cols = b0 + offs
        mask = cols < limit
        xv = tl.load(x_row + cols, mask=mask, other=0.0).to(ACC)
        dv = sc * _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC, HAS_ANCHOR,
                             HAS_CONTROL) + weight_decay * xv
        if MODE == 0:
            new_x = xv - st * dv
        elif MODE == 1:
            bv = momentum * tl.load(b_row + cols, mask=mask, other=0.0) + dv
            tl.store(b_row + cols, bv, mask=mask)
            new_x = xv - st * bv
        elif MODE == 2:
            bv = momentum * tl.load(b_row + cols, mask=mask, other=0.0) + dv
            tl.store(b_row + cols, bv, mask=mask)
            new_x = xv - st * (dv + momentum * bv)
        else:
            w = xv - st * dv
            b_old = tl.load(b_row + cols, mask=mask, other=0.0)
            if HAS_FIRST:  # a row's first step: w_0 = u_0
                b_old = tl.where(tl.load(first_ptr + i) != 0, xv, b_old)
            new_x = w + momentum * (w - b_old) + eta2 * dv
            tl.store(b_row + cols, w, mask=mask)
        tl.store(x_row + cols, new_x.to(elem), mask=mask)


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out) -> None:
    M, d = x.num_rows, x.base.shape[1]
    if M == 0:
        return
    lr, loss, l_star, sps_c, cap = (per_row_tensor(v, M, x.base.device) for v in (lr, loss, l_star, sps_c, cap))
    cfg = local_config(d)
    xp = x.ptrs()
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    _local_step_kernel[(M,)](
        xp, g.ptrs(), xp if anchor is None else anchor.ptrs(), x.base if control is None else control,
        xp if ci is None else ci.ptrs(), xp if buf is None else buf.ptrs(), x.base, lr, loss, l_star,
        sps_c, cap, lr if first is None else first, step_out, d, float(prox), float(clip_norm), float(weight_decay), float(momentum),
        float(eta2), float(tiny), ACC=acc, HAS_ANCHOR=anchor is not None, HAS_CONTROL=control is not None,
        HAS_FIRST=first is not None, RULE=RULES[rule], MODE=MODES[mode], BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
    )
