"""Batched local steps on the GPU: two sweeps over each client row's columns.

Sweep 1 sums ||dir||^2 (float32 per block, float64 across blocks, in order); the row's scalars (clip scale, the
fixed or SPS step, the safeguards) are computed in-program; sweep 2 applies the step with stores masked off for a
row that takes none. See ``backends/reference.py::local_step`` for the exact rule.

Many short rows: one program per row does both sweeps (``_local_step_kernel``). Few long rows (say 100 clients on
a GPU with 132 SMs) would leave SMs idle that way, so rows are cut into fixed chunks of columns and each
(row, chunk) is a program: pass 1 writes the chunks' partial norms, pass 2 has every chunk's program sum its row's
partials in the same order, take the row's step and update its chunk (``local_config`` picks).
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
def _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC: tl.constexpr):
    """Row i's addresses in each table."""
    elem = like.dtype.element_ty
    return (tl.load(x_ptrs + i).to(tl.pointer_type(elem)), tl.load(g_ptrs + i).to(tl.pointer_type(elem)),
            tl.load(a_ptrs + i).to(tl.pointer_type(elem)), tl.load(ci_ptrs + i).to(tl.pointer_type(ACC)),
            tl.load(buf_ptrs + i).to(tl.pointer_type(ACC)))


@triton.jit
def _sq_sum(x_row, g_row, a_row, control, ci_row, c0, c1, prox, ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr,
            HAS_CONTROL: tl.constexpr, BLOCK: tl.constexpr):
    """||dir||^2 over columns [c0, c1): float32 block sums, float64 across blocks, in order."""
    offs = tl.arange(0, BLOCK).to(tl.int64)
    s = tl.zeros([1], dtype=tl.float64)
    for b0 in range(c0, c1, BLOCK):
        cols = b0 + offs
        mask = cols < c1
        v = _direction(x_row, g_row, a_row, control, ci_row, cols, mask, prox, ACC, HAS_ANCHOR, HAS_CONTROL)
        s += tl.sum(v * v).to(tl.float64)
    return tl.sum(s)


@triton.jit
def _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE: tl.constexpr):
    """The row's (step, clip scale) from its squared direction norm s, with the safeguards (step 0: none)."""
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
    return step, scale


@triton.jit
def _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, c0, c1, step, scale, prox,
            weight_decay, momentum, eta2, ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr,
            HAS_FIRST: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Sweep 2 over columns [c0, c1); a row that takes no step (step 0) masks off every store."""
    elem = like.dtype.element_ty
    offs = tl.arange(0, BLOCK).to(tl.int64)
    limit = tl.where(step > 0, c1, 0)
    st = step.to(ACC)
    sc = scale.to(ACC)
    for b0 in range(c0, c1, BLOCK):
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


@triton.jit
def _local_step_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, lr, loss, l_star,
                       sps_c, cap, first_ptr, step_out, d, prox, clip_norm, weight_decay, momentum, eta2, tiny,
                       ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, HAS_FIRST: tl.constexpr,
                       RULE: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: sweep 1, the row's step, sweep 2."""
    i = tl.program_id(0).to(tl.int64)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC)
    s = _sq_sum(x_row, g_row, a_row, control, ci_row, 0, d, prox, ACC, HAS_ANCHOR, HAS_CONTROL, BLOCK)
    step, scale = _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE)
    tl.store(step_out + i, step)
    _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, 0, d, step, scale, prox, weight_decay,
            momentum, eta2, ACC, HAS_ANCHOR, HAS_CONTROL, HAS_FIRST, MODE, BLOCK)


@triton.jit
def _chunk_sq_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, partial, d, prox,
                     ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Split rows, pass 1: program (i, c) writes ||dir||^2 of row i's chunk c to partial[i, c]."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC)
    c0 = c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, d)
    s = _sq_sum(x_row, g_row, a_row, control, ci_row, c0, c1, prox, ACC, HAS_ANCHOR, HAS_CONTROL, BLOCK)
    tl.store(partial + i * tl.num_programs(1) + c, s)


@triton.jit
def _chunk_update_kernel(x_ptrs, g_ptrs, a_ptrs, control, ci_ptrs, buf_ptrs, like, partial, lr, loss, l_star,
                         sps_c, cap, first_ptr, step_out, d, prox, clip_norm, weight_decay, momentum, eta2, tiny,
                         ACC: tl.constexpr, HAS_ANCHOR: tl.constexpr, HAS_CONTROL: tl.constexpr,
                         HAS_FIRST: tl.constexpr, RULE: tl.constexpr, MODE: tl.constexpr, CHUNK: tl.constexpr,
                         CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Split rows, pass 2: every program of row i sums the row's chunk partials (the same fixed order in each),
    takes the row's step, and updates its own chunk; chunk 0 reports the step."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    n = tl.num_programs(1)
    k = tl.arange(0, CHUNKS_P2)
    s = tl.sum(tl.load(partial + i * n + k, mask=k < n, other=0.0))
    step, scale = _row_step(s, i, lr, loss, l_star, sps_c, cap, clip_norm, tiny, RULE)
    if c == 0:
        tl.store(step_out + i, step)
    x_row, g_row, a_row, ci_row, b_row = _rows(x_ptrs, g_ptrs, a_ptrs, ci_ptrs, buf_ptrs, like, i, ACC)
    c0 = c * CHUNK
    _update(x_row, g_row, a_row, control, ci_row, b_row, like, first_ptr, i, c0, tl.minimum(c0 + CHUNK, d), step,
            scale, prox, weight_decay, momentum, eta2, ACC, HAS_ANCHOR, HAS_CONTROL, HAS_FIRST, MODE, BLOCK)


def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out) -> None:
    M, d = x.num_rows, x.base.shape[1]
    if M == 0:
        return
    lr, loss, l_star, sps_c, cap = (per_row_tensor(v, M, x.base.device) for v in (lr, loss, l_star, sps_c, cap))
    cfg = local_config(M, d)
    xp = x.ptrs()
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    rows = (xp, g.ptrs(), xp if anchor is None else anchor.ptrs(), x.base if control is None else control,
            xp if ci is None else ci.ptrs(), xp if buf is None else buf.ptrs(), x.base)
    flags = dict(ACC=acc, HAS_ANCHOR=anchor is not None, HAS_CONTROL=control is not None)
    step_flags = dict(HAS_FIRST=first is not None, RULE=RULES[rule], MODE=MODES[mode])
    scalars = (lr, loss, l_star, sps_c, cap, lr if first is None else first, step_out, d, float(prox),
               float(clip_norm), float(weight_decay), float(momentum), float(eta2), float(tiny))
    if cfg["CHUNK"] is None:
        _local_step_kernel[(M,)](*rows, *scalars, **flags, **step_flags, BLOCK=cfg["BLOCK"],
                                 num_warps=cfg["num_warps"])
        return
    chunks = triton.cdiv(d, cfg["CHUNK"])
    partial = torch.empty(M, chunks, dtype=torch.float64, device=x.base.device)
    _chunk_sq_kernel[(M, chunks)](*rows, partial, d, float(prox), **flags, CHUNK=cfg["CHUNK"], BLOCK=cfg["BLOCK"],
                                  num_warps=cfg["num_warps"])
    _chunk_update_kernel[(M, chunks)](*rows, partial, *scalars, **flags, **step_flags, CHUNK=cfg["CHUNK"],
                                      CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=cfg["BLOCK"],
                                      num_warps=cfg["num_warps"])
