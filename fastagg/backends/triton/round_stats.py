"""Stats pass on the GPU: one read of the M x d client rows.

Stage 1 (``_round_stats_kernel``, one program per column block): for each chunk of BLOCK_M clients, load a
BLOCK_M x BLOCK_D tile through the row-pointer table, upcast, subtract the base (full models), accumulate
sum_i w_i x_i for the block's mean, and write each client's partial squared norm and non-finite mark; then
write the mean block and its partial ||mean||^2 (or ||mean + c*aux||^2). Stage 2 (``_finalize_kernel``) adds the
partials in block order in float64 (long vectors: in up to 128 ranges first, then the ranges in order). No
atomics: the result is deterministic. How many chunks' tiles are loaded ahead of the one being reduced, and in
which form, is launch.STATS_PIPELINE (variants a benchmark compares; the same bits each).

A block wholly inside its segment takes the unmasked path (``EVEN``), which with aligned rows compiles to 16-byte
loads (launch.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ClientRows, row_entries, unkept_mean
from .noise import normal_block
from .launch import (address_table, addresses_aligned, block_columns, finalize_config, off_mult,
                     rows_aligned, scalar_table, segment_tables, STATS_PIPELINE, stats_config, table_address)


@triton.jit
def _client_tile(row_ptrs, seg, ms, M, start, cmask, like, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
                 ACC: tl.constexpr, BLOCK_D: tl.constexpr, RAW: tl.constexpr):
    """Clients ``ms`` x the block's columns (from ``start``), upcast unless RAW (zeros outside; clients past M load
    nothing).
    Addresses are each row's pointer plus the block's start, plus 32-bit lane offsets: an int64 column vector
    costs two registers an element, and kept live across the client loop it pushed this kernel past 200."""
    mmask = ms < M
    rptr = tl.load(row_ptrs + seg * M + ms, mask=mmask, other=0).to(tl.pointer_type(like.dtype.element_ty))
    if ALIGNED:
        rptr = tl.multiple_of(rptr, 16)
    if EVEN:
        tmask = mmask[:, None]
    else:
        tmask = mmask[:, None] & cmask[None, :]
    lanes = tl.arange(0, BLOCK_D)
    x = tl.load((rptr + start)[:, None] + lanes[None, :], mask=tmask, other=0.0)
    if not RAW:
        x = x.to(ACC)
    return x, tmask


@triton.jit
def _stats_block(row_ptrs, seg, start, cmask, base, weights, acc, part_sq, part_bad, pid, M, like,
                 HAS_BASE: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, RAW: tl.constexpr,
                 STAGES: tl.constexpr):
    """Fold every client chunk of one column block into ``acc``; write the per-client partials. The tiles of the
    next PREFETCH (1 or 2) chunks are loaded before this chunk's reductions (whose barriers would otherwise leave no
    load in flight), held upcast or, RAW, as stored (half the registers for 2-byte inputs); PREFETCH 0 loads each
    chunk in its own iteration and leaves the loads in flight to the compiler's pipelining of the client loop
    (STAGES iterations: ``tl.range(num_stages=)``; None: none). Every variant folds the same chunks in the same
    order: the same bits (launch.STATS_PIPELINE: the default)."""
    lanes = tl.arange(0, BLOCK_M).to(tl.int64)
    if PREFETCH >= 1:
        x, tmask = _client_tile(row_ptrs, seg, lanes, M, start, cmask, like, ALIGNED, EVEN, ACC, BLOCK_D, RAW)
    if PREFETCH == 2:
        x1, tmask1 = _client_tile(row_ptrs, seg, lanes + BLOCK_M, M, start, cmask, like, ALIGNED, EVEN, ACC, BLOCK_D,
                                  RAW)
    for m0 in tl.range(0, M, BLOCK_M, num_stages=STAGES):
        ms = m0 + lanes
        mmask = ms < M
        if PREFETCH == 0:
            x, tmask = _client_tile(row_ptrs, seg, ms, M, start, cmask, like, ALIGNED, EVEN, ACC, BLOCK_D, RAW)
        else:
            x_next, tmask_next = _client_tile(row_ptrs, seg, ms + PREFETCH * BLOCK_M, M, start, cmask, like, ALIGNED,
                                              EVEN, ACC, BLOCK_D, RAW)
        xa = x.to(ACC)
        if HAS_BASE:
            xa = tl.where(tmask, xa - base[None, :], 0.0)
        w = tl.load(weights + ms, mask=mmask, other=0.0).to(ACC)
        acc += tl.sum(xa * w[:, None], axis=0)
        xd = xa.to(tl.float64)  # squares and their sums in float64: float32 squares of 1e18 overflow a block's sum
        sq = tl.sum(xd * xd, axis=1)
        bad = tl.sum(xa - xa, axis=1)  # NaN exactly when the row holds a NaN or Inf
        tl.store(part_sq + pid * M + ms, sq.to(tl.float64), mask=mmask)
        tl.store(part_bad + pid * M + ms, (bad != 0).to(tl.int8), mask=mmask)
        if PREFETCH == 1:
            x, tmask = x_next, tmask_next
        elif PREFETCH == 2:
            x, tmask, x1, tmask1 = x1, tmask1, x_next, tmask_next
    return acc


@triton.jit
def _round_stats_kernel(row_ptrs, base_ptrs, like, block_seg, block_start, seg_len, seg_off, weights, mean_init,
                        aux, aux_coef_ptr, mean_out,
                        part_sq, part_bad, part_mean_sq, M, noise_seed, noise_round_lo, noise_round_hi,
                        HAS_BASE: tl.constexpr, HAS_INIT: tl.constexpr, HAS_AUX: tl.constexpr, NOISE: tl.constexpr,
                        SINGLE: tl.constexpr,
                        ALIGNED: tl.constexpr, OFF_MULT: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, RAW: tl.constexpr,
                        STAGES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    seg, start, cols, full, cmask, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D,
                                                       OFF_MULT)
    base = tl.zeros([BLOCK_D], dtype=ACC)
    if HAS_BASE:
        bptr = table_address(base_ptrs, seg, like, ALIGNED)
        base = tl.load(bptr + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_INIT:
        acc = tl.load(mean_init + off + cols, mask=cmask, other=0.0).to(ACC)
    else:
        acc = tl.zeros([BLOCK_D], dtype=ACC)
    if full:
        acc = _stats_block(row_ptrs, seg, start, cmask, base, weights, acc, part_sq, part_bad, pid, M, like,
                           HAS_BASE, ALIGNED, True, ACC, BLOCK_M, BLOCK_D, PREFETCH, RAW, STAGES)
        if NOISE:  # differential privacy: the noise is added as the mean is written (sigma: aux_coef_ptr[1])
            acc += tl.load(aux_coef_ptr + 1).to(ACC) * normal_block(off + start, noise_seed, noise_round_lo,
                                                                     noise_round_hi, BLOCK_D, OFF_MULT).to(ACC)
        tl.store(mean_out + off + cols, acc)
    else:
        acc = _stats_block(row_ptrs, seg, start, cmask, base, weights, acc, part_sq, part_bad, pid, M, like,
                           HAS_BASE, ALIGNED, False, ACC, BLOCK_M, BLOCK_D, PREFETCH, RAW, STAGES)
        if NOISE:
            acc += tl.load(aux_coef_ptr + 1).to(ACC) * normal_block(off + start, noise_seed, noise_round_lo,
                                                                     noise_round_hi, BLOCK_D, OFF_MULT).to(ACC)
        tl.store(mean_out + off + cols, acc, mask=cmask)
    if HAS_AUX:  # ||mean + aux_coef * aux||^2 (FedExP-M's momentum norm) instead of ||mean||^2
        acc += tl.load(aux_coef_ptr).to(ACC) * tl.load(aux + off + cols, mask=cmask, other=0.0).to(ACC)
    acc = tl.where(cmask, acc, 0.0).to(tl.float64)
    tl.store(part_mean_sq + pid, tl.sum(acc * acc))


@triton.jit
def _finalize_kernel(part_sq, part_bad, part_mean_sq, sq_out, bad_out, mean_sq_out, M, NB, ROWS,
                     BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program (c, s) sums rows [s * ROWS, (s + 1) * ROWS) of the [NB, M] partial tables, in row order, for clients
    ``c * BLOCK_M ...`` into row s of the outputs (and the mean's partials, in the programs of c = 0)."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    ms = pid * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mmask = ms < M
    lo = s * ROWS
    hi = tl.minimum(lo + ROWS, NB)
    sq = tl.zeros([BLOCK_M], dtype=tl.float64)
    bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for b0 in range(lo, hi, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        mask = (bs < hi)[:, None] & mmask[None, :]
        idx = bs[:, None] * M + ms[None, :]
        sq += tl.sum(tl.load(part_sq + idx, mask=mask, other=0.0), axis=0)
        bad += tl.sum(tl.load(part_bad + idx, mask=mask, other=0).to(tl.int32), axis=0)
    tl.store(sq_out + s * M + ms, sq, mask=mmask)
    tl.store(bad_out + s * M + ms, bad > 0, mask=mmask)
    if pid == 0:
        msq = tl.zeros([BLOCK_B], dtype=tl.float64)
        for b0 in range(lo, hi, BLOCK_B):
            bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
            msq += tl.load(part_mean_sq + bs, mask=bs < hi, other=0.0)
        tl.store(mean_sq_out + s, tl.sum(msq))


def _finalize(part_sq, part_bad, part_mean_sq, sq_norms_out, nonfinite_out, mean_sq_out, M: int, nb: int) -> None:
    """Sum the per-block partials. Many blocks (a long d) are first summed in up to 128 row ranges in parallel,
    then the ranges in order: one program walking 50,000 rows took 0.65 ms of a 3.6 ms round on an H200."""
    splits = min(128, triton.cdiv(nb, 64))
    if splits > 1:
        rows = triton.cdiv(nb, splits)
        splits = triton.cdiv(nb, rows)
        dev = part_sq.device
        sq2 = torch.empty((splits, M), dtype=torch.float64, device=dev)
        bad2 = torch.empty((splits, M), dtype=torch.int8, device=dev)
        msq2 = torch.empty(splits, dtype=torch.float64, device=dev)
        cfg = finalize_config(M, rows)
        _finalize_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), splits)](
            part_sq, part_bad, part_mean_sq, sq2, bad2, msq2, M, nb, rows,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_B=cfg["BLOCK_B"], num_warps=cfg["num_warps"])
        part_sq, part_bad, part_mean_sq, nb = sq2, bad2, msq2, splits
    cfg = finalize_config(M, nb)
    _finalize_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), 1)](
        part_sq, part_bad, part_mean_sq, sq_norms_out, nonfinite_out, mean_sq_out, M, nb, nb,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_B=cfg["BLOCK_B"], num_warps=cfg["num_warps"])


def _row_table(rows: ClientRows, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(the row-address table ``[s * M + i]`` on ``device``, whether every address is 16-byte aligned)."""
    if rows.matrix is not None:  # computed where it is used: no host-to-device copy
        m = rows.matrix
        table = torch.arange(rows.num_clients, dtype=torch.int64, device=device) * (m.stride(0) * m.element_size()) \
            + m.data_ptr()
        return table, rows_aligned(m)
    addresses = [r.data_ptr() for seg in row_entries(rows) for r in seg]  # (a state_dict's entries: no views made)
    return address_table(addresses, device), addresses_aligned(addresses)


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor | None, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor, noise=None) -> None:
    if mean_out is None:  # (a scratch: no store-free variant of this pass yet)
        mean_out = unkept_mean(rows, mean_init, noise)
    device = mean_out.device
    sigma, seed, rnd = (0.0, 0, 0) if noise is None else noise
    M = rows.num_clients
    cfg = stats_config(M, rows.numel, rows.dtype.itemsize)
    lens, offs, bseg, bstart, nb, single = segment_tables(rows.segments, cfg["BLOCK_D"], device)
    part_sq = torch.empty((max(nb, 1), M), dtype=torch.float64, device=device)
    part_bad = torch.zeros((max(nb, 1), M), dtype=torch.int8, device=device)
    part_mean_sq = torch.zeros(max(nb, 1), dtype=torch.float64, device=device)
    if nb == 0:
        part_sq.zero_()
    row_ptrs, aligned = _row_table(rows, device)
    base_ptrs = row_ptrs
    if rows.base is not None:
        base_addresses = [b.data_ptr() for b in rows.base]
        base_ptrs = address_table(base_addresses, device)
        aligned = aligned and addresses_aligned(base_addresses)
    acc = tl.float64 if mean_out.dtype == torch.float64 else tl.float32
    if nb > 0:
        _round_stats_kernel[(nb,)](
            row_ptrs, base_ptrs, rows.rows[0][0], bseg, bstart, lens, offs, weights,
            mean_out if mean_init is None else mean_init, mean_out if aux is None else aux,
            scalar_table((aux_coef, sigma), device), mean_out,
            part_sq, part_bad, part_mean_sq, M, int(seed), int(rnd) & 0xFFFFFFFF, int(rnd) >> 32,
            HAS_BASE=rows.base is not None, HAS_INIT=mean_init is not None, HAS_AUX=aux is not None,
            NOISE=sigma > 0,
            SINGLE=single, ALIGNED=aligned, OFF_MULT=off_mult(rows.segments, mean_out.element_size()), ACC=acc,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
            **{k: cfg.get(k, v) for k, v in STATS_PIPELINE.items()},
        )
    _finalize(part_sq, part_bad, part_mean_sq, sq_norms_out, nonfinite_out, mean_sq_out, M, max(nb, 1))
