"""Stats pass on the GPU: one read of the M x d client rows.

Stage 1 (``_round_stats_kernel``, one program per column block): for each chunk of BLOCK_M clients, load a
BLOCK_M x BLOCK_D tile through the row-pointer table, upcast, subtract the base (full models), accumulate
sum_i w_i x_i for the block's mean, and write each client's partial squared norm and non-finite mark; then
write the mean block and its partial ||mean||^2 (or ||mean + c*aux||^2). Stage 2 (``_finalize_kernel``) adds the partials in block
order in float64. No atomics: the result is deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ClientRows
from .launch import block_columns, block_grid, finalize_config, stats_config


@triton.jit
def _round_stats_kernel(row_ptrs, base_ptrs, like, block_seg, block_start, seg_len, seg_off, weights, mean_init,
                        aux, aux_coef, mean_out,
                        part_sq, part_bad, part_mean_sq, M,
                        HAS_BASE: tl.constexpr, HAS_INIT: tl.constexpr, HAS_AUX: tl.constexpr, SINGLE: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    seg, cols, cmask, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D)
    elem = like.dtype.element_ty
    if HAS_BASE:
        bptr = tl.load(base_ptrs + seg).to(tl.pointer_type(elem))
        base = tl.load(bptr + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_INIT:
        acc = tl.load(mean_init + off + cols, mask=cmask, other=0.0).to(ACC)
    else:
        acc = tl.zeros([BLOCK_D], dtype=ACC)
    for m0 in range(0, M, BLOCK_M):
        ms = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        mmask = ms < M
        rptr = tl.load(row_ptrs + seg * M + ms, mask=mmask, other=0).to(tl.pointer_type(elem))
        tmask = mmask[:, None] & cmask[None, :]
        x = tl.load(rptr[:, None] + cols[None, :], mask=tmask, other=0.0).to(ACC)
        if HAS_BASE:
            x = tl.where(tmask, x - base[None, :], 0.0)
        w = tl.load(weights + ms, mask=mmask, other=0.0).to(ACC)
        acc += tl.sum(x * w[:, None], axis=0)
        sq = tl.sum(x * x, axis=1)
        bad = tl.sum(x - x, axis=1)  # NaN exactly when the row holds a NaN or Inf
        tl.store(part_sq + pid * M + ms, sq.to(tl.float64), mask=mmask)
        tl.store(part_bad + pid * M + ms, (bad != 0).to(tl.int8), mask=mmask)
    tl.store(mean_out + off + cols, acc, mask=cmask)
    if HAS_AUX:  # ||mean + aux_coef * aux||^2 (FedExP-M's momentum norm) instead of ||mean||^2
        acc += aux_coef * tl.load(aux + off + cols, mask=cmask, other=0.0).to(ACC)
    acc = tl.where(cmask, acc, 0.0)
    tl.store(part_mean_sq + pid, tl.sum(acc * acc).to(tl.float64))


@triton.jit
def _finalize_kernel(part_sq, part_bad, part_mean_sq, sq_norms_out, nonfinite_out, mean_sq_out, M, NB,
                     BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ms = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mmask = ms < M
    sq = tl.zeros([BLOCK_M], dtype=tl.float64)
    bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        mask = (bs < NB)[:, None] & mmask[None, :]
        idx = bs[:, None] * M + ms[None, :]
        sq += tl.sum(tl.load(part_sq + idx, mask=mask, other=0.0), axis=0)
        bad += tl.sum(tl.load(part_bad + idx, mask=mask, other=0).to(tl.int32), axis=0)
    tl.store(sq_norms_out + ms, sq, mask=mmask)
    tl.store(nonfinite_out + ms, bad > 0, mask=mmask)
    if pid == 0:
        msq = tl.zeros([BLOCK_B], dtype=tl.float64)
        for b0 in range(0, NB, BLOCK_B):
            bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
            msq += tl.load(part_mean_sq + bs, mask=bs < NB, other=0.0)
        tl.store(mean_sq_out, tl.sum(msq))


def _row_ptrs(rows: ClientRows, device: torch.device) -> torch.Tensor:
    if rows.matrix is not None:  # computed where it is used: no host-to-device copy
        m = rows.matrix
        return torch.arange(rows.num_clients, dtype=torch.int64, device=device) * (m.stride(0) * m.element_size()) \
            + m.data_ptr()
    return rows.row_ptrs().to(device, non_blocking=True)


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor) -> None:
    device = mean_out.device
    M = rows.num_clients
    cfg = stats_config(M, rows.numel)
    lens, offs = rows.segments.tables(device)
    bseg, bstart, nb, single = block_grid(rows.segments, cfg["BLOCK_D"], device)
    part_sq = torch.empty((max(nb, 1), M), dtype=torch.float64, device=device)
    part_bad = torch.zeros((max(nb, 1), M), dtype=torch.int8, device=device)
    part_mean_sq = torch.zeros(max(nb, 1), dtype=torch.float64, device=device)
    if nb == 0:
        part_sq.zero_()
    row_ptrs = _row_ptrs(rows, device)
    base_ptrs = rows.base_ptrs().to(device, non_blocking=True) if rows.base is not None else row_ptrs
    acc = tl.float64 if mean_out.dtype == torch.float64 else tl.float32
    if nb > 0:
        _round_stats_kernel[(nb,)](
            row_ptrs, base_ptrs, rows.rows[0][0], bseg, bstart, lens, offs, weights,
            mean_out if mean_init is None else mean_init, mean_out if aux is None else aux, float(aux_coef), mean_out,
            part_sq, part_bad, part_mean_sq, M,
            HAS_BASE=rows.base is not None, HAS_INIT=mean_init is not None, HAS_AUX=aux is not None,
            SINGLE=single, ACC=acc,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
        )
    nb = max(nb, 1)
    fcfg = finalize_config(M, nb)
    _finalize_kernel[(triton.cdiv(M, fcfg["BLOCK_M"]),)](
        part_sq, part_bad, part_mean_sq, sq_norms_out, nonfinite_out, mean_sq_out, M, nb,
        BLOCK_M=fcfg["BLOCK_M"], BLOCK_B=fcfg["BLOCK_B"], num_warps=fcfg["num_warps"],
    )
