"""The two passes of Byzantine-robust aggregation on the GPU (the rules are in ``fastagg/robust.py``).

``coord_select``: one program per column block loads a BLOCK_D x BLOCK_M tile (each thread owns whole columns; the
clients are the minor axis, padded to a power of two with +inf, which sorts last, as does a NaN), sorts every
column with a bitonic network of ``tl.minimum`` / ``tl.maximum`` on the registers of its thread (``_bitonic_rows``;
past what a thread holds, ``tl.sort`` with the clients across threads: ``select_config``; the client count, the
window's positions and the padding are compile-time constants, so the compiler drops the comparators whose
outputs the window does not read), and writes the mean of fixed sorted positions (median,
trimmed mean; only they are widened to float64) or of the values nearest the median (MeaMed, the window rule of
``reference.select_sorted``). Each client's squared norm (float64 column sums of the block, on the tensor cores as
``ones @ squares``: no shuffle per client) and non-finite mark come from the same read (partials per block, summed
by the stats pass's finalize kernel).

``gram``: program (p, t) accumulates tile t (clients bi x bj, upper triangle) of ``G = X X^T`` over its range of
column blocks with float64 ``tl.dot`` (the updates formed against ``base`` as they are loaded), writing one
partial per column range; the host sums the partials in order. No atomics: both passes are deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...rows import ClientRows
from .launch import _pow2_at_least, address_table, block_columns, interpreting, segment_tables
from .round_stats import _finalize, _row_table

MAX_SELECT_CLIENTS = 256  # more clients: fastagg.robust sorts column blocks with torch (reference.coord_select)


@triton.jit
def _bitonic_rows(x, LOG_M: tl.constexpr):
    """``x`` [D, 2**LOG_M] with every row sorted ascending: a bitonic network along the rows, runs of 2**k sorted
    up and down alternately and merged (``_exchange`` at distances 2**(k-1), ..., 1) until one run is left. The
    clients lie within a thread (``select_config``), so the views and splits move no data. NaN-free input (the
    min and max of a NaN are not a permutation)."""
    for k in tl.static_range(1, LOG_M + 1):
        for i in tl.static_range(0, k):
            x = _exchange(x, k, k - 1 - i, LOG_M)
    return x


@triton.jit
def _exchange(x, K: tl.constexpr, J: tl.constexpr, LOG_M: tl.constexpr):
    """One stage of the network: rows of ``x`` [D, N] viewed as [D, A, 2, 2**J], the halves of each pair split
    (``tl.split``), their min and max written back in order, descending in the runs of 2**K at odd positions
    (bit K of a position: bit K - J - 1 of its index along A) before the last merge (K = LOG_M)."""
    D: tl.constexpr = x.shape[0]
    N: tl.constexpr = 1 << LOG_M
    B: tl.constexpr = 1 << J
    A: tl.constexpr = N // (2 * B)
    a, b = tl.split(tl.permute(tl.reshape(x, [D, A, 2, B]), [0, 1, 3, 2]))
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    if K < LOG_M:
        down = (((tl.arange(0, A) >> (K - J - 1)) & 1) == 1)[None, :, None]
        lo, hi = tl.where(down, hi, lo), tl.where(down, lo, hi)
    return tl.reshape(tl.permute(tl.join(lo, hi), [0, 1, 3, 2]), [D, N])


@triton.jit
def _select_kernel(row_ptrs, base_ptrs, like, block_seg, block_start, seg_len, seg_off, out, part_sq, part_bad,
                   M: tl.constexpr, FIRST: tl.constexpr, COUNT: tl.constexpr, NEAREST: tl.constexpr,
                   HAS_BASE: tl.constexpr, SINGLE: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr,
                   LOG_M: tl.constexpr, BLOCK_D: tl.constexpr, TL_SORT: tl.constexpr, DOT_NORMS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    seg, start, cols, full, cmask, off = block_columns(block_seg, block_start, seg_len, seg_off, SINGLE, BLOCK_D, 1)
    ms = tl.arange(0, BLOCK_M).to(tl.int64)
    mmask = ms < M
    rptr = tl.load(row_ptrs + seg * M + ms, mask=mmask, other=0).to(tl.pointer_type(like.dtype.element_ty))
    mask = cmask[:, None] & mmask[None, :]
    x = tl.load(rptr[None, :] + cols[:, None], mask=mask, other=0.0).to(V)  # [BLOCK_D, BLOCK_M]
    if HAS_BASE:
        bptr = tl.load(base_ptrs + seg).to(tl.pointer_type(like.dtype.element_ty))
        x = tl.where(mask, x - tl.load(bptr + cols, mask=cmask, other=0.0).to(V)[:, None], 0.0)
    xd = x.to(tl.float64)
    if DOT_NORMS:  # the column sums on the tensor cores (every row of ones @ squares): no shuffles per client
        sums = tl.dot(tl.full([16, BLOCK_D], 1.0, tl.float64), xd * xd)
        sq = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, sums, 0.0), axis=0)
    else:
        sq = tl.sum(xd * xd, axis=0)
    tl.store(part_sq + pid * M + ms, sq, mask=mmask)
    if V == tl.float64:  # a finite float64 value may have an infinite square
        bad = tl.sum(x - x, axis=0) != 0
    else:  # float64 squares of float32 values: the block's sum is finite exactly when all are
        bad = sq - sq != 0
    tl.store(part_bad + pid * M + ms, bad.to(tl.int8), mask=mmask)
    x = tl.where(mmask[None, :] & (x == x), x, float("inf"))  # NaN sorts as +inf (its client is marked above)
    if TL_SORT:
        s = tl.sort(x)  # every column sorted; the padding last
    else:
        s = _bitonic_rows(x, LOG_M)
    pos = ms[None, :]
    if NEAREST:  # one sorted value out of a column: a sum with zeros, exact in V
        half = M // 2
        mid = tl.sum(tl.where(pos == half, s, 0.0), axis=1).to(tl.float64)
        below = tl.sum(tl.where(pos == half - 1, s, 0.0), axis=1).to(tl.float64)
        med = tl.where(M % 2 == 1, mid, 0.5 * (below + mid))
        f = M - COUNT
        lo = tl.zeros([BLOCK_D], dtype=tl.float64)
        for t in range(0, f):  # lo = #{t < f : med - s[t] > s[M - f + t] - med}
            a = tl.sum(tl.where(pos == t, s, 0.0), axis=1).to(tl.float64)
            b = tl.sum(tl.where(pos == M - f + t, s, 0.0), axis=1).to(tl.float64)
            lo += tl.where(med - a > b - med, 1.0, 0.0)
        p = pos.to(tl.float64)
        take = (p >= lo[:, None]) & (p < lo[:, None] + COUNT)
    else:  # fixed positions of registers (the clients lie within a thread): only the window's are widened
        take = (pos >= FIRST) & (pos < FIRST + COUNT)
    est = tl.sum(tl.where(take, s, 0.0).to(tl.float64), axis=1) / COUNT
    tl.store(out + off + cols, est.to(out.dtype.element_ty), mask=cmask)


def select_config(num_clients: int, numel: int, wide: bool = False, element_size: int = 4) -> dict:
    """BLOCK_M: the clients padded to a power of two (the sorting networks need one). On the GPU each thread holds
    whole columns (BLOCK_D = 32 lanes x num_warps x columns a thread; the loads cannot be vectorized, the row
    addresses come from a table, so one column a lane per repetition): 1 column a thread from 32 clients (2 from
    16, 4 from 8 or fewer), so that the network's registers stay within a thread. Past what a thread's registers
    hold (a float64 tile of more than 16 clients, a float32 one of more than 128) the min / max network would
    spill, and compile for minutes: those take the previous pass, ``tl.sort`` (``TL_SORT``) over 4096-element
    tiles with the clients across threads (BLOCK_D = 4096 / BLOCK_M). ``DOT_NORMS``: the squared norms by
    ``tl.dot`` (16 clients or more, tl.dot's smallest; not from 16-bit rows, whose float64 dot triton 3.7 cannot
    lower for sm_90, as in ``gram``). Few large programs under the interpreter."""
    block_m = max(2, _pow2_at_least(num_clients))
    cfg = dict(BLOCK_M=block_m, LOG_M=block_m.bit_length() - 1, TL_SORT=block_m > (16 if wide else 128),
               num_warps=4, DOT_NORMS=block_m >= 16 and element_size >= 4)
    if interpreting():
        return dict(cfg, BLOCK_D=max(16, min((1 << 16) // block_m, _pow2_at_least(-(-numel // 32)))))
    if cfg["TL_SORT"]:
        return dict(cfg, BLOCK_D=max(16, 4096 // block_m))
    return dict(cfg, BLOCK_D=32 * cfg["num_warps"] * max(1, min(4, 32 // block_m)))


def coord_select(*, rows: ClientRows, rule: str, first: int, count: int, out: torch.Tensor,
                 sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor, _config: dict | None = None) -> None:
    """``_config``: entries replacing ``select_config``'s (BLOCK_D, num_warps, TL_SORT; the card's benchmark)."""
    M, device = rows.num_clients, out.device
    wide = rows.base is not None or rows.dtype == torch.float64
    cfg = dict(select_config(M, rows.numel, wide, rows.dtype.itemsize), **(_config or {}))
    lens, offs, bseg, bstart, nb, single = segment_tables(rows.segments, cfg["BLOCK_D"], device)
    part_sq = torch.zeros((max(nb, 1), M), dtype=torch.float64, device=device)
    part_bad = torch.zeros((max(nb, 1), M), dtype=torch.int8, device=device)
    row_ptrs, _ = _row_table(rows, device)
    base_ptrs = row_ptrs if rows.base is None else address_table([b.data_ptr() for b in rows.base], device)
    if nb > 0:
        _select_kernel[(nb,)](
            row_ptrs, base_ptrs, rows.rows[0][0], bseg, bstart, lens, offs, out, part_sq, part_bad, M=M,
            FIRST=0 if rule == "nearest" else first, COUNT=count, NEAREST=rule == "nearest",
            HAS_BASE=rows.base is not None, SINGLE=single, V=tl.float64 if wide else tl.float32,
            BLOCK_M=cfg["BLOCK_M"], LOG_M=cfg["LOG_M"], BLOCK_D=cfg["BLOCK_D"], TL_SORT=cfg["TL_SORT"],
            DOT_NORMS=cfg["DOT_NORMS"], num_warps=cfg["num_warps"])
    mean_sq = torch.empty(1, dtype=torch.float64, device=device)
    _finalize(part_sq, part_bad, torch.zeros(max(nb, 1), dtype=torch.float64, device=device), sq_norms_out,
              nonfinite_out, mean_sq, M, max(nb, 1))


@triton.jit
def _gram_kernel(row_ptrs, base_ptrs, like, block_seg, block_start, seg_len, tile_i, tile_j, part, M, NB, PER,
                 HAS_BASE: tl.constexpr, SINGLE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                 BY_HAND: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    bi = tl.load(tile_i + t).to(tl.int64)
    bj = tl.load(tile_j + t).to(tl.int64)
    mi = bi * BM + tl.arange(0, BM).to(tl.int64)
    mj = bj * BM + tl.arange(0, BM).to(tl.int64)
    acc = tl.zeros([BM, BM], dtype=tl.float64)
    for b in range(p * PER, tl.minimum(NB, (p + 1) * PER)):
        if SINGLE:
            seg = b * 0
            start = b * BK
        else:
            seg = tl.load(block_seg + b)
            start = tl.load(block_start + b)
        cols = start + tl.arange(0, BK).to(tl.int64)
        cmask = cols < tl.load(seg_len + seg)
        pi = tl.load(row_ptrs + seg * M + mi, mask=mi < M, other=0).to(tl.pointer_type(like.dtype.element_ty))
        pj = tl.load(row_ptrs + seg * M + mj, mask=mj < M, other=0).to(tl.pointer_type(like.dtype.element_ty))
        a = tl.load(pi[:, None] + cols[None, :], mask=(mi < M)[:, None] & cmask[None, :], other=0.0).to(tl.float64)
        c = tl.load(pj[:, None] + cols[None, :], mask=(mj < M)[:, None] & cmask[None, :], other=0.0).to(tl.float64)
        if HAS_BASE:
            bptr = tl.load(base_ptrs + seg).to(tl.pointer_type(like.dtype.element_ty))
            base = tl.load(bptr + cols, mask=cmask, other=0.0).to(tl.float64)
            a = tl.where((mi < M)[:, None] & cmask[None, :], a - base[None, :], 0.0)
            c = tl.where((mj < M)[:, None] & cmask[None, :], c - base[None, :], 0.0)
        if BY_HAND:  # 16-bit rows: triton 3.7 cannot lower a float64 tl.dot fed by 16-bit loads for sm_90
            acc += tl.sum(a[:, None, :] * c[None, :, :], axis=2)
        else:
            acc += tl.dot(a, tl.trans(c))
    out = part + p * M * M + mi[:, None] * M + mj[None, :]
    tl.store(out, acc, mask=(mi < M)[:, None] & (mj < M)[None, :])


def gram_config(num_clients: int, numel: int, element_size: int = 4) -> dict:
    """BM clients a side per tile (at least 16, tl.dot's smallest), BK columns per block, and the number of column
    ranges P (each program sums its range's blocks in order): about 264 programs per tile on the GPU (a guess to
    be measured on the card), 4 under the interpreter. 16-bit rows multiply by hand (BY_HAND: no tl.dot), 16
    columns at a time (a BM x BM x 16 block of float64 products)."""
    bm = min(32, max(16, _pow2_at_least(num_clients)))
    if element_size < 4:
        return dict(BM=bm, BK=16, ranges=4 if interpreting() else 264, num_warps=4 if bm == 16 else 8,
                    BY_HAND=True)
    if interpreting():
        return dict(BM=bm, BK=max(16, min(8192, _pow2_at_least(-(-numel // 8)))), ranges=4, num_warps=4)
    return dict(BM=bm, BK=64, ranges=264, num_warps=4)


def gram(*, rows: ClientRows, gram_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    M, device = rows.num_clients, gram_out.device
    cfg = gram_config(M, rows.numel, rows.dtype.itemsize)
    lens, _, bseg, bstart, nb, single = segment_tables(rows.segments, cfg["BK"], device)
    ranges = max(1, min(cfg["ranges"], nb))
    per = triton.cdiv(max(nb, 1), ranges)
    ranges = triton.cdiv(max(nb, 1), per)
    nbm = triton.cdiv(M, cfg["BM"])
    ti, tj = zip(*[(i, j) for i in range(nbm) for j in range(i, nbm)])
    tiles = address_table(list(ti) + list(tj), device)
    part = torch.zeros((ranges, M, M), dtype=torch.float64, device=device)
    row_ptrs, _ = _row_table(rows, device)
    base_ptrs = row_ptrs if rows.base is None else address_table([b.data_ptr() for b in rows.base], device)
    if nb > 0:
        _gram_kernel[(ranges, len(ti))](
            row_ptrs, base_ptrs, rows.rows[0][0], bseg, bstart, lens, tiles[:len(ti)], tiles[len(ti):], part, M, nb,
            per, HAS_BASE=rows.base is not None, SINGLE=single, BM=cfg["BM"], BK=cfg["BK"],
            BY_HAND=cfg.get("BY_HAND", False), num_warps=cfg["num_warps"])
    upper = part.sum(dim=0).triu()
    gram_out.view(M, M).copy_(upper + upper.triu(1).T)
    _mark_nonfinite(rows, gram_out.view(M, M).diagonal(), nonfinite_out)


def _mark_nonfinite(rows: ClientRows, diag: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    """A client whose ``G_ii`` is not finite is scanned (NaN or Inf in its update, or only float64 squares that
    overflowed); the others are finite."""
    nonfinite_out.zero_()
    for i in torch.nonzero(~torch.isfinite(diag)).flatten().tolist():
        for s, seg in enumerate(rows.rows):
            x = seg[i] if rows.base is None else seg[i].to(torch.float64) - rows.base[s].to(torch.float64)
            if not bool(torch.isfinite(x).all()):
                nonfinite_out[i] = True
                break
